"""C15 and C16 from the prose KL (the answers query) of structures a model must be trained for, applied post hoc:
block-sparse reads and cross-layer sharing; decided from intervals (kvlab.stats.intervals)."""

from __future__ import annotations

import pandas as pd

from kvlab.report.noise import floor_text
from kvlab.stats.intervals import all_of, at_least, per_sample, shown

KINDS = ("block_sparse", "cross_layer")


def _not_exact(q: dict, t, kind: str, budget: float) -> list[tuple[str, str, str]]:
    """Every method of `kind` at `budget` is measurably not exact on prose: the lower bound of its mean per-token
    KL to the full cache at least `t.kl` (C3's 'as good as exact' line; the betting lower bound, which holds for any
    KL)."""
    a = q["answers"]
    rows = a[(a["method_kind"] == kind) & a["kl_vs_full"].notna() & ((a["budget"] - budget).abs() < 1e-9)]
    if rows.empty:
        return [("", "not measured", f"no {kind} method on prose at budget {budget:g}")]
    cells = [(method, ctx, t.rule.kl_bounds(per_sample(g, ["kl_vs_full"])["kl_vs_full"].to_numpy(), t.kl))
             for (method, ctx), g in rows.groupby(["method", "context_tokens"], sort=True)]
    evidence = "; ".join(f"{m} {shown(b, ' nat')} at {ctx} tokens" for m, ctx, b in cells)
    return [("", all_of([at_least(b, t.kl) for *_, b in cells]), f"{evidence}.{floor_text(q, t.rule)}")]


def c15(q: dict, t) -> list[tuple[str, str, str]]:
    """Block-sparse reads of `t.budget` of the context, post hoc, are not exact."""
    return _not_exact(q, t, "block_sparse", t.budget)


def c16(q: dict, t) -> list[tuple[str, str, str]]:
    """Cross-layer sharing post hoc (it runs once, at budget 1) is not exact."""
    return _not_exact(q, t, "cross_layer", 1.0)


def rows(answers: pd.DataFrame) -> pd.DataFrame:
    """The answers of the post-hoc kinds and, on the same models and tasks, of plain SnapKV (the eviction that
    keeps, and so reads, a budget's share)."""
    posthoc = answers["method_kind"].isin(KINDS)
    snap = (answers["press"] == "SnapKVPress") & answers["wrapper"].isna() & answers["scheme"].isna()
    tasks = answers.loc[posthoc, ["model", "task"]].drop_duplicates()
    return answers[posthoc | snap].merge(tasks, on=["model", "task"])
