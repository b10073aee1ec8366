"""Frame helpers that more than one section or verdict uses: row filters and accuracy pooled over tasks."""

from __future__ import annotations

import pandas as pd

STORAGE = ["model", "method", "scheme", "bits", "key_axis", "value_axis", "budget"]


def where(frame: pd.DataFrame, **equal) -> pd.DataFrame:
    """The rows whose columns equal the given values."""
    for key, value in equal.items():
        frame = frame[frame[key] == value]
    return frame


def pooled(by_task: pd.DataFrame, common_tasks: bool = False) -> pd.DataFrame:
    """Accuracy per method over the tasks it ran on (all answers pooled) — or, with `common_tasks`, over the
    tasks every method in `by_task` ran on, so methods limited to some tasks compare on equal ground."""
    if by_task.empty:
        return pd.DataFrame(columns=[*STORAGE, "accuracy", "full_accuracy", "delta_points", "rows", "tasks"])
    if common_tasks:
        keep = set.intersection(*(set(g["task"]) for _, g in by_task.groupby("method")))
        by_task = by_task[by_task["task"].isin(keep)]
    g = by_task.groupby(STORAGE, dropna=False).agg(
        correct=("correct", "sum"), full_correct=("full_correct", "sum"), rows=("rows", "sum"),
        tasks=("task", lambda t: ", ".join(sorted(t))),
    ).reset_index()
    g["accuracy"], g["full_accuracy"] = g["correct"] / g["rows"], g["full_correct"] / g["rows"]
    g["delta_points"] = 100 * (g["accuracy"] - g["full_accuracy"])
    return g[[*STORAGE, "accuracy", "full_accuracy", "delta_points", "rows", "tasks"]]
