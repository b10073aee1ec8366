"""Peak memory and time of one long evaluation sample, measured against the memory model (issue 53's benchmark).

One niah_single sample (depth 0.5) at each context length, with the `long` preset's methods in its question modes
(agnostic and aware), run by the engine as a job runs it (`evaluate_samples`, the noise floor on), once per budget:
`none` (one wave: every variant together) and each budget in GB (the job's memory.budget_gb: waves planned by
kvlab.state.memory). Each point runs in its own process, because peak RSS only grows within one (the job keeps the memory it
frees: hardware.keep_freed_memory). A row: context, budget, waves, peak RSS over the loaded model (sampled every 10 ms)
beside the model's prediction for the same waves, wall seconds, dtype, CPU kind; and every point's rows go to
long_memory_rows/; a budgeted point's row says whether its rows equal the one-wave point's at the same context
(`rows_equal_one_wave`: every column but timing ones, decode_batch and waves; KL columns compared apart, their largest
absolute difference in `kl_max_abs_difference`, beside the one-wave run's batch noise floor `noise_kl_one_wave`).

    python benchmarks/long_memory.py MODEL_DIR --contexts 4096 8192 16384 32000 --budgets none 8 [--dtype auto]
    python benchmarks/long_memory.py MODEL_DIR --repredict    (the predictions again, by the model as it is now)
        ->  results/benchmarks/long_memory.parquet (one row per context and budget: a later run replaces its own
            points and keeps the others), results/benchmarks/long_memory_rows/{context}_{budget}.parquet
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import yaml

OUT = Path("results/benchmarks")


def point(model_dir: str, context: int, budget: str, dtype: str, rows_out: Path, calibration: str) -> dict:
    import torch

    from kvlab.state.config import resolve
    from kvlab.engine import evaluate_samples
    from kvlab.steps.evaluate import load_model
    from kvlab.util.hardware import compute_dtype, cpu_kind
    from kvlab.state.memory import GB, Row, Shape, estimate, footprint, job_waves
    from kvlab.methods import build, variants, with_calibration
    from kvlab.tasks import generate

    torch.set_num_threads(2)
    dtype = compute_dtype(dtype, "cpu")
    config = yaml.safe_load(Path("config.yaml").read_text())
    config["preset"] = "long"
    config = resolve(config, "workflow/config.schema.yaml")
    model, tokenizer = load_model(model_dir, dtype, "cpu")
    loaded = footprint("cpu")
    peak, stop = [loaded], threading.Event()

    def sample_rss():
        while not stop.wait(0.01):
            peak[0] = max(peak[0], footprint("cpu"))

    spec = {**config["tasks"]["niah_single"], "depths": [0.5], "samples": 1}
    (sample,) = generate("niah_single", spec, tokenizer, context)
    grid = variants(with_calibration(build(config["methods"]), Path(calibration)), config["budgets"], "niah_single")
    modes = [m for m in config["question_modes"] if m != "multi_turn"]
    waves = None  # one wave; else planned as a job plans them, under memory.budget_gb less the loaded model
    if budget != "none":
        run = {"memory": {"budget_gb": float(budget)}, "device": "cpu", "dtype": dtype, "question_modes": modes}
        waves = job_waves(model, run, grid, sample.prompt.tokens, config["max_new_tokens"], floor=False)
    thread = threading.Thread(target=sample_rss, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    rows = evaluate_samples(model, tokenizer, [sample], grid, modes, config["max_new_tokens"], noise_samples=1, waves=waves)
    wall = time.perf_counter() - t0
    stop.set()
    thread.join()
    if waves is None:
        ref = next(i for i, v in enumerate(grid) if v.kind == "full")
        est = estimate(Shape.from_config(model.config.to_dict()), dtype, sample.prompt.tokens, [Row.of(v) for v in grid],
                       ref, 2, config["max_new_tokens"] + 1)
    else:
        est = waves.planned
    pd.DataFrame(rows).drop(columns=["gold"]).to_parquet(rows_out / f"{context}_{budget}.parquet", index=False)
    return {"context_tokens": context, "prompt_tokens": sample.prompt.tokens, "budget_gb": None if waves is None else float(budget),
            "variants": len(grid), "waves": rows[0]["waves"], "rows": len(rows), "loaded_gb": loaded / GB,
            "peak_rss_over_loaded_gb": (peak[0] - loaded) / GB, "peak_rss_gb": peak[0] / GB,
            "predicted_gb": est.peak / GB, **{f"predicted_{k}_gb": v / GB for k, v in est.phases.items()},
            "wall_s": wall, "dtype": dtype, "cpu_kind": cpu_kind("cpu"), "found": [r["score"] for r in rows if r["method"] == "full"][0]}


def against_one_wave(rows_out: Path, context: int, budget: str) -> dict:
    """How a budgeted point's rows compare with the one-wave point's at the same context (when both ran): every
    column equal but timing ones, decode_batch and waves (kvlab.tools.compare_runs.VARYING), and the KL columns' largest
    absolute difference in nats (a teacher-forced batch of other rows rounds them differently: in bf16, by about the
    batch noise floor the rows measure, noise_kl)."""
    import numpy as np

    from kvlab.tools.compare_runs import VARYING

    one, mine = rows_out / f"{context}_none.parquet", rows_out / f"{context}_{budget}.parquet"
    if budget == "none" or not one.is_file():
        return {}
    a, b = pd.read_parquet(one), pd.read_parquet(mine)
    rounded = ["kl_vs_full", "kl_max", "nll", "ppl", "noise_kl", "noise_kl_max"]
    exact = [c for c in a.columns if not VARYING.search(c) and c not in rounded]
    same = len(a) == len(b) and all(a[c].astype(str).equals(b[c].astype(str)) for c in exact)
    kl = [np.nanmax(np.abs(a[c] - b[c])) for c in rounded if c in a and a[c].notna().any()]
    return {"rows_equal_one_wave": same, "kl_max_abs_difference": float(max(kl)) if kl else None,
            "noise_kl_one_wave": float(a["noise_kl"].max())}


def repredict(table: Path, model_dir: str) -> pd.DataFrame:
    """The table's `predicted_*` columns recomputed by the memory model as it is now, for the waves each point planned
    (the measured columns untouched): after the model's factors are refitted, its old predictions say nothing."""
    from kvlab.methods import build, variants
    from kvlab.state.config import resolve
    from kvlab.state.memory import GB, Row, Shape, estimate

    config = yaml.safe_load(Path("config.yaml").read_text())
    config["preset"] = "long"
    config = resolve(config, "workflow/config.schema.yaml")
    grid = variants(build(config["methods"]), config["budgets"], "niah_single")
    rows, ref = [Row.of(v) for v in grid], next(i for i, v in enumerate(grid) if v.kind == "full")
    shape = Shape.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    frame = pd.read_parquet(table)
    for i, r in frame[frame["prompt_tokens"].notna()].iterrows():
        over = None if pd.isna(r["budget_gb"]) else r["budget_gb"] * GB - r["loaded_gb"] * GB
        est = estimate(shape, r["dtype"], int(r["prompt_tokens"]), rows, ref, 2, config["max_new_tokens"] + 1, over)
        frame.loc[i, "predicted_gb"] = est.peak / GB
        for phase, size in est.phases.items():
            frame.loc[i, f"predicted_{phase}_gb"] = size / GB
    return frame


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32000])
    parser.add_argument("--budgets", nargs="+", default=["none"], help="'none' (one wave) or GB, weights included")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--calibration", help="the model's calibration folder (default: results/calibration/<model>)")
    parser.add_argument("--point", action="store_true", help=argparse.SUPPRESS)  # one (context, budget) in this process
    parser.add_argument("--repredict", action="store_true", help="only recompute the table's predicted columns")
    args = parser.parse_args()
    calibration = args.calibration or str(Path("results/calibration") / Path(args.model_dir).name)
    if not Path(calibration, "fp8_scales.parquet").is_file():
        raise SystemExit(f"{calibration}: no calibration (fp8_scales.parquet); run the calibrate rule for this model or "
                         "pass --calibration DIR")
    if args.repredict:
        frame = repredict(OUT / "long_memory.parquet", args.model_dir)
        frame.to_parquet(OUT / "long_memory.parquet", index=False)
        print(frame.to_string())
        return 0
    rows_out = OUT / "long_memory_rows"
    rows_out.mkdir(parents=True, exist_ok=True)
    if args.point:
        print(json.dumps(point(args.model_dir, args.contexts[0], args.budgets[0], args.dtype, rows_out, calibration)))
        return 0
    found = []
    for context in args.contexts:
        for budget in args.budgets:
            done = subprocess.run([sys.executable, __file__, args.model_dir, "--point", "--contexts", str(context),
                                   "--budgets", budget, "--dtype", args.dtype, "--calibration", calibration],
                                  capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                found.append({"context_tokens": context, "budget_gb": None if budget == "none" else float(budget),
                              "error": done.stderr.strip().splitlines()[-1]})
            else:
                found.append({**json.loads(done.stdout.strip().splitlines()[-1]), **against_one_wave(rows_out, context, budget)})
            print({k: v for k, v in found[-1].items() if not k.startswith("predicted_")}, flush=True)
            table = OUT / "long_memory.parquet"  # earlier points of other (context, budget) kept
            earlier = pd.read_parquet(table) if table.is_file() else pd.DataFrame(columns=["context_tokens", "budget_gb"])
            mine = {(f["context_tokens"], f["budget_gb"]) for f in found}
            keep = [r for r in earlier.to_dict("records")
                    if (r["context_tokens"], None if pd.isna(r["budget_gb"]) else r["budget_gb"]) not in mine]
            pd.DataFrame(keep + found).to_parquet(table, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
