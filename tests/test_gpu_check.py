"""The GPU device check (gpu/check.sh, kvlab.tools.gpu_check) on a machine without a GPU: the targets' PASS/FAIL on rows
whose answer is known, and the script's dry run (CUDA tests collected, benchmark and decode point on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlab.tools import gpu_check

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"kv_heads": 8, "query_heads": 32, "head_dim": 128, "context_tokens": 32768, "batch": 8}


def kernel_rows(ms: dict[str, float], gb_per_s: float = 4000.0, **at) -> pd.DataFrame:
    """One row per format: dense via SDPA, the others via the Triton kernel (every row at `gb_per_s`)."""
    return pd.DataFrame([{**LLAMA, **at, "format": f, "path": "sdpa" if f == "dense" else "triton", "ms": t,
                          "gb_per_s": gb_per_s} for f, t in ms.items()])


def e2e_rows(dense_ms: float, int4_ms: float) -> pd.DataFrame:
    return pd.DataFrame([{"cache": c, "batch": 8, "context_tokens": 32768, "graph_step_ms": t}
                         for c, t in (("dense", dense_ms), ("int4", int4_ms))])


def verdicts(kernels: pd.DataFrame, e2e: pd.DataFrame, gb_per_s: float = 4800.0) -> list[bool]:
    return [t.passed for t in gpu_check.targets(kernels, e2e, 32768, 8, gb_per_s)]


def test_targets_met():
    # INT4 3x and 4000/4800 = 83% of the bandwidth, FP8 2x, INT2 below INT4, end to end 1.25x
    assert verdicts(kernel_rows({"dense": 3.0, "fp8": 1.5, "int4": 1.0, "int2": 0.8}), e2e_rows(5.0, 4.0)) == [True] * 5


def test_each_target_missed_fails_alone():
    # INT4 2.4x (< 2.5), FP8 1.7x (< 1.8), INT2 slower than INT4; the bandwidth 3000/4800 = 62%; INT4 slower end to end
    results = gpu_check.targets(kernel_rows({"dense": 2.4, "fp8": 2.4 / 1.7, "int4": 1.0, "int2": 1.1}, 3000.0),
                                e2e_rows(4.0, 4.1), 32768, 8, 4800.0)
    assert [t.passed for t in results] == [False] * 5
    assert results[0].measured.startswith("2.40x") and results[1].measured.startswith("62%")


def test_the_bandwidth_share_is_of_the_device_bandwidth_given():
    rows = kernel_rows({"dense": 3.0, "fp8": 1.5, "int4": 1.0, "int2": 0.8}, 3000.0)
    assert verdicts(rows, e2e_rows(5.0, 4.0), gb_per_s=4000.0)[1] and not verdicts(rows, e2e_rows(5.0, 4.0))[1]


def test_targets_read_only_the_llama_layer_at_the_asked_context_and_batch():
    good = {"dense": 3.0, "fp8": 1.5, "int4": 1.0, "int2": 0.8}
    other = pd.concat([kernel_rows(good, kv_heads=2, query_heads=14, head_dim=64), kernel_rows(good, batch=1),
                       kernel_rows(good, context_tokens=8192)])
    results = gpu_check.targets(other, e2e_rows(5.0, 4.0), 32768, 8, 4800.0)
    assert [t.passed for t in results[:4]] == [False] * 4 and {t.measured for t in results[:4]} == {"no row"}


def test_without_rows_every_target_fails():
    results = gpu_check.targets(pd.DataFrame(), pd.DataFrame(), 32768, 8, 4800.0)
    assert len(results) == 5 and not any(t.passed for t in results)
    nan = e2e_rows(float("nan"), float("nan"))  # a CPU run: no graph step
    assert gpu_check.targets(pd.DataFrame(), nan, 32768, 8, 4800.0)[-1].measured == "no graph-step rows"


def test_a_bad_argument_is_one_line():
    proc = subprocess.run(["bash", str(ROOT / "gpu" / "check.sh"), "--fast"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "unknown argument '--fast'" in proc.stderr


@pytest.mark.slow
def test_dry_run_lists_its_stages_and_summarises_cpu_rows(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "gpu" / "check.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    stages = ["== install", "== tests", "== kernels", "== e2e", "== memory", "== summary"]
    assert [out.index(s) for s in stages] == sorted(out.index(s) for s in stages)
    assert "--collect-only" in out and "tests collected" in out
    kernels, e2e = pd.read_parquet(tmp_path / "kernels.parquet"), pd.read_parquet(tmp_path / "e2e.parquet")
    assert set(zip(kernels["kv_heads"], kernels["query_heads"], kernels["head_dim"])) == {(8, 32, 128), (2, 14, 64)}
    assert list(e2e["cache"]) == ["dense", "int4"] and e2e["graph_step_ms"].isna().all()  # no CUDA graph on the CPU
    assert "Qwen2.5-0.5B config, random weights" in out and "targets pass" in out
    assert "FAIL  end to end" in out  # no graph-step rows without CUDA
    (mem,) = pd.read_parquet(tmp_path / "memory.parquet").itertuples()
    # the memory model's estimate of that sample, from what the dry run asks (`--layers 2` of Qwen2.5-0.5B's config, in
    # its dtype, the long methods at 25%, both question modes' prefills, a 16-token cap teacher-forced to 17); the
    # budget (a share of this machine's free memory, GBs) holds every variant of a 384-token, 2-layer sample in one wave
    from transformers import AutoConfig

    from kvlab.methods import build, variants
    from kvlab.state.memory import GB, Row, Shape, estimate

    grid = variants(build(gpu_check.LONG_METHODS), [0.25])
    shape = Shape.from_config(AutoConfig.for_model("qwen2", **{**gpu_check.QWEN2_5_0_5B, "num_hidden_layers": 2}).to_dict())
    ref = next(i for i, v in enumerate(grid) if v.kind == "full")
    planned = estimate(shape, mem.dtype, mem.context_tokens, [Row.of(v) for v in grid], ref, compressions=2, path=17)
    assert mem.rows == 2 * mem.variants == 2 * len(grid) == 14 and mem.waves == len(planned.waves) == 1
    assert mem.predicted_gb == pytest.approx(planned.peak / GB)
    assert f"memory: {mem.model}, one {mem.context_tokens}-token sample, 7 variants" in out


@pytest.mark.slow
def test_the_device_steps_import_without_the_workflow_packages():
    """The device machine has no kvpress, snakemake, duckdb or jsonschema: what gpu/check.sh runs imports without."""
    blocked = "import sys; sys.modules.update(dict.fromkeys(['kvpress', 'snakemake', 'duckdb', 'jsonschema']))"
    code = f"{blocked}; import kvlab.tools.gpu_check, kvlab.steps.benchmark, kvlab.steps.kernel_bench"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
