"""Teacher forcing in length buckets against one padded batch (kvlab.engine.decode.length_buckets), in one process,
alternating, so this machine's drift between processes does not enter: one evaluate job's first samples, timed
`--rounds` times each way. Rows: results/bench/bucket_ab.parquet (seconds per run, answers that differ between the
two ways, dtype and CPU kind).

    python benchmarks/bucket_ab.py --task variable_tracking --ctx 1024 --samples 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from kvlab.bench_eval import job_settings
from kvlab.engine import decode, evaluate_samples
from kvlab.evaluate import load_model, noise_samples
from kvlab.hardware import bf16_matmul_native
from kvlab.io import write_parquet
from kvlab.methods import variants, with_calibration
from kvlab.tasks import generate, max_new_tokens

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="variable_tracking")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results/bench/bucket_ab.parquet"))
    args = ap.parse_args()
    spec, run = job_settings(ROOT / "config.yaml", args.task, None)
    run["methods"] = with_calibration(run["methods"], ROOT / "results/calibration/qwen2.5-0.5b")
    torch.set_num_threads(run["threads"])
    model, tokenizer = load_model(ROOT / "resources/models/qwen2.5-0.5b", args.dtype, "cpu")
    samples = generate(args.task, spec, tokenizer, args.ctx)[: args.samples]
    grid = variants(run["methods"], run["budgets"], args.task)
    cap = max_new_tokens(spec, run["max_new_tokens"])

    def job():
        return evaluate_samples(model, tokenizer, samples, grid, run["question_modes"], cap,
                                noise_samples=noise_samples(run, 0, len(samples)))

    job()  # warm-up
    ways = {"one batch": 10 ** 9, "length buckets": decode.BUCKET_TOKENS}  # no batch feeds 10**9 tokens: all rows in one
    out, answers = [], {}
    for round_ in range(args.rounds):
        for way, tokens in ways.items():
            decode.BUCKET_TOKENS = tokens
            t0 = time.perf_counter()
            answers[way] = [row["prediction"] for row in job()]
            out.append({"way": way, "round": round_, "wall_s": time.perf_counter() - t0})
    decode.BUCKET_TOKENS = ways["length buckets"]
    differ = sum(a != b for a, b in zip(*answers.values()))
    rows = pd.DataFrame(out).assign(task=args.task, context_tokens=args.ctx, samples=len(samples), dtype=args.dtype,
                                    rows=len(answers["one batch"]), answers_differ=differ, threads=run["threads"],
                                    cpu_kind="bf16-capable" if bf16_matmul_native("cpu") else "fp32 only (no AVX512-BF16 or AMX)")
    write_parquet(rows, args.out)
    print(rows.to_string(index=False))


if __name__ == "__main__":
    main()
