"""The decode-kernel benchmark (kvlab.steps.kernel_bench): on the CPU at toy sizes (Triton interpreted, so no timing
claim), it writes one row per format × path × context × batch with the bytes each path must read, and the report
draws its section from such rows — or says it was not measured when the run had no CUDA."""

from __future__ import annotations

import shutil

import duckdb
import pytest
import torch

from kvlab.steps import kernel_bench
from kvlab.report.build import build

CARD = {"name": "toy", "num_kv_heads": 2, "num_query_heads": 4, "head_dim": 16}
SPEC = {"context_tokens": [100, 161], "batches": [1, 2], "group": 32, "residual": 8, "repeats": 1}


@pytest.fixture(scope="module")
def rows():
    return kernel_bench.bench(CARD, SPEC, "cpu", torch.float32)


def test_one_row_per_format_path_context_and_batch(rows):
    per_point = {("dense", "sdpa"), *((f, p) for f in ("fp8", "int4", "int2") for p in ("triton", "dequantize"))}
    assert len(rows) == len(per_point) * 2 * 2
    for (tokens, batch), group in rows.groupby(["context_tokens", "batch"]):
        assert set(zip(group["format"], group["path"])) == per_point
    assert (rows["ms"] > 0).all() and (rows["call_ms"] == rows["ms"]).all()  # on the CPU both are the wall time
    assert (rows["gb_per_s"] - rows["bytes_read"] / rows["ms"] / 1e6).abs().max() < 1e-9


@pytest.mark.parametrize("fmt, bits", [("int4", 4), ("int2", 2)])
def test_bytes_read_are_the_stored_cache_plus_query_and_output(rows, fmt, bits):
    """KIVI at T tokens: T-1 stored (the newest is the step's own), of which the complete groups beyond the residual
    are codes with an fp16 scale and zero per (group, channel) for keys and per (token, group of min(G, D)
    channels) for values."""
    h, hq, d, g, r = 2, 4, 16, 32, 8
    for _, row in rows[(rows["format"] == fmt) & (rows["path"] == "triton")].iterrows():
        b, stored = row["batch"], row["context_tokens"] - 1
        quantized = (stored - r) // g * g
        codes = 2 * b * h * quantized * d * bits // 8
        meta = b * h * (quantized // g) * d * 4 + b * h * quantized * (d // min(g, d)) * 4
        residual = 2 * b * h * (stored - quantized) * d * 4
        step = b * hq * d * 4 + 2 * b * h * d * 4 + b * hq * d * 4  # query, new key and value, output
        assert row["bytes_read"] == codes + meta + residual + step
        assert row["bits"] == bits
    dense = rows[rows["path"] == "sdpa"]
    assert (dense["bytes_read"] == 2 * dense["batch"] * h * dense["context_tokens"] * d * 4 + 2 * dense["batch"] * hq * d * 4).all()


@pytest.mark.slow  # the smoke DAG
def test_report_draws_the_kernel_section_from_rows(rows, smoke_run, tmp_path):
    smoke_page = (smoke_run / "results" / "report.html").read_text()
    assert "Not measured in this run" in smoke_page and "device: cuda" in smoke_page
    db = tmp_path / "kvlab.duckdb"
    shutil.copy(smoke_run / "results" / "kvlab.duckdb", db)
    con = duckdb.connect(str(db))
    con.register("frame", rows)
    con.execute("INSERT INTO decode_kernels SELECT * FROM frame")
    con.close()
    build(db, tmp_path / "report.html", "t")
    page = (tmp_path / "report.html").read_text()
    assert "Not measured in this run" not in page
    assert "ms per call on the device" in page and "GB/s (bytes the path must read)" in page and "speedup_vs_sdpa" in page


def test_command_line_for_a_bare_gpu_machine(tmp_path, capsys):
    out = tmp_path / "rows.parquet"
    kernel_bench.main(["--shape", "2,4,16", "--shape", "1,2,32", "--contexts", "90", "--batches", "1", "--group", "32",
                       "--residual", "8", "--repeats", "1", "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    import pandas as pd

    rows = pd.read_parquet(out)
    assert len(rows) == 2 * 7 and set(rows["head_dim"]) == {16, 32} and set(rows["model"]) == {"shape 2/4/16", "shape 1/2/32"}
    with pytest.raises(SystemExit):
        kernel_bench.main(["--shape", "8x32", "--out", str(out)])
    assert "--shape '8x32': expected three integers kv_heads,query_heads,head_dim" in capsys.readouterr().err


def test_a_head_dim_the_kernel_cannot_read_is_refused_before_timing():
    with pytest.raises(ValueError, match="head_dim 96 has no Triton decode kernel; it reads power-of-two head dims"):
        kernel_bench.bench({**CARD, "head_dim": 96}, SPEC, "cpu", torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device time comes from CUDA graph replays")
def test_on_cuda_device_time_leaves_the_host_out():
    """`ms` replays each call from a CUDA graph; `call_ms` calls it from Python. At toy sizes every path's
    kernels take microseconds and its host work (checks, allocations, two or more launches) takes longer, so
    the device time is the shorter of the two for most rows."""
    rows = kernel_bench.bench(CARD, {**SPEC, "repeats": 5}, "cuda", torch.bfloat16)
    assert (rows["ms"] > 0).all() and (rows["call_ms"] > 0).all()
    assert (rows["ms"] < rows["call_ms"]).mean() > 0.5
