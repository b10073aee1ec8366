"""Build results/kvlab.duckdb from the per-job files. Only this step writes the database."""

from __future__ import annotations

import hashlib
import json
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import duckdb
import pandas as pd

from kvlab.util.columns import DECODE_KERNEL_COLUMNS, ENGINE_VS_PIPELINE_COLUMNS, EVAL_COLUMNS, THROUGHPUT_COLUMNS
from kvlab.state.config import CALIBRATION_TABLES
from kvlab.util.io import atomic_path, read_parquet
from kvlab.models.card import read_card
from kvlab.report.build import load_queries

NESTED_CARD_KEYS = ("layer_types", "rope", "source", "weights")  # card values stored as JSON text in `models`
PACKAGES = ("torch", "transformers", "kvpress", "snakemake", "duckdb", "altair", "triton", "kvlab")


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def provenance(config: dict, root: str | Path = ".") -> pd.DataFrame:
    """Config hash, preset, package versions and git commit, as key/value rows."""
    rows = {"config_hash": config_hash(config), "preset": config.get("preset", "default")}
    for pkg in PACKAGES:
        try:
            rows[f"version:{pkg}"] = version(pkg)
        except PackageNotFoundError:
            rows[f"version:{pkg}"] = "not installed"
    rows["git_commit"] = _git(root, "rev-parse", "HEAD") or "unknown (not a git checkout)"
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    rows["git_dirty"] = "yes" if dirty else "no"
    return pd.DataFrame({"key": list(rows), "value": [str(v) for v in rows.values()]})


def _git(root, *args) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def read_benchmarks(paths: list[str | Path]) -> pd.DataFrame:
    """Snakemake `benchmark:` files (wall time, max RSS); `job` is the path below the `benchmarks` folder,
    e.g. evaluate/{model}/{task}/{ctx}."""
    frames = []
    for p in paths:
        p = Path(p)
        frame = pd.read_csv(p, sep="\t")
        last = len(p.parts) - 1 - p.parts[::-1].index("benchmarks")  # the innermost `benchmarks` folder
        frame.insert(0, "job", Path(*p.parts[last + 1 :]).with_suffix("").as_posix())
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["job", "s"])


def build(
    db_path: str | Path,
    eval_files: list,
    speed_files: list,
    calibration_files: list,
    model_dirs: list,
    cost_files: dict[str, str | Path],
    benchmark_files: list,
    config: dict,
) -> None:
    """Write every table the report reads: eval, throughput, engine_vs_pipeline, decode_kernels, calib_* (one per
    calibration table, all models), models, the cost_table rule's tables (`cost_files`: costs, reads, crossover →
    its Parquet file), benchmarks, provenance; and the view `flips` (queries.sql's query of that name: per cell of
    scored answers, the samples lost and gained against the full cache)."""
    cards = [read_card(d) for d in model_dirs]
    models = pd.DataFrame(
        [{**{k: v for k, v in c.items() if k not in NESTED_CARD_KEYS}, **{k: json.dumps(c[k]) for k in NESTED_CARD_KEYS if k in c}}
         for c in cards]
    )
    tables = {
        "eval": _with_columns(_concat(eval_files), EVAL_COLUMNS),
        "throughput": _concat([f for f in speed_files if "/throughput/" in str(f)], THROUGHPUT_COLUMNS),
        "engine_vs_pipeline": _concat([f for f in speed_files if "/engine_vs_pipeline/" in str(f)], ENGINE_VS_PIPELINE_COLUMNS),
        "decode_kernels": _concat([f for f in speed_files if "/decode_kernels/" in str(f)], DECODE_KERNEL_COLUMNS),
        **{
            f"calib_{name}": _concat([f for f in calibration_files if Path(f).stem == name])
            for name in CALIBRATION_TABLES
        },
        "models": models,
        **{name: read_parquet(path) for name, path in cost_files.items()},
        "benchmarks": read_benchmarks(benchmark_files),
        "provenance": provenance(config),
    }
    with atomic_path(db_path) as tmp:
        tmp.unlink()  # duckdb wants to create the file itself
        con = duckdb.connect(str(tmp))
        try:
            for name, frame in tables.items():
                con.register("frame", frame)
                con.execute(f"CREATE TABLE {name} AS SELECT * FROM frame")
                con.unregister("frame")
            add_views(con)
        finally:
            con.close()


VIEWS = ("flips",)  # queries of queries.sql the database also keeps as views, for a user's own SQL


def add_views(con: duckdb.DuckDBPyConnection) -> None:
    """Each of VIEWS as a view over the tables of `con` (its SQL is the report's, kvlab.report.build.load_queries)."""
    queries = load_queries()
    for name in VIEWS:
        con.execute(f"CREATE VIEW {name} AS {queries[name].rstrip(';')}")


def _with_columns(frame: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """`frame` with each of `columns` typed: those it has cast, those it lacks added empty."""
    frame = frame.astype({c: d for c, d in columns.items() if c in frame})
    return frame.assign(**{c: pd.Series(dtype=d, index=frame.index) for c, d in columns.items() if c not in frame})


def _concat(files: list, empty: dict[str, str] | None = None) -> pd.DataFrame:
    """The files' rows; with no files, a table of the `empty` typed columns (a table only some runs write).

    A column one file holds all empty (a task without needles writes `depth` as None: typed object) is left out of
    that file where another file has values, so that the values type the joined column (pandas deprecates its own
    leaving out of all-empty columns when it types a join: a FutureWarning in every collect)."""
    if not files and empty is not None:
        return pd.DataFrame({c: pd.Series(dtype=d) for c, d in empty.items()})
    return joined([read_parquet(f) for f in files])


def joined(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The frames' rows in one table, as `_concat` joins files (kvlab.tools.progress joins running jobs' rows alike)."""
    valued = {c for f in frames for c in f.columns if f[c].notna().any()}
    out = pd.concat([f.drop(columns=[c for c in f.columns if c in valued and f[c].isna().all()]) for f in frames],
                       ignore_index=True)
    return out[list(dict.fromkeys(c for f in frames for c in f.columns))]  # the files' own column order
