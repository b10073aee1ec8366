"""Where an evaluation job's time goes, and how far it is from its matmul floor: one job of `config.yaml` (its first
`--samples`, batched as the job batches them, its noise floor measured on as many as the job measures it) timed
plainly, its matmul flops counted, and its first `--profile-samples` run under torch's profiler.

    python -m kvlab.tools.profile_eval --model-dir resources/models/qwen2.5-0.5b \
        --calibration results/calibration/qwen2.5-0.5b --task prose_kl --ctx 512 --samples 10 \
        --out results/profile/prose_kl-512.parquet

The engine marks its phases with `torch.profiler.record_function` (`kvlab.*`; free when no profiler runs).
One row per phase or operator class: its seconds (inclusive for phases, self time for operators), calls and
share of the profiled wall time (`profiled_wall_s`).

- phases: prefill, compress, cache_stats, decode_reference (the full cache's answer), decode_diverged (rows
  that leave it), teacher_forced (one pass along it), noise_floor (the measured full rows teacher-forced again one
  token at a time, batched across samples), divergence (KL), and within decoding: forward (the
  model's step), masks, attention, rows_update (quantized and H2O rows: per-row Python, quantizing and
  dequantizing);
- operators: matmul (linear / mm / addmm / bmm self time), sdpa, host_sync (`item` / `_local_scalar_dense`:
  the host waiting for a value), and all the other operators' self time;
- python_and_rest: wall time not spent inside any operator (interpreter, tokenizer, scoring);
- roofline: the job's matmul floating-point operations (`matmul_gflop`: mm, addmm and bmm, counted over the whole
  job as the profiler and torch's FlopCounterMode count them; `MatmulCounter`), this CPU's measured matmul rate in the job's
  dtype and threads (`peak_matmul_gflops`, the best of the engine's shapes: a prefill's and a teacher-forced batch's
  MLP and LM head, a decode step's MLP), the rate the profiled samples' matmuls reached (`matmul_gflops`: their
  flops over their self time) and `matmul_floor_s`, the seconds the job's flops need at the peak: the least any
  engine could spend on this job's matmuls without computing fewer of them; `wall_over_floor`, the job's
  unprofiled wall time (`wall_s`) over that floor (the roofline issue's ratio). The memory roof beside it: the bytes
  the matmuls move (`matmul_gbytes`: operands and results, nothing kept in cache between calls), this CPU's
  streaming bandwidth (`peak_bandwidth_gbs`: a 512 MB sum, a one-row product with LM-head weights) and
  `roofline_floor_s`, every call at the slower of its flops at the peak and its bytes at that bandwidth (a one-token
  step at a few rows waits for its weights, whatever the engine), with `wall_over_roofline`. Attention's own two
  products (scores and their weighted values) run inside fused SDPA kernels that no matmul operator shows, so the
  matmul floor leaves them out; `attention_gflop` counts them (the query-key pairs each call's mask lets through,
  causal prefills' lower triangle), and `matmul_attention_floor_s` puts them at the same peak beside the matmuls:
  the floor of every matrix product the job needs, with `wall_over_matmul_attention_floor`. Rows name the dtype
  (`--dtype` forces one, e.g. float32 on a bf16-capable CPU), the threads, the device and the CPU kind (bf16-capable
  or fp32 only).
- `--repeats N` times the plain job N times: `wall_s` is their median, and every ratio to a floor is the median's,
  with the fastest and the slowest run's in the `low` and `high` columns (this machine's run-to-run noise is 5-15%,
  so one run does not settle a ratio near 2).

The profiler adds a few microseconds per operator and holds every call in memory, so shares matter more than
absolute seconds, and `--profile-samples` stays small (default 1); `wall_s` is the whole job without it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from kvlab.tools.bench_eval import apply_overrides, job_arguments, job_settings
from kvlab.engine import Reading, evaluate_samples
from kvlab.steps.evaluate import load_model, noise_samples, samples_at_once
from kvlab.util.hardware import cpu_kind, device_name
from kvlab.util.io import write_parquet
from kvlab.kernels.linear import PackedLinear, packable
from kvlab.methods import variants, with_calibration
from kvlab.tasks import generate, max_new_tokens

PHASES = ["prefill", "compress", "cache_stats", "decode_reference", "decode_diverged", "teacher_forced",
          "noise_floor", "divergence", "forward", "masks", "attention", "rows_update"]
OPERATORS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise"),
    "sdpa": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention"),
    "host_sync": ("aten::item", "aten::_local_scalar_dense"),
}


# (M, K, N) of the engine's matmuls: a 1K prefill's MLP up and down, a teacher-forced batch's LM head (~4K token
# rows, an eighth of Qwen's vocabulary), a batch-32 decode step's MLP
MATMUL_SHAPES = ((1024, 896, 4864), (1024, 4864, 896), (4096, 896, 18992), (32, 896, 4864))


def products(a: torch.Tensor, b: torch.Tensor) -> list:
    """The ways a job may multiply `a` (M, K) by `b` (K, N): a plain matmul and, where this CPU's oneDNN multiplies
    the dtype natively, the linear layer packed once for it (`kvlab.kernels.linear`, which the engine's models use)."""
    jobs = [lambda: a @ b]
    if packable(b):
        packed = PackedLinear(b.T.contiguous())
        jobs.append(lambda: packed(a))
    return jobs


def peak_matmul_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """The best rate (GFLOP/s) of torch's matmuls at the engine's shapes (MATMUL_SHAPES) in `dtype`, plain and packed
    (`products`), with the threads torch has: what this CPU's matmul kernels reach, the roof a job's matmuls are
    measured against."""
    best = 0.0
    for m, k, n in MATMUL_SHAPES:
        for job in products(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)):
            job()  # warm-up: the first call picks a kernel
            t0 = time.perf_counter()
            for _ in range(repeats):
                job()
            best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - t0) / 1e9)
    return best


def event_flops(e) -> float:
    """An event's flops: the profiler's own count (mm, addmm, bmm), or 2·M·K·N from the recorded input shapes of a
    packed linear's product (x (M, K), weight (N, K)), which the profiler does not count."""
    if e.key == "mkldnn::_linear_pointwise":
        (m, k), (n, _) = e.input_shapes[:2]
        return 2.0 * m * k * n * e.count
    return float(e.flops)


def matmul_gflop(events) -> tuple[float, float]:
    """The matmuls' flops (GFLOP, `event_flops`) and self seconds among the profiler's events (averaged by input
    shape, so that a packed linear's shapes are known)."""
    sel = [e for e in events if e.key in OPERATORS["matmul"]]
    return sum(event_flops(e) for e in sel) / 1e9, sum(e.self_cpu_time_total for e in sel) / 1e6


class MatmulCounter(TorchDispatchMode):
    """Every matrix product a job runs, without holding an event per call (the profiler's events of 10 prose_kl
    samples went past 23 GB), each as a Counter of (flops, bytes) -> calls, the bytes being those of its operands and
    result (a broadcast operand's elements once): what the call moves through memory at least when nothing stays in
    cache from one call to the next (a decode step's weights).

    - `calls`: the matmuls (mm, addmm, bmm: the operators torch's profiler and FlopCounterMode count; and the packed
      linear layers' product, `kvlab.kernels.linear`), 2·M·K·N flops (per product of a bmm), as those count them;
    - `attention`: attention's two products (scores, then their weighted sum of values) inside the fused SDPA
      kernels, which no matmul operator shows: 2·(D_qk + D_v) flops per query-key pair it must compute, the pairs
      its mask lets through (`attention_pairs`), not every pair of the padded block the kernel may compute."""

    OPS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
    ATTENTION = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                 torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten._scaled_dot_product_efficient_attention)

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.attention: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func._overloadpacket
        if op in self.OPS or op is torch.ops.mkldnn._linear_pointwise:
            if op is torch.ops.mkldnn._linear_pointwise:  # x (M, K) times the packed weight (N, K)
                flops = 2 * args[0].numel() * args[1].shape[0]
            else:
                a, b = args[1:3] if op is torch.ops.aten.addmm else args[:2]
                flops = 2 * a.numel() * b.shape[-1]
            tensors = [t for t in args if isinstance(t, torch.Tensor)] + [out]
            self.calls[(flops, sum(stored_bytes(t) for t in tensors))] += 1
        elif op in self.ATTENTION:
            bound = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
            query, key, value = args[:3]
            mask = bound.get("attn_mask", bound.get("attn_bias"))
            causal = bool(bound.get("is_causal", False))
            pairs = attention_pairs(query.shape, key.shape[-2], mask, causal)
            tensors = [query, key, value, out[0]] + ([mask] if mask is not None else [])
            self.attention[(2 * (query.shape[-1] + value.shape[-1]) * pairs, sum(stored_bytes(t) for t in tensors))] += 1
        return out


def attention_pairs(query_shape, keys: int, mask: torch.Tensor | None, causal: bool) -> int:
    """The query-key pairs an attention call over `query_shape` (B, H_q, n, D) and `keys` keys must compute: those
    its mask lets through (boolean, or additive: above half the dtype's lowest value), broadcast over batch rows and
    heads as SDPA broadcasts it; with `is_causal` (top-left aligned, as SDPA reads it) query i's first i + 1 keys;
    else every pair."""
    b, h, n = query_shape[:3]
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        shape = (1,) * (4 - allowed.dim()) + tuple(allowed.shape)
        spread = math.prod(full // own for full, own in zip((b, h, n, keys), shape))
        return int(allowed.sum()) * spread
    if causal:
        full = min(n, keys)  # queries before the last key see i + 1 keys, the rest every key
        return b * h * (full * (full + 1) // 2 + (n - full) * keys)
    return b * h * n * keys


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's distinct elements (a broadcast axis, stride 0, counted once; a packed weight, which has no
    strides, all of them)."""
    if t.is_mkldnn:
        return t.numel() * t.element_size()
    return math.prod(n for n, stride in zip(t.shape, t.stride()) if stride) * t.element_size()


def counted_products(job) -> MatmulCounter:
    """The matrix products of running `job()`: its `calls` (matmuls) and `attention` (`MatmulCounter`)."""
    counter = MatmulCounter()
    with counter:
        job()
    return counter


BANDWIDTH_BYTES = 512 << 20  # the streamed sum's tensor


def peak_bandwidth_gbs(dtype: torch.dtype, repeats: int = 5) -> float:
    """The best rate (GB/s) at which this CPU streams memory through torch operators, with the threads torch has: a
    sum over 512 MB, and a one-row product with an LM head's weights (896 × 151,936, as a decode step reads them;
    plain and packed, `products`): the memory roof of the roofline."""
    big = torch.ones(BANDWIDTH_BYTES * 8 // torch.finfo(dtype).bits, dtype=dtype)
    weight = torch.randn(896, 151936, dtype=dtype)
    best = 0.0
    jobs = [(big.sum, stored_bytes(big))] + [(job, stored_bytes(weight)) for job in products(torch.randn(1, 896, dtype=dtype), weight)]
    for job, nbytes in jobs:
        job()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            job()
        best = max(best, nbytes * repeats / (time.perf_counter() - t0) / 1e9)
    return best


def roofline_rows(calls: Counter, rate: tuple[float, float], peak: float, bandwidth: float, walls: list[float],
                  attention: Counter | None = None) -> list[dict]:
    """The job's matmul GFLOP (`calls`: (flops, bytes) -> calls, `MatmulCounter.calls`), the rate its profiled samples'
    matmuls ran at (`rate`: their GFLOP and seconds), the peak, the seconds the job's flops need at it
    (`matmul_floor_s`) and the job's wall time (unprofiled) over those seconds (the roofline issue's ratio); then the
    memory roof: the GB the matmuls move, the streaming bandwidth, and `roofline_floor_s`, each call at the slower of
    its flops at the peak and its bytes at that bandwidth (a one-token step at a few rows waits for its weights), with
    the wall time over it. With `attention` (`MatmulCounter.attention`): its GFLOP, and the floor of matmuls and
    attention's products together at the same peak (`matmul_attention_floor_s`: the least any engine could spend on
    every matrix product the job needs, attention's included), with the wall time over it. `walls`: the job's wall
    times, one per run: a ratio is the median's, with the lowest and highest run's in `low` and `high`."""
    gflop = sum(f * n for (f, _), n in calls.items()) / 1e9
    gbytes = sum(b * n for (_, b), n in calls.items()) / 1e9
    floor = gflop / peak
    roof = sum(max(f / peak, b / bandwidth) * n for (f, b), n in calls.items()) / 1e9
    wall = statistics.median(walls)
    nan = float("nan")

    def ratio(name: str, over: float) -> dict:
        return {"kind": "roofline", "name": name, "seconds": nan, "calls": 0, "value": wall / over,
                "low": min(walls) / over, "high": max(walls) / over}

    rows = [{"kind": "roofline", "name": "matmul_gflop", "seconds": nan, "calls": 0, "value": gflop},
            {"kind": "roofline", "name": "matmul_gflops", "seconds": rate[1], "calls": 0, "value": rate[0] / rate[1]},
            {"kind": "roofline", "name": "peak_matmul_gflops", "seconds": nan, "calls": 0, "value": peak},
            {"kind": "roofline", "name": "matmul_floor_s", "seconds": floor, "calls": 0, "value": nan},
            ratio("wall_over_floor", floor),
            {"kind": "roofline", "name": "matmul_gbytes", "seconds": nan, "calls": 0, "value": gbytes},
            {"kind": "roofline", "name": "peak_bandwidth_gbs", "seconds": nan, "calls": 0, "value": bandwidth},
            {"kind": "roofline", "name": "roofline_floor_s", "seconds": roof, "calls": 0, "value": nan},
            ratio("wall_over_roofline", roof)]
    if attention is not None:
        att = sum(f * n for (f, _), n in attention.items()) / 1e9
        both = (gflop + att) / peak
        rows += [{"kind": "roofline", "name": "attention_gflop", "seconds": nan, "calls": sum(attention.values()), "value": att},
                 {"kind": "roofline", "name": "matmul_attention_floor_s", "seconds": both, "calls": 0, "value": nan},
                 ratio("wall_over_matmul_attention_floor", both)]
    return rows


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
    ap = job_arguments(__doc__.split("\n\n")[0], "the job's first N samples (the task's first round: its `samples`)",
                       samples_default=1)
    ap.add_argument("--profile-samples", type=int, default=1, help="how many of them run under the profiler (phases, "
                    "operators, the matmul rate): it holds every operator call in memory")
    ap.add_argument("--repeats", type=int, default=1, help="time the job this many times (its wall time is the median, "
                    "with the fastest and slowest run beside it: this machine's noise)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    spec, run = job_settings(Path(args.config), args.task, args.preset)
    run = apply_overrides(args, run)
    if args.calibration:
        run["methods"] = with_calibration(run["methods"], args.calibration)
    torch.set_num_threads(run["threads"])
    dtype = run["dtype"]
    model, tokenizer = load_model(args.model_dir, dtype, run["device"])
    samples = generate(args.task, spec, tokenizer, args.ctx)[: args.samples]
    profiled = samples[: max(1, min(args.profile_samples, len(samples)))]
    grid = variants(run["methods"], run["budgets"], args.task)
    max_new = max_new_tokens(spec, run["max_new_tokens"])
    at_once = samples_at_once(args.ctx or max(s.prompt.tokens for s in samples))

    def job(todo=samples):  # as the job's first round batches its samples (kvlab.steps.evaluate.run_job), its noise floor too
        rows = []
        for start in range(0, len(todo), at_once):
            rows += evaluate_samples(model, tokenizer, todo[start : start + at_once], grid, run["question_modes"], max_new,
                                     Reading(noise_samples=noise_samples(run, start, len(todo))))
        return rows

    job(samples[:1])  # warm-up: first calls allocate and pick kernels
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rows = job()
        walls.append(time.perf_counter() - t0)
    plain = statistics.median(walls)
    counted = counted_products(job)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        t0 = time.perf_counter()
        job(profiled)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    rate = matmul_gflop(prof.key_averages(group_by_input_shape=True))
    out = pd.DataFrame(profile_rows(events, wall) + roofline_rows(counted.calls, rate, peak_matmul_gflops(model.dtype),
                                                                    peak_bandwidth_gbs(model.dtype), walls, counted.attention))
    out = pd.concat([out, pd.DataFrame([{"kind": "total", "name": "wall_s", "seconds": plain, "calls": len(walls),
                                         "share": 1.0, "low": min(walls), "high": max(walls)},
                                        {"kind": "total", "name": "profiled_wall_s", "seconds": wall, "calls": 1,
                                         "share": 1.0}])], ignore_index=True)
    out = out.assign(task=args.task, context_tokens=args.ctx, samples=len(samples), profiled_samples=len(profiled),
                     rows=len(rows), variants=len(grid), dtype=dtype, threads=run["threads"], device=device_name(run["device"]),
                     cpu_kind=cpu_kind(run["device"]))
    write_parquet(out, args.out)
    print(out[["kind", "name", "seconds", "calls", "share", "value"]].to_string(index=False))
    return out


if __name__ == "__main__":
    main()
