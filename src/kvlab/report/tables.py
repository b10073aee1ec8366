"""Frame helpers that more than one section or verdict uses: row filters, accuracy pooled over tasks, and
intervals added to a shown table (Wilson for accuracy, bootstrap over samples for KL)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvlab.stats.intervals import mean_bounds, per_sample, wilson

STORAGE = ["model", "method", "scheme", "bits", "key_axis", "value_axis", "policy", "budget"]


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


def with_wilson(acc: pd.DataFrame, count: str = "rows") -> pd.DataFrame:
    """The rows with their accuracy's Wilson 95% interval over the answers counted in `count` (and the full
    cache's, `full_low` / `full_high`, where the rows carry `full_accuracy`)."""
    out = acc.copy()
    for column, low, high in (("accuracy", "accuracy_low", "accuracy_high"), ("full_accuracy", "full_low", "full_high")):
        if column in out:
            bounds = [wilson(a * n, n) for a, n in zip(out[column], out[count])]
            out[low], out[high] = [b[0] for b in bounds], [b[1] for b in bounds]
    return out


def with_kl_bounds(kl: pd.DataFrame, answers: pd.DataFrame, keys: list[str], min_samples: int) -> pd.DataFrame:
    """`kl` (one row per `keys`) with the bootstrap bounds of its mean per-sample KL from the answers query's
    prose rows (blank where too few samples bound it)."""
    prose = answers[answers["kl_vs_full"].notna()]
    rows = []
    for key, g in prose.groupby(keys, sort=False, dropna=False):
        b = mean_bounds(per_sample(g, ["kl_vs_full"])["kl_vs_full"], min_samples)
        finite = np.isfinite(b.high)
        rows.append({**dict(zip(keys, key)), "kl_low": b.low if finite else np.nan, "kl_high": b.high if finite else np.nan})
    bounds = pd.DataFrame(rows, columns=[*keys, "kl_low", "kl_high"])
    return kl.merge(bounds, on=keys, how="left") if len(kl) else kl.assign(kl_low=[], kl_high=[])
