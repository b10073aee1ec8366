"""Decided cells per CPU-hour: a run's grid at a fixed n against the same grid in rounds (issue 36's benchmark).

Round 1 of every evaluation job is the fixed-n grid itself: every variant, every question mode, the task's
`samples`, in the same batches (kvlab.evaluate). So one finished run gives both sides on the same machine, in one
run: fixed-n = the rows and wall seconds of round 1, adaptive = every round. Cells are the decision table's
(kvlab.report.decision.cells over the `answers` query); CPU-hours are the rounds' wall seconds × the job's threads.

    python benchmarks/sequential_ab.py [results/kvlab.duckdb] [threads]   ->  results/benchmarks/sequential_ab.tsv
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
    con = duckdb.connect(db, read_only=True)
    answers = con.sql(load_queries()["answers"]).df()
    rounds = con.sql("SELECT DISTINCT model, task, context_tokens, round, round_s FROM eval").df()
    rule = Rule()  # the default decision rule: 5 points
    first = rounds[rounds["round"] == 1]["round_s"].sum()
    out = pd.DataFrame([side(answers[answers["round"] == 1], first, threads, "fixed n (round 1 only)", rule),
                        side(answers, rounds["round_s"].sum(), threads, "adaptive (every round)", rule)])
    out["gain_decided_per_cpu_hour"] = out["decided_per_cpu_hour"] / out["decided_per_cpu_hour"].iloc[0]
    path = Path("results/benchmarks/sequential_ab.tsv")
    path.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(path, sep="\t", index=False)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:2], *map(int, sys.argv[2:3])).to_string())
