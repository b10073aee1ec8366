"""Where an evaluation job's time goes: one job of `config.yaml` (its first round, or its first samples) under torch's
profiler, its samples batched as the job batches them and its noise floor measured on as many as the job measures it.

    python -m kvlab.profile_eval --model-dir resources/models/qwen2.5-0.5b \
        --calibration results/calibration/qwen2.5-0.5b --task variable_tracking --ctx 1024 --samples 1 \
        --out results/profile/variable_tracking-1024.parquet

The engine marks its phases with `torch.profiler.record_function` (`kvlab.*`; free when no profiler runs).
One row per phase or operator class: its seconds (inclusive for phases, self time for operators), calls and
share of the profiled wall time.

- phases: prefill, compress, cache_stats, decode_reference (the full cache's answer), decode_diverged (rows
  that leave it), teacher_forced (one pass along it), noise_floor (the measured full rows teacher-forced again one
  token at a time, batched across samples), divergence (KL), and within decoding: forward (the
  model's step), masks, attention, rows_update (quantized and H2O rows: per-row Python, quantizing and
  dequantizing);
- operators: matmul (linear / mm / addmm / bmm self time), sdpa, host_sync (`item` / `_local_scalar_dense`:
  the host waiting for a value), and all the other operators' self time;
- python_and_rest: wall time not spent inside any operator (interpreter, tokenizer, scoring);
- roofline: the matmuls' floating-point operations (torch's profiler counts them for mm, addmm and bmm), this CPU's
  measured matmul rate in the job's dtype and threads (`peak_matmul_gflops`, the best of the engine's shapes: a
  prefill's and a teacher-forced batch's MLP and LM head, a decode step's MLP), the rate the job's matmuls reached
  (`matmul_gflops`: their flops over their self time) and `matmul_floor_s`, the seconds those flops need at the
  peak: the least any engine could spend on this job's matmuls without computing fewer of them; `wall_over_floor`,
  the job's unprofiled wall time over that floor (the roofline issue's ratio). Rows name the dtype (`--dtype` forces
  one, e.g. float32 on a bf16-capable CPU), the threads, the device and the CPU kind (bf16-capable or fp32 only).

The profiler adds a few microseconds per operator, so shares matter more than absolute seconds; the
`wall_s` row is the same job without the profiler, for scale.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.bench_eval import apply_overrides, job_arguments, job_settings
from kvlab.engine import evaluate_samples
from kvlab.evaluate import load_model, samples_at_once
from kvlab.hardware import bf16_matmul_native, device_name
from kvlab.io import write_parquet
from kvlab.methods import variants, with_calibration
from kvlab.tasks import generate, max_new_tokens

PHASES = ["prefill", "compress", "cache_stats", "decode_reference", "decode_diverged", "teacher_forced",
          "noise_floor", "divergence", "forward", "masks", "attention", "rows_update"]
OPERATORS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "sdpa": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention"),
    "host_sync": ("aten::item", "aten::_local_scalar_dense"),
}


# (M, K, N) of the engine's matmuls: a 1K prefill's MLP up and down, a teacher-forced batch's LM head (~4K token
# rows, an eighth of Qwen's vocabulary), a batch-32 decode step's MLP
SHAPES = ((1024, 896, 4864), (1024, 4864, 896), (4096, 896, 18992), (32, 896, 4864))


def peak_matmul_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """The best rate (GFLOP/s) of plain torch matmuls at the engine's shapes (SHAPES) in `dtype`, with the threads
    torch has: what this CPU's matmul kernels reach, the roof a job's matmuls are measured against."""
    best = 0.0
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b  # warm-up: the first call picks a kernel
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - t0) / 1e9)
    return best


def roofline_rows(events, peak: float, wall: float) -> list[dict]:
    """The matmuls' counted flops, the rate they ran at, the peak, the seconds the flops need at it and the job's
    wall time (unprofiled) over those seconds."""
    sel = [e for e in events if e.key in OPERATORS["matmul"]]
    flops = float(sum(e.flops for e in sel))
    seconds = sum(e.self_cpu_time_total for e in sel) / 1e6
    floor = flops / 1e9 / peak
    return [{"kind": "roofline", "name": "matmul_gflop", "seconds": float("nan"), "calls": 0, "value": flops / 1e9},
            {"kind": "roofline", "name": "matmul_gflops", "seconds": seconds, "calls": 0, "value": flops / 1e9 / seconds},
            {"kind": "roofline", "name": "peak_matmul_gflops", "seconds": float("nan"), "calls": 0, "value": peak},
            {"kind": "roofline", "name": "matmul_floor_s", "seconds": floor, "calls": 0, "value": float("nan")},
            {"kind": "roofline", "name": "wall_over_floor", "seconds": float("nan"), "calls": 0, "value": wall / floor}]


def profile_rows(events, wall: float) -> list[dict]:
    """Rows of a profile from torch's `key_averages()`: phases inclusive, operator classes by self time."""
    by_name = {e.key: e for e in events}
    rows = []
    for phase in PHASES:
        e = by_name.get(f"kvlab.{phase}")
        seconds = e.cpu_time_total / 1e6 if e else 0.0
        rows.append({"kind": "phase", "name": phase, "seconds": seconds, "calls": e.count if e else 0})
    ops = [e for e in events if not e.key.startswith("kvlab.")]
    claimed = set()
    for name, keys in OPERATORS.items():
        sel = [e for e in ops if e.key in keys]
        claimed.update(e.key for e in sel)
        rows.append({"kind": "operator", "name": name, "seconds": sum(e.self_cpu_time_total for e in sel) / 1e6,
                     "calls": sum(e.count for e in sel)})
    rest = [e for e in ops if e.key not in claimed]
    rows.append({"kind": "operator", "name": "other_operators", "seconds": sum(e.self_cpu_time_total for e in rest) / 1e6,
                 "calls": sum(e.count for e in rest)})
    in_ops = sum(r["seconds"] for r in rows if r["kind"] == "operator")
    rows.append({"kind": "operator", "name": "python_and_rest", "seconds": max(wall - in_ops, 0.0), "calls": 0})
    for r in rows:
        r["share"] = r["seconds"] / wall
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = job_arguments(__doc__.split("\n\n")[0], "profile the task's first N samples", samples_default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    spec, run = job_settings(Path(args.config), args.task, args.preset)
    run = apply_overrides(args, run)
    if args.calibration:
        run["methods"] = with_calibration(run["methods"], args.calibration)
    torch.set_num_threads(run["threads"])
    dtype = run["dtype"]
    model, tokenizer = load_model(args.model_dir, dtype, run["device"])
    samples = generate(args.task, spec, tokenizer, args.ctx)[: args.samples]
    grid = variants(run["methods"], run["budgets"], args.task)
    max_new = max_new_tokens(spec, run["max_new_tokens"])

    at_once = samples_at_once(args.ctx or max(s.prompt.tokens for s in samples))
    noise = run.get("noise_floor_samples", len(samples))

    def job(todo=samples):  # as the job's first round batches its samples (kvlab.evaluate.run_job), its noise floor too
        rows = []
        for start in range(0, len(todo), at_once):
            rows += evaluate_samples(model, tokenizer, todo[start : start + at_once], grid, run["question_modes"], max_new,
                                     noise_samples=max(0, noise - start))
        return rows

    job(samples[:1])  # warm-up: first calls allocate and pick kernels
    t0 = time.perf_counter()
    rows = job()
    plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        t0 = time.perf_counter()
        job()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    out = pd.DataFrame(profile_rows(events, wall) + roofline_rows(events, peak_matmul_gflops(model.dtype), plain))
    out = pd.concat([out, pd.DataFrame([{"kind": "total", "name": "wall_s", "seconds": plain, "calls": 1, "share": 1.0},
                                        {"kind": "total", "name": "profiled_wall_s", "seconds": wall, "calls": 1,
                                         "share": 1.0}])], ignore_index=True)
    out = out.assign(task=args.task, context_tokens=args.ctx, samples=len(samples), rows=len(rows), variants=len(grid),
                     dtype=dtype, threads=run["threads"], device=device_name(run["device"]),
                     cpu_kind="bf16-capable" if bf16_matmul_native(run["device"]) else "fp32 only (no AVX512-BF16 or AMX)")
    write_parquet(out, args.out)
    print(out[["kind", "name", "seconds", "calls", "share", "value"]].to_string(index=False))
    return out


if __name__ == "__main__":
    main()
