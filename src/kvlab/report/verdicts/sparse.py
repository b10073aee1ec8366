"""C15 from the block-sparse methods' prose KL (the answers query), decided from intervals (kvlab.report.stats)."""

from __future__ import annotations

import pandas as pd

from kvlab.report.noise import floor_text
from kvlab.report.stats import all_of, at_least, mean_bounds, per_sample, shown


def c15(q: dict, t) -> list[tuple[str, str, str]]:
    """Every block-sparse method reading `t.budget` of the context is measurably not exact on prose: the lower
    bound of its mean per-token KL to the full cache at least `t.kl` (C3's 'as good as exact' line)."""
    a = q["answers"]
    rows = a[(a["method_kind"] == "block_sparse") & a["kl_vs_full"].notna() & ((a["budget"] - t.budget).abs() < 1e-9)]
    if rows.empty:
        return [("", "not measured", f"no block_sparse method on prose at budget {t.budget:g}")]
    cells = [(method, ctx, mean_bounds(per_sample(g, ["kl_vs_full"])["kl_vs_full"], t.rule.kl_min_samples))
             for (method, ctx), g in rows.groupby(["method", "context_tokens"], sort=True)]
    evidence = "; ".join(f"{m} {shown(b, ' nat')} at {ctx} tokens" for m, ctx, b in cells)
    return [("", all_of([at_least(b, t.kl) for *_, b in cells]), f"{evidence}.{floor_text(q, t.rule)}")]


def reads(answers: pd.DataFrame) -> pd.DataFrame:
    """The answers of block-sparse methods and, on the same models and tasks, of plain SnapKV (the eviction that
    keeps, and so reads, the same share)."""
    sparse = answers["method_kind"] == "block_sparse"
    snap = (answers["press"] == "SnapKVPress") & answers["wrapper"].isna() & answers["scheme"].isna()
    tasks = answers.loc[sparse, ["model", "task"]].drop_duplicates()
    return answers[sparse | snap].merge(tasks, on=["model", "task"])
