"""Decide, then stop: an evaluation job's prompts go, round by round, only to the methods with a verdict still open.

A job (a task at one context length) first runs the task's `samples` on every variant. After each round every cell
of the job (method × budget × question mode) is decided as the report decides it: the paired per-sample drop
against the full cache, bounded by a betting confidence sequence (kvlab.stats.intervals.drop_bounds, kvlab.stats.anytime),
safe when its upper bound is within the tolerance, unsafe when its lower bound reaches it. Those bounds hold at
every n at once, so stopping on them keeps their level. A decided cell stays open until the e-value of its
decision also reaches the table's stopping level, 1/(α · decision.planned_share) (kvlab.report.decision.Rule.stop_e):
then e-BH over the whole table keeps it whenever that share of the table is decided. The next `round` prompts go
to the full cache (always: the reference) and to the variants with an open cell, each only for the compressions
its open question modes need (kvlab.engine.sample); the job ends when none is open or `max_samples` prompts ran.
Prompts are drawn index by index (kvlab.tasks.base.grid_samples), so a longer run only adds prompts, and stopping
depends on the answers alone, so two runs give the same rows.

Prose tasks (kind continuation) are scored by their per-sample KL against the full cache, decided as the report
decides it too (kvlab.stats.intervals.kl_bounds: the capped mean and the share above the cap), so they run in rounds
as well.
"""

from __future__ import annotations

import math

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.stats.intervals import drop_bounds, per_sample


def planned(spec: dict, initial: int, max_samples: int) -> int:
    """The most prompts a job may reach: `max_samples` (the task's own, else the run's), never fewer than the
    initial samples."""
    return max(initial, int(spec.get("max_samples", max_samples)))


def per_point(initial: int, samples: int, total: int) -> int:
    """Samples per grid point (depth, distance) to draw so that `total` prompts exist, given that `samples` per point
    gave `initial` prompts."""
    points = max(1, initial // max(samples, 1))
    return math.ceil(total / points)


def cell_drops(rows: pd.DataFrame) -> pd.DataFrame:
    """Each compressed row beside the full cache's answer to the same prompt (sample, question mode, turn)."""
    full = rows[rows["method_kind"] == "full"][["sample_id", "question_mode", "turn", "score"]]
    other = rows[rows["method_kind"] != "full"]
    return other.merge(full.rename(columns={"score": "full_score"}), on=["sample_id", "question_mode", "turn"])


def settled(b, threshold: float, rule: Rule) -> bool:
    """A cell the job may stop: decided, and the e-value of its decision at its last sample at least rule.stop_e."""
    decision = b.decide(threshold)
    log_e = b.log_e_safe if decision == "safe" else b.log_e_unsafe if decision == "unsafe" else -math.inf
    return log_e >= math.log(rule.stop_e)


def open_cells(rows: pd.DataFrame, rule: Rule) -> dict[tuple[str, float], set[str]]:
    """(method, budget) -> its question modes whose cell is not yet settled (`settled`; pairs with none left out):
    scored answers by their paired drop at rule.tolerance_points, prose by its per-sample KL at rule.kl_safe."""
    keys = ["method", "budget", "question_mode"]
    scored = cell_drops(rows[rows["score"].notna()]) if "score" in rows else rows.iloc[:0]
    # prose: rows with no score to pair (kind continuation); scored rows carry the KL along the full answer too,
    # but are decided on their scores alone, as the report's answers query reads them
    unscored = rows["score"].isna() if "score" in rows else pd.Series(True, index=rows.index)
    prose = (rows[(rows["method_kind"] != "full") & rows["kl_vs_full"].notna() & unscored] if "kl_vs_full" in rows
             else rows.iloc[:0])
    out: dict[tuple[str, float], set[str]] = {}
    for (method, budget, mode), g in scored.groupby(keys, sort=False):
        s = per_sample(g, ["full_score", "score"])
        b = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), rule.tolerance_points)
        if not settled(b, rule.tolerance_points, rule):
            out.setdefault((method, float(budget)), set()).add(mode)
    for (method, budget, mode), g in prose.groupby(keys, sort=False):
        b = rule.kl_bounds(per_sample(g, ["kl_vs_full"])["kl_vs_full"].to_numpy())
        if not settled(b, rule.kl_safe, rule):
            out.setdefault((method, float(budget)), set()).add(mode)
    return out
