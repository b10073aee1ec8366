"""Decided cells per CPU-hour: a run's grid at a fixed n against the same grid in rounds (issue 36's benchmark).

Round 1 of every evaluation job is the fixed-n grid itself: every variant, every question mode, the task's
`samples`, in the same batches (kvlab.steps.evaluate). So one finished run gives both sides on the same machine, in one
run: fixed-n = the rows and wall seconds of round 1, adaptive = every round; a third row projects the cost of a
fixed grid sized to decide a lossless cell (every variant on max_samples prompts). Cells are the decision table's
(kvlab.report.decision.cells over the `answers` query); CPU-hours are the rounds' wall seconds × the job's threads.

    python benchmarks/sequential_ab.py [results/kvlab.duckdb | 'results/eval/*/*/*.parquet'] [threads]
        ->  results/benchmarks/sequential_ab.tsv

A glob of eval files (the jobs a run has finished so far) works as well as the collected database.
"""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import pandas as pd

from kvlab.report.build import load_queries
from kvlab.report.decision import Rule, cells


def side(answers: pd.DataFrame, seconds: float, threads: int, name: str, rule: Rule) -> dict:
    c = cells(answers, rule, by=["model", "shape", "question_mode"])["decision"].value_counts()
    decided = int(c.get("safe", 0) + c.get("unsafe", 0))
    hours = seconds * threads / 3600
    return {"grid": name, "cells": int(c.sum()), "safe": int(c.get("safe", 0)), "unsafe": int(c.get("unsafe", 0)),
            "inconclusive": int(c.get("inconclusive", 0)), "decided": decided, "decided_share": decided / max(int(c.sum()), 1),
            "samples": int(answers.groupby(["model", "shape", "question_mode", "method", "budget"])["sample_id"].nunique().sum()),
            "wall_s": seconds, "cpu_hours": hours, "decided_per_cpu_hour": decided / hours if hours else float("nan")}


def main(db: str = "results/kvlab.duckdb", threads: int = 2) -> pd.DataFrame:
    if db.endswith(".duckdb"):
        con = duckdb.connect(db, read_only=True)
    else:  # eval files: the view collect would build, over the jobs finished so far
        con = duckdb.connect()
        con.execute(f"CREATE VIEW eval AS SELECT * FROM read_parquet('{db}', union_by_name = true)")
    answers = con.sql(load_queries()["answers"]).df()
    rounds = con.sql("SELECT model, task, context_tokens, round, max(round_s) AS round_s FROM eval "
                     "GROUP BY ALL").df()  # one wall time per round of each job
    rule = Rule()  # the default decision rule: 5 points
    first = rounds[rounds["round"] == 1]["round_s"].sum()
    # a fixed grid large enough to decide a lossless cell runs every variant on max_samples prompts: round 1's
    # seconds per prompt × max_samples per job (projected, not run); its decisions taken as every round's
    per_job = con.sql("SELECT model, task, context_tokens, max(max_samples) AS cap, count(DISTINCT draw) FILTER "
                      "(WHERE round = 1) AS first FROM eval GROUP BY ALL").df()
    sized = per_job.merge(rounds[rounds["round"] == 1], on=["model", "task", "context_tokens"])
    projected = float((sized["round_s"] / sized["first"] * sized["cap"]).sum())
    out = pd.DataFrame([side(answers[answers["round"] == 1], first, threads, "fixed n (round 1 only)", rule),
                        side(answers, rounds["round_s"].sum(), threads, "adaptive (every round)", rule),
                        side(answers, projected, threads, "fixed n = max_samples (projected cost)", rule)])
    out["gain_decided_per_cpu_hour"] = out["decided_per_cpu_hour"] / out["decided_per_cpu_hour"].iloc[0]
    path = Path("results/benchmarks/sequential_ab.tsv")
    path.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(path, sep="\t", index=False)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:2], *map(int, sys.argv[2:3])).to_string())
