"""An engine switch on and off in one process, alternating, so this machine's drift between processes does not enter:
one evaluate job's first samples, timed `--rounds` times each way. Switches (fields of the CPU's kvlab.engine.tuning):
  buckets  teacher forcing in length buckets (`length_buckets`, bucket_tokens) against one padded batch;
  drafts   decoding with drafts looked up in the prompt (`_drafted`, draft_tokens) against one-token steps.
Rows: results/bench/{switch}_ab.parquet (seconds per run, answers that differ between the two ways, dtype, CPU).

    python benchmarks/engine_ab.py --switch drafts --task variable_tracking --ctx 1024 --samples 4 --dtype bfloat16

`--noise-samples 0` times a job's later rounds, whose full answers keep no one-token logits for the noise floor (a
first round's do, and those are decoded without drafts).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from kvlab.tools.bench_eval import job_settings
from kvlab.engine import evaluate_samples, tuning
from kvlab.steps.evaluate import load_model, noise_samples
from kvlab.util.hardware import cpu_kind, device_name
from kvlab.util.io import write_parquet
from kvlab.methods import variants, with_calibration
from kvlab.tasks import generate, max_new_tokens

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = {  # switch -> (tuning field, {way: its value}), the way it is off first
    "buckets": ("bucket_tokens", {"one batch": 10 ** 9, "length buckets": tuning.CPU.bucket_tokens}),  # 10**9: all rows in one
    "drafts": ("draft_tokens", {"one-token steps": 0, "drafts": tuning.CPU.draft_tokens}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--task", default="variable_tracking")
    ap.add_argument("--preset", help="a preset of config.yaml (default: none, the default run)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--noise-samples", type=int, help="samples whose full rows get the noise floor (default: the job's)")
    ap.add_argument("--out", help="default: results/bench/{switch}_ab.parquet")
    args = ap.parse_args()
    name, ways = SWITCHES[args.switch]
    spec, run = job_settings(ROOT / "config.yaml", args.task, args.preset)
    run["methods"] = with_calibration(run["methods"], ROOT / "results/calibration/qwen2.5-0.5b")
    torch.set_num_threads(run["threads"])
    model, tokenizer = load_model(ROOT / "resources/models/qwen2.5-0.5b", args.dtype, "cpu")
    samples = generate(args.task, spec, tokenizer, args.ctx)[: args.samples]
    grid = variants(run["methods"], run["budgets"], args.task)
    cap = max_new_tokens(spec, run["max_new_tokens"])

    noise = noise_samples(run, 0, len(samples)) if args.noise_samples is None else args.noise_samples

    def job():
        return evaluate_samples(model, tokenizer, samples, grid, run["question_modes"], cap, noise_samples=noise)

    job()  # warm-up
    out, answers = [], {}
    for round_ in range(args.rounds):
        for way, value in ways.items():
            tuning.BY_DEVICE["cpu"] = replace(tuning.CPU, **{name: value})
            t0 = time.perf_counter()
            answers[way] = [row["prediction"] for row in job()]
            out.append({"switch": args.switch, "way": way, "round": round_, "wall_s": time.perf_counter() - t0})
    tuning.BY_DEVICE["cpu"] = tuning.CPU
    differ = sum(a != b for a, b in zip(*answers.values()))
    rows = pd.DataFrame(out).assign(task=args.task, preset=args.preset or "default", context_tokens=args.ctx, samples=len(samples), noise_samples=noise,
                                    dtype=args.dtype, rows=len(next(iter(answers.values()))), answers_differ=differ,
                                    threads=run["threads"], device=device_name("cpu"),
                                    cpu_kind=cpu_kind("cpu"))
    write_parquet(rows, args.out or str(ROOT / f"results/bench/{args.switch}_ab.parquet"))
    print(rows.to_string(index=False))


if __name__ == "__main__":
    main()
