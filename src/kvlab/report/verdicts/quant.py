"""C3, C4 and C5 from the quantized caches' answers (the answers query: per-sample prose KL, paired task
answers), decided from intervals (kvlab.stats.intervals); C10 from quant_kl's stored bytes. No eviction (budget 1)."""

from __future__ import annotations

import pandas as pd

from kvlab.report.noise import floor_text
from kvlab.stats.intervals import all_of, at_least, at_most, drop_bounds, per_sample, shown, wilson
from kvlab.report.tables import where


def _prose(q: dict) -> pd.DataFrame:
    a = q["answers"]
    return a[a["kl_vs_full"].notna() & (a["budget"] == 1)]


def _kl_cells(rows: pd.DataFrame, t, threshold: float) -> list[tuple[str, int, object]]:
    """(method, prefix tokens, betting bounds of the mean per-sample KL tested at `threshold`) per method and prefix
    length (kvlab.stats.intervals.kl_bounds)."""
    return [(method, ctx, t.rule.kl_bounds(per_sample(g, ["kl_vs_full"])["kl_vs_full"].to_numpy(), threshold))
            for (method, ctx), g in rows.groupby(["method", "context_tokens"], sort=True)]


def _each(cells) -> str:
    return "; ".join(f"{m} {shown(b, ' nat')} at {ctx} tokens" for m, ctx, b in cells)


def c3(q: dict, t) -> list[tuple[str, str, str]]:
    """FP8's mean per-token KL on prose at most `t.kl` at every prefix length (upper bound)."""
    fp8 = _kl_cells(where(_prose(q), scheme="fp8"), t, t.kl)
    if not fp8:
        return [("", "not measured", "no fp8 method in this run")]
    return [("", all_of([at_most(b, t.kl) for _, _, b in fp8]), f"{_each(fp8)}.{floor_text(q, t.rule)}")]


def c4(q: dict, t) -> list[tuple[str, str, str]]:
    """2-bit KIVI: keys per channel at most `t.holds_kl`, keys per token at least `t.collapse_kl` (bounds)."""
    prose = _prose(q)
    chan = _kl_cells(where(prose, scheme="kivi", bits=2, key_axis="channel", value_axis="token", policy="kivi"), t, t.holds_kl)
    tok = _kl_cells(where(prose, scheme="kivi", bits=2, key_axis="token", value_axis="token", policy="kivi"), t, t.collapse_kl)
    if not chan or not tok:
        return [("", "not measured", "needs 2-bit kivi with key_axis channel and token")]
    verdict = all_of([at_most(b, t.holds_kl) for *_, b in chan] + [at_least(b, t.collapse_kl) for *_, b in tok])
    return [("", verdict, f"keys per channel: {_each(chan)}; keys per token: {_each(tok)}.{floor_text(q, t.rule)}")]


def c5(q: dict, t) -> list[tuple[str, str, str]]:
    """4-bit KIVI's accuracy, all its answers pooled, within `t.points` of the full cache's on the same prompts:
    holds when both bounds of the drop lie within ± points, does not hold when one bound lies beyond. Extended
    to the article's question whether INT4 starts to drop on long needles: where the run measured needle tasks
    at more than one context length, the same verdict per length on the needle answers."""
    a = q["answers"]
    int4 = where(a[a["score"].notna() & (a["budget"] == 1)], scheme="kivi", bits=4, key_axis="channel", value_axis="token", policy="kivi")
    if int4.empty:
        return [("", "not measured", "no 4-bit kivi method scored on tasks")]
    method = sorted(int4["method"].unique())[0]
    rows = int4[int4["method"] == method]
    out = [("", *_within(rows, method, t, "question modes and turns pooled"))]
    needles = rows[rows["shape"].str.contains("needle")]
    if needles["context_tokens"].nunique() > 1:
        for ctx, g in needles.groupby("context_tokens", sort=True):
            out.append((f" on needles at {ctx:,} tokens", *_within(g, method, t, "needle tasks at this length")))
    return out


def _within(rows: pd.DataFrame, method: str, t, pooled: str) -> tuple[str, str]:
    s = per_sample(rows, ["score", "full_score"])
    b = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), t.points)
    verdict = ("holds" if -t.points <= b.low and b.high <= t.points
               else "does not hold" if b.low > t.points or b.high < -t.points else "inconclusive")
    low, high = wilson(rows["score"].sum(), len(rows))
    return verdict, (f"{method}: {rows['score'].mean():.1%} [{low:.1%}, {high:.1%}] vs full {rows['full_score'].mean():.1%} over "
                     f"{len(rows)} scored answers ({', '.join(sorted(rows['task'].unique()))}; {pooled}), "
                     f"Δ {-b.mean:+.1f} points; drop bounds [{b.low:+.1f}, {b.high:+.1f}] over {b.n} samples.")


def c10(q: dict, t) -> list[tuple[str, str, str]]:
    """4-bit KIVI's codes + metadata give `t.ratio` (± `t.slack`) over bf16: bytes counted, not sampled."""
    kl = q["quant_kl"]
    int4 = where(kl[kl["budget"] == 1], scheme="kivi", bits=4, key_axis="channel", value_axis="token", policy="kivi")
    if int4.empty:
        return [("", "not measured", "no 4-bit kivi method on prose")]
    r = int4.iloc[0]
    return [("", "holds" if abs(r.codes_vs_bf16 - t.ratio) <= t.slack else "does not hold",
             f"{r.method}: stored codes + metadata give {r.codes_vs_bf16:.3f}× over bf16 for the quantized tokens "
             f"(measured from the tensors); the whole cache at {r.context_tokens} tokens, with its full-precision "
             f"residual, {r.compression_vs_bf16:.2f}×.")]
