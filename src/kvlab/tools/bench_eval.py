"""Seconds per scored row of one evaluation job, for comparing two commits side by side on one machine.

    python -m kvlab.tools.bench_eval --model-dir resources/models/qwen2.5-0.5b \
        --calibration results/calibration/qwen2.5-0.5b --task variable_tracking --ctx 1024 \
        --label new --out results/bench/eval/new.parquet

runs the evaluate job of `config.yaml` (after its preset) for that task and context length exactly as the
pipeline does (`kvlab.steps.evaluate.run_job`), writes its rows beside `--out` (`*.rows.parquet`) and one summary
row to `--out`: rows, samples, wall seconds, seconds per row, and the job's prefill / compress / decode /
teacher-forced seconds. Every commit since e2a8a92 has this command with these arguments, so an older
checkout's own copy times its engine on the same config: the A/B of the speed issue (benchmarks/speed_ab.sh;
`--samples` overrides the task's sample count on both sides).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import time
from pathlib import Path

import pandas as pd
import yaml

from kvlab.state.config import resolve
from kvlab.steps.evaluate import run_job
from kvlab.state.jobs import run_params
from kvlab.methods import build, with_calibration

ROOT = Path(__file__).resolve().parents[3]


def job_settings(config_path: Path, task: str, preset: str | None) -> tuple[dict, dict]:
    """The task's spec and the `run` dict the evaluate rule would hand this job (kvlab.state.jobs.run_params, the config
    validated against this checkout's schema), without rounds: a timed job scores the task's samples, the same
    work on both sides of an A/B."""
    config = yaml.safe_load(config_path.read_text())
    if preset:
        config["preset"] = preset
    config = resolve(config, ROOT / "workflow" / "config.schema.yaml")
    run = run_params(config, build(config["methods"]), task)
    del run["sequential"]
    return config["tasks"][task], {**run, "threads": config["threads"]}


def job_arguments(description: str, samples_help: str, samples_default: int | None = None) -> argparse.ArgumentParser:
    """The arguments naming one evaluate job of a config: model, calibration, task, context, samples, config."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--calibration", help="the model's calibration folder (for methods that read it)")
    ap.add_argument("--task", required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--samples", type=int, default=samples_default, help=samples_help)
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    ap.add_argument("--preset")
    ap.add_argument("--dtype", help="force the compute dtype (give the same on both sides of an A/B; default: the "
                    "config's, `auto` resolved here)")
    ap.add_argument("--threads", type=int, help="torch threads (two sides run at once with one thread each share a "
                    "noisy machine alike)")
    return ap


def apply_overrides(args, run: dict) -> dict:
    """`run` with the command line's --threads and --dtype (else the config's dtype, `auto` resolved here)."""
    from kvlab.util.hardware import compute_dtype

    run = dict(run)
    if args.threads:
        run["threads"] = args.threads
    run["dtype"] = args.dtype or compute_dtype(run["dtype"], run["device"])
    return run


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = job_arguments(__doc__.split("\n\n")[0], "override the task's samples (same value on both sides of an A/B)")
    ap.add_argument("--label", required=True, help="what is timed, e.g. a commit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    spec, run = job_settings(Path(args.config), args.task, args.preset)
    if args.ctx not in spec["context_tokens"]:
        ap.error(f"--ctx {args.ctx}: task '{args.task}' runs at {spec['context_tokens']}")
    if args.samples:
        spec = {**spec, "samples": args.samples}
    run = apply_overrides(args, run)
    if args.calibration:
        run["methods"] = with_calibration(run["methods"], args.calibration)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run_job(args.model_dir, args.task, spec, args.ctx, run, out.with_suffix(".rows.parquet"))
    wall = time.perf_counter() - t0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__import__("kvlab").__file__).parent,
                            capture_output=True, text=True).stdout.strip()
    # per compression: prefill, compress (summed over variants) and decode / teacher forcing (once per turn)
    per_turn = rows.drop_duplicates(["sample_id", "question_mode", "turn"]) if "sample_id" in rows else rows
    summary = pd.DataFrame([{
        "label": args.label, "commit": commit, "task": args.task, "context_tokens": args.ctx,
        "samples": int(rows["sample_id"].nunique()) if "sample_id" in rows else None, "rows": len(rows),
        "wall_s": wall, "s_per_row": wall / len(rows),
        "decode_s": float(per_turn["decode_s"].sum()), "teacher_forced_s": float(per_turn["teacher_forced_s"].sum()),
        "compress_s": float(rows.drop_duplicates(["sample_id", "method", "budget", "question_mode"])["compress_s"].sum())
        if "sample_id" in rows else None,
        "dtype": run["dtype"], "threads": run["threads"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
    }])
    summary.to_parquet(out, index=False)
    print(summary.to_string(index=False))
    return summary


if __name__ == "__main__":
    main()
