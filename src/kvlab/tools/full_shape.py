"""The `full` preset's shape on the CPU: its tasks (every context length and depth), methods, budgets,
throughput and benchmark grids, on a tiny random model in float32 with one sample per cell. It exercises the
preset's config, masks, lengths and memory at 8K–32K before anyone runs it on a GPU.

    python -m kvlab.tools.full_shape config RUN_DIR            # RUN_DIR/config.yaml, derived from ./config.yaml's preset
    snakemake -s Snakefile --directory RUN_DIR --cores 2 results/report.html
    python -m kvlab.tools.full_shape peaks RUN_DIR             # per-job wall time and peak RSS → RUN_DIR/results/job_peaks.parquet

The config is derived, not written out, so it follows the preset when the preset changes. It is preset-free
(the whole config of the run), so the run's folder needs nothing else.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pandas as pd
import yaml

from kvlab.steps.collect import read_benchmarks
from kvlab.state.config import with_preset
from kvlab.util.io import PEAK_RSS, write_parquet
from kvlab.tasks import max_new_tokens

PRESET = "full"
MODEL = "tiny-qwen2"
TINY = {"source": "tiny", "architecture": "qwen2", "layers": 2, "hidden_size": 64, "heads": 4, "kv_heads": 2, "head_dim": 16}


def derive(config: dict, preset: str = PRESET) -> dict:
    """`config` (config.yaml as read, presets included) with `preset` applied as the pipeline applies it (an overlay,
    kvlab.state.config.with_preset), then made to run on a CPU: the tiny model (positions enough for the longest
    context and its decoding), cpu, float32, one sample per task cell (no rounds)."""
    presets = config.get("presets") or {}
    if preset not in presets:
        raise ValueError(f"no preset {preset!r} in the config; presets: {', '.join(presets) or 'none'}")
    derived = with_preset(config, preset)
    derived["preset"] = "default"  # the derived config is the whole run: no preset left to pick
    derived["device"], derived["dtype"] = "cpu", "float32"
    for task in derived["tasks"].values():
        task["samples"] = 1
        task.pop("max_samples", None)
    derived["sequential"] = {"max_samples": 0}  # one sample per cell: no rounds
    # benchmark.samples too: the engine-vs-pipeline job runs the benchmark task with its own sample count
    derived["benchmark"]["samples"] = 1
    derived["models"] = {MODEL: {**TINY, "max_position_embeddings": positions_needed(derived)}}
    return derived


def positions_needed(config: dict) -> int:
    """The smallest power of two that holds the longest prompt plus the longest answer decoded after it (a
    tiny model refuses lengths beyond its max_position_embeddings)."""
    lengths = [n for task in config["tasks"].values() for n in task["context_tokens"]]
    lengths += config["throughput"]["context_tokens"] + config["benchmark"]["context_tokens"]
    caps = [max_new_tokens(task, config["max_new_tokens"]) for task in config["tasks"].values()]
    caps.append(config["throughput"]["new_tokens"])
    return 1 << (max(lengths) + max(caps) - 1).bit_length()


def write_config(run_dir: Path, source: Path) -> Path:
    """RUN_DIR/config.yaml derived from `source`; returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    header = f"# Derived by `python -m kvlab.tools.full_shape config` from {source.resolve()} (preset {PRESET!r}); do not edit.\n"
    out.write_text(header + yaml.safe_dump(derive(yaml.safe_load(source.read_text())), sort_keys=False))
    return out


PEAK_LINE = re.compile(rf"{PEAK_RSS} ([\d.]+) MB")


def job_peaks(run_dir: Path) -> pd.DataFrame:
    """Per finished job (`job`: the path below results/benchmarks/ and logs/, e.g. evaluate/{model}/{task}/{ctx}):
    wall seconds and RSS sampled by Snakemake's benchmark (`max_rss_mb`), and the kernel's high-water mark the job
    logged at exit (`peak_rss_mb`; empty for a job killed before it could log, or run before jobs logged it),
    the largest peak first."""
    files = sorted((run_dir / "results" / "benchmarks").rglob("*.tsv"))
    if not files:
        raise ValueError(f"{run_dir}: no results/benchmarks/**/*.tsv yet (no job has finished)")
    bench = read_benchmarks(files).rename(columns={"s": "wall_s", "max_rss": "max_rss_mb"})[["job", "wall_s", "max_rss_mb"]]
    logged = []
    for log in sorted((run_dir / "logs").rglob("*.log")):
        if found := PEAK_LINE.findall(log.read_text(errors="replace")):
            job = log.relative_to(run_dir / "logs").with_suffix("").as_posix()
            logged.append({"job": job, "peak_rss_mb": float(found[-1])})
    peaks = pd.DataFrame(logged, columns=["job", "peak_rss_mb"])
    frame = bench.merge(peaks, on="job", how="left")
    frame.insert(0, "rule", frame["job"].str.split("/").str[0])
    return frame.sort_values(["peak_rss_mb", "max_rss_mb"], ascending=False, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("config", help="write RUN_DIR/config.yaml")
    make.add_argument("run_dir", type=Path)
    make.add_argument("--source", type=Path, default=Path("config.yaml"), help="the config holding the preset")
    peaks = sub.add_parser("peaks", help="write RUN_DIR/results/job_peaks.parquet and print it")
    peaks.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "config":
            print(write_config(args.run_dir, args.source))
            return 0
        frame = job_peaks(args.run_dir)
    except (OSError, ValueError) as error:
        sys.exit(f"kvlab.tools.full_shape: {error}")
    write_parquet(frame, args.run_dir / "results" / "job_peaks.parquet")
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
