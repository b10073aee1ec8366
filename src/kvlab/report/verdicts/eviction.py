"""C6, C7, C8 and C11 from the eviction methods' answers beside the full cache's on the same prompts and their
per-sample prose KL (the answers query), decided from paired bounds over samples (kvlab.stats.intervals)."""

from __future__ import annotations

import json

import pandas as pd

from kvlab.report.noise import floor_text
from kvlab.stats.intervals import ORDER, all_of, at_least, at_most, drop_bounds, mean_bounds, per_sample

NO_REFERENCE = "not measured (the full cache scores 0% on these samples)"


def plain(frame: pd.DataFrame, press: str) -> pd.DataFrame:
    """Rows of a kvpress press used alone (no wrapper)."""
    return frame[(frame["press"] == press) & frame["wrapper"].isna()]


def _n_sink(frame: pd.DataFrame) -> pd.Series:
    return frame["press_kwargs"].map(lambda k: json.loads(k).get("n_sink") if isinstance(k, str) else None)


def _evicting(q: dict, prose: bool = False) -> pd.DataFrame:
    """Answers (or, with `prose`, prose KL rows) of methods that only evict: kvpress presses and H2O, no storage scheme."""
    a = q["answers"]
    a = a[a["scheme"].isna() & a["method_kind"].isin(["kvpress", "h2o"])]
    return a[a["kl_vs_full"].notna()] if prose else a[a["score"].notna()]


def _bounds(rows: pd.DataFrame, threshold: float, share: float = 1.0):
    s = per_sample(rows, ["score", "full_score"])
    return drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), threshold, share)


def _passes(rows: pd.DataFrame, t) -> tuple[str, str]:
    """Within the tolerance of the full cache: the upper bound of the drop at most tolerance_points."""
    b = _bounds(rows, t.tolerance_points)
    return at_most(b, t.tolerance_points), f"drop bounds [{b.low:+.0f}, {b.high:+.0f}] pts"


def _fails(rows: pd.DataFrame, t) -> tuple[str, str]:
    """At most fail_share of the full cache's accuracy: share × full − accuracy has its lower bound ≥ 0."""
    b = _bounds(rows, 0, t.fail_share)
    return at_least(b, 0), f"{t.fail_share:g}×full − accuracy bounds [{b.low:+.0f}, {b.high:+.0f}] pts"


def _says(label: str, rows: pd.DataFrame, part: tuple[str, str]) -> str:
    return (f"{label} {rows['score'].mean():.0%} (full {rows['full_score'].mean():.0%}, {len(rows)} answers, "
            f"{rows['sample_id'].nunique()} samples; {part[1]})")


def _verdict(parts: list[tuple[str, str]], frames: list[pd.DataFrame]) -> str:
    """A claim about losing what the full cache finds cannot be judged where the full cache finds nothing."""
    if min(f["full_score"].mean() for f in frames) == 0:
        return NO_REFERENCE
    return all_of([p[0] for p in parts])


def c6(q: dict, t) -> list[tuple[str, str, str]]:
    """SnapKV at `t.budget` passes the single needle question-aware, fails it agnostic and on the second turn."""
    snap = plain(_evicting(q), "SnapKVPress")
    snap = snap[snap["budget"] == t.budget]
    frames = {
        "question-aware": snap[(snap["shape"] == "single needle") & (snap["question_mode"] == "aware")],
        "question-agnostic": snap[(snap["shape"] == "single needle") & (snap["question_mode"] == "agnostic")],
        "second turn": snap[(snap["shape"] == "multi-turn") & (snap["question_mode"] == "multi_turn")],
    }
    missing = [k for k, v in frames.items() if v.empty]
    if missing:
        return [("", "not measured", f"no SnapKV rows at {t.budget:g} for: {', '.join(missing)}")]
    parts = {k: (_passes if k == "question-aware" else _fails)(v, t) for k, v in frames.items()}
    return [("", _verdict(list(parts.values()), list(frames.values())),
             "; ".join(_says(k, v, parts[k]) for k, v in frames.items()) + ".")]


def c7(q: dict, t) -> list[tuple[str, str, str]]:
    """H2O at `t.budget` fails the single needle in every question mode."""
    acc = _evicting(q)
    h2o = acc[(acc["shape"] == "single needle") & (acc["method_kind"] == "h2o") & (acc["budget"] == t.budget)]
    if h2o.empty:
        return [("", "not measured", f"no H2O rows on a single needle at {t.budget:g}")]
    modes = dict(list(h2o.groupby("question_mode")))
    parts = {m: _fails(g, t) for m, g in modes.items()}
    return [("", _verdict(list(parts.values()), list(modes.values())),
             "; ".join(_says(f"{m} at {t.budget:g}", g, parts[m]) for m, g in modes.items()) + ".")]


def c8(q: dict, t) -> list[tuple[str, str, str]]:
    """StreamingLLM (with sinks) fails needles outside its window; without sinks its prose KL is at least
    `t.collapse` times the KL with sinks (per sample: KL₀ − collapse × KL_sinks has its lower bound ≥ 0) at every
    budget. A needle is outside the kept window when its distance from the end, as a fraction of the document,
    exceeds the budget by `t.window_margin` (depth is measured in sentences, not tokens)."""
    acc = _evicting(q)
    stream = plain(acc[acc["shape"].isin(["single needle", "recency"]) & acc["depth"].notna()], "StreamingLLMPress")
    stream = stream[_n_sink(stream).fillna(0) > 0]
    distance = 1 - stream["depth"]
    outside = stream[distance > stream["budget"] + t.window_margin]
    inside = stream[distance < stream["budget"] - t.window_margin]
    streams = plain(_evicting(q, prose=True), "StreamingLLMPress").assign(n_sink=lambda f: _n_sink(f))
    pairs = streams[streams["n_sink"] == 0].merge(
        streams[streams["n_sink"] > 0], on=["model", "budget", "context_tokens", "sample_id"], suffixes=("_0", "_sinks"))
    if outside.empty or pairs.empty:
        what = "needles outside the window" if outside.empty else "prose KL with n_sink 0 and with sinks"
        return [("", "not measured", f"no StreamingLLM rows for {what}")]
    fails = _fails(outside, t)
    parts, each = [fails], []
    for (budget, ctx), g in pairs.groupby(["budget", "context_tokens"], sort=False):
        s = per_sample(g, ["kl_vs_full_0", "kl_vs_full_sinks"])
        b = mean_bounds(s["kl_vs_full_0"] - t.collapse * s["kl_vs_full_sinks"], t.rule.kl_min_samples)
        parts.append((at_least(b, 0), ""))
        bounds = f"[{b.low:.3g}, {b.high:.3g}]" if b.high < float("inf") else "unbounded: too few samples"
        each.append(f"{budget:g} at {ctx} tokens: {s['kl_vs_full_0'].mean():.3g} vs {s['kl_vs_full_sinks'].mean():.3g} nat "
                    f"(KL₀ − {t.collapse:g}×KL_sinks {bounds}, n={b.n})")
    inside_text = "; " + _says("inside", inside, _fails(inside, t)) if not inside.empty else ""
    return [("", _verdict(parts, [outside]),
             _says("needle outside the kept window", outside, fails) + inside_text
             + f". Prose KL without sinks vs with {int(pairs['n_sink_sinks'].iloc[0])}: {'; '.join(each)}."
             + floor_text(q, t.rule))]


def c11(q: dict, t) -> list[tuple[str, str, str]]:
    """PyramidKV at least SnapKV minus the tolerance at every shared budget, paired on the same answers: the
    upper bound of SnapKV − PyramidKV at most tolerance_points."""
    acc = _evicting(q)
    keys = ["model", "sample_id", "question_mode", "turn", "budget", *[c for c in ORDER if c in acc]]
    both = plain(acc, "PyramidKVPress").merge(plain(acc, "SnapKVPress"), on=keys, suffixes=("_p", "_s"))
    if both.empty:
        return [("", "not measured", "needs PyramidKV and SnapKV on the same tasks")]
    parts, each = [], []
    for budget, g in both.groupby("budget", sort=False):
        s = per_sample(g, ["score_p", "score_s"])
        b = drop_bounds(s["score_s"].to_numpy(), s["score_p"].to_numpy(), t.tolerance_points)
        parts.append((at_most(b, t.tolerance_points), ""))
        each.append(f"{budget:g}: PyramidKV {g['score_p'].mean():.1%} vs SnapKV {g['score_s'].mean():.1%} ({len(g)} answers "
                    f"each, {b.n} samples; SnapKV − PyramidKV bounds [{b.low:+.0f}, {b.high:+.0f}] pts)")
    return [("", _verdict(parts, [both.rename(columns={"full_score_p": "full_score"})]),
             "; ".join(each) + " (every scored task shape and question mode both ran).")]
