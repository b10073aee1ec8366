"""Compare the Parquet rows of two pipeline runs (two working folders), e.g. before and after a refactor:

    python -m kvlab.tools.compare_runs OLD_DIR NEW_DIR [--added-method NAME ...]

Every `results/**/*.parquet` of one must be in the other with equal rows on every column but wall-clock ones
(`*_s`, `speedup*`, `*_per_s`), `decode_batch` (rows decoded together: it grows with the methods a run
has) and `waves` (how many waves the job's memory budget split them into). Rows of an `--added-method` (a method
only the new run has) are left out of the new run's files first.
Prints one line per file; exits 1 when any file differs or is missing."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

VARYING = re.compile(r"(_s|speedup\w*|_per_s|^decode_batch|^waves)$")  # wall-clock columns differ between any two runs


def comparable(frame: pd.DataFrame, drop_methods: tuple[str, ...] = ()) -> pd.DataFrame:
    """`frame` without the columns that differ between any two runs (and without rows of `drop_methods`)."""
    if drop_methods and "method" in frame.columns:
        frame = frame[~frame["method"].isin(drop_methods)]
    return frame.drop(columns=[c for c in frame.columns if VARYING.search(c)]).reset_index(drop=True)


def compare(old: Path, new: Path, added_methods: tuple[str, ...] = ()) -> list[str]:
    """One line per Parquet file of either run: 'same', 'differs: …' or 'only in …'."""
    files = {p.relative_to(d) for d in (old, new) for p in (d / "results").rglob("*.parquet")}
    if not files:
        raise FileNotFoundError(f"no results/**/*.parquet under {old} or {new}; run the pipeline in both first")
    lines = []
    for rel in sorted(files):
        missing = [str(d) for d in (old, new) if not (d / rel).is_file()]
        if missing:
            lines.append(f"{rel}: only in {new if missing[0] == str(old) else old}")
            continue
        a = comparable(pd.read_parquet(old / rel))
        b = comparable(pd.read_parquet(new / rel), added_methods)
        try:
            pd.testing.assert_frame_equal(a, b, check_exact=True)
            lines.append(f"{rel}: same ({len(a)} rows)")
        except AssertionError as error:
            lines.append(f"{rel}: differs: {' '.join(str(error).split())[:300]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--added-method", action="append", default=[], help="a method only NEW has (its rows are left out)")
    args = parser.parse_args(argv)
    lines = compare(args.old, args.new, tuple(args.added_method))
    print("\n".join(lines))
    return 0 if all(": same (" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
