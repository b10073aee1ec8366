"""torch's `linear` against the same product with the weight packed once for oneDNN (`kvlab.kernels.linear`), at
Qwen2.5-0.5B's weight shapes and the row counts of a decode step (1-16 rows) and of prefill (512), timed back to
back in one process. The rows behind the packed linear layers of every CPU job.

    .venv/bin/python benchmarks/packed_linear.py [--dtypes bfloat16 float32] [--out results/bench/packed_linear.parquet]

One row per dtype, weight and row count: milliseconds per product each way, the weight's GB/s each way, the largest
difference between the two results, the threads and the CPU kind. bf16 is timed only where the CPU multiplies it
natively (`kvlab.kernels.linear.packable`).
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from kvlab.util.hardware import cpu_kind, device_name
from kvlab.util.io import write_parquet
from kvlab.kernels.linear import PackedLinear, packable

# (out_features, in_features) of Qwen2.5-0.5B's linear layers
WEIGHTS = {"q_proj": (896, 896), "k_proj": (128, 896), "o_proj": (896, 896), "gate_proj": (4864, 896),
           "down_proj": (896, 4864), "lm_head": (151936, 896)}
ROWS = (1, 4, 8, 16, 512)


def per_call(job, budget_s: float = 0.3) -> float:
    """Seconds per call of `job`: two warm-up calls, then as many as fit in about `budget_s`."""
    job(), job()
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < budget_s:
        job()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default="results/bench/packed_linear.parquet")
    args = ap.parse_args(argv)
    rows = []
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        if not packable(torch.empty(1, dtype=dtype)):
            print(f"{name}: no packed oneDNN kernel on this CPU, skipped")
            continue
        for weight_name, (n, k) in WEIGHTS.items():
            weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
            packed = PackedLinear(weight)
            nbytes = weight.numel() * weight.element_size()
            for m in ROWS:
                x = torch.randn(m, k, generator=g).to(dtype)
                with torch.no_grad():
                    plain_s = per_call(lambda: torch.nn.functional.linear(x, weight))
                    packed_s = per_call(lambda: packed(x))
                    diff = (packed(x).float() - torch.nn.functional.linear(x, weight).float()).abs().max().item()
                rows.append({"dtype": name, "weight": weight_name, "out_features": n, "in_features": k, "rows": m,
                             "linear_ms": plain_s * 1e3, "packed_ms": packed_s * 1e3,
                             "linear_gbs": nbytes / plain_s / 1e9, "packed_gbs": nbytes / packed_s / 1e9,
                             "max_abs_diff": diff})
                print(f"{name} {weight_name} {m:4d} rows: linear {plain_s * 1e3:8.3f} ms, packed {packed_s * 1e3:8.3f} ms")
    out = pd.DataFrame(rows).assign(threads=torch.get_num_threads(), device=device_name("cpu"),
                                    cpu_kind=cpu_kind("cpu"))
    write_parquet(out, args.out)
    return out


if __name__ == "__main__":
    main()
