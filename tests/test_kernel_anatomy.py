"""The decode kernel compiled for sm_90 without a GPU (kvlab.tools.kernel_anatomy): its main loop is found in the
machine code and carries the design's properties — tensor-core dots, codes turned into fp16 without
integer-to-float conversions, and registers and shared memory that let 4 programs share a multiprocessor."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pandas as pd
import pytest

from kvlab.tools import kernel_anatomy

H100_SHARED_PER_SM, H100_REGISTERS_PER_SM = 233472, 65536


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The CLI as a user runs it, in a process without the interpreter flag the test session sets."""
    out = tmp_path_factory.mktemp("anatomy") / "anatomy.parquet"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "kvlab.tools.kernel_anatomy", "--format", "int4", "--format", "int2",
                    "--head-dim", "64", "--out", str(out)], check=True, env=env, capture_output=True, timeout=600)
    return pd.read_parquet(out).set_index("format")


@pytest.mark.slow
def test_the_int4_and_int2_loops_use_tensor_cores_and_no_int_to_float_conversion(rows):
    """Per token of a tile, the loop the tool found loads the token's key and value codes and does both dots on
    tensor cores. Every warp runs the loop's instructions, so with `num_warps` warps: a warp's global load moves at
    most 32 threads x 16 bytes, and an mma.sync (HMMA.16816, the largest for 16-bit inputs; a 16-row dot takes no
    warpgroup MMA) 16 x 8 x 16 multiply-adds, of the 2 x rows x head_dim per token of the scores' dot and the values'
    (rows: the query heads per KV head, padded to the MMA's 16)."""
    assert list(rows.columns) == kernel_anatomy.COLUMNS[1:]
    rep = inspect.signature(kernel_anatomy.compile_variant).parameters["rep"].default
    block_rows = max(16, 1 << (rep - 1).bit_length())
    for fmt in ("int4", "int2"):
        row = rows.loc[fmt]
        bits = int(fmt.removeprefix("int"))
        assert row.arch == "sm_90" and row.block_t == 128
        assert row.per_token_global_memory * row.num_warps * 32 * 16 >= 2 * row.head_dim * bits / 8
        assert row.per_token_tensor_core * row.num_warps * 16 * 8 * 16 >= 2 * block_rows * row.head_dim
        assert row.per_token_int_to_float == 0
        assert row.per_token == pytest.approx(row.loop_instructions / row.block_t)


def test_four_programs_fit_on_one_h100_multiprocessor(rows):
    for fmt in ("int4", "int2"):
        row = rows.loc[fmt]
        assert 4 * (row.shared_bytes + 1024) <= H100_SHARED_PER_SM
        assert 4 * row.num_warps * 32 * row.registers <= H100_REGISTERS_PER_SM


def test_a_format_or_head_dim_the_kernel_does_not_read_is_refused_by_name():
    with pytest.raises(ValueError, match="format 'dense': the kernel reads 'fp8', 'int4' or 'int2'"):
        kernel_anatomy.compile_variant("dense", 64)
    with pytest.raises(ValueError, match="head_dim 96: the kernel's tiles need a power of two from 16 to 256"):
        kernel_anatomy.compile_variant("int4", 96)
    with pytest.raises(ValueError, match="format 'fp8' on sm_80: the kernel reads E4M3 codes from sm_89 on"):
        kernel_anatomy.compile_variant("fp8", 64, arch=80)
