"""C6, C7, C8 and C11 from the eviction methods' accuracy beside the full cache on the same samples
(eviction_accuracy) and their prose KL (eviction_kl)."""

from __future__ import annotations

import json

import pandas as pd


def plain(frame: pd.DataFrame, press: str) -> pd.DataFrame:
    """Rows of a kvpress press used alone (no wrapper)."""
    return frame[(frame["press"] == press) & frame["wrapper"].isna()]


def _n_sink(frame: pd.DataFrame) -> pd.Series:
    return frame["press_kwargs"].map(lambda k: json.loads(k).get("n_sink") if isinstance(k, str) else None)


def score(frame: pd.DataFrame) -> tuple[float, float, int]:
    """Accuracy and the full cache's accuracy on the same answers, weighted by rows; and the row count."""
    n = frame["rows"].sum()
    return (frame["accuracy"] * frame["rows"]).sum() / n, (frame["full_accuracy"] * frame["rows"]).sum() / n, int(n)


def _passes(acc: float, full: float, t) -> bool:
    return full > 0 and acc >= full - t.tolerance_points / 100


def _fails(acc: float, full: float, t) -> bool:
    return full > 0 and acc <= t.fail_share * full


def _says(label: str, frame: pd.DataFrame) -> str:
    a, f, n = score(frame)
    return f"{label} {a:.0%} (full {f:.0%}, {n} answers)"


def _verdict(holds: bool, full_accuracies: list[float]) -> str:
    """A claim about losing what the full cache finds cannot be judged where the full cache finds nothing."""
    if min(full_accuracies) == 0:
        return "not measured (the full cache scores 0% on these samples)"
    return "holds" if holds else "does not hold"


def c6(q: dict, t) -> list[tuple[str, str, str]]:
    """SnapKV at `t.budget` passes the single needle question-aware, fails it agnostic and on the second turn."""
    snap = plain(q["eviction_accuracy"], "SnapKVPress")
    snap = snap[snap["budget"] == t.budget]
    parts = {
        "question-aware": snap[(snap["shape"] == "single needle") & (snap["question_mode"] == "aware")],
        "question-agnostic": snap[(snap["shape"] == "single needle") & (snap["question_mode"] == "agnostic")],
        "second turn": snap[(snap["shape"] == "multi-turn") & (snap["question_mode"] == "multi_turn")],
    }
    missing = [k for k, v in parts.items() if v.empty]
    if missing:
        return [("", "not measured", f"no SnapKV rows at {t.budget:g} for: {', '.join(missing)}")]
    s = {k: score(v) for k, v in parts.items()}
    holds = (_passes(*s["question-aware"][:2], t) and _fails(*s["question-agnostic"][:2], t)
             and _fails(*s["second turn"][:2], t))
    return [("", _verdict(holds, [v[1] for v in s.values()]), "; ".join(_says(k, v) for k, v in parts.items()) + ".")]


def c7(q: dict, t) -> list[tuple[str, str, str]]:
    """H2O at `t.budget` fails the single needle in every question mode."""
    acc = q["eviction_accuracy"]
    h2o = acc[(acc["shape"] == "single needle") & (acc["method_kind"] == "h2o") & (acc["budget"] == t.budget)]
    if h2o.empty:
        return [("", "not measured", f"no H2O rows on a single needle at {t.budget:g}")]
    modes = dict(list(h2o.groupby("question_mode")))
    holds = all(_fails(*score(g)[:2], t) for g in modes.values())
    return [("", _verdict(holds, [score(g)[1] for g in modes.values()]),
             "; ".join(_says(f"{m} at {t.budget:g}", g) for m, g in modes.items()) + ".")]


def c8(q: dict, t) -> list[tuple[str, str, str]]:
    """StreamingLLM (with sinks) fails needles outside its window; without sinks its prose KL is at least
    `t.collapse` times the KL with sinks at every budget. A needle is outside the kept window when its distance
    from the end, as a fraction of the document, exceeds the budget by `t.window_margin` (depth is measured
    in sentences, not tokens)."""
    acc, kl = q["eviction_accuracy"], q["eviction_kl"]
    stream = plain(acc[acc["shape"].isin(["single needle", "recency"]) & acc["depth"].notna()], "StreamingLLMPress")
    stream = stream[_n_sink(stream).fillna(0) > 0]
    distance = 1 - stream["depth"]
    outside = stream[distance > stream["budget"] + t.window_margin]
    inside = stream[distance < stream["budget"] - t.window_margin]
    streams = plain(kl, "StreamingLLMPress").assign(n_sink=lambda f: _n_sink(f))
    pairs = streams[streams["n_sink"] == 0].merge(
        streams[streams["n_sink"] > 0], on=["model", "budget", "context_tokens"], suffixes=("_0", "_sinks"))
    if outside.empty or pairs.empty:
        what = "needles outside the window" if outside.empty else "prose KL with n_sink 0 and with sinks"
        return [("", "not measured", f"no StreamingLLM rows for {what}")]
    ratio = pairs["kl_mean_nats_0"] / pairs["kl_mean_nats_sinks"]
    holds = _fails(*score(outside)[:2], t) and bool((ratio >= t.collapse).all())
    each = "; ".join(f"{r.budget:g} at {r.context_tokens} tokens: {r.kl_mean_nats_0:.3g} vs {r.kl_mean_nats_sinks:.3g} nat"
                     for r in pairs.itertuples())
    return [("", _verdict(holds, [score(outside)[1]]),
             _says("needle outside the kept window", outside) + ("; " + _says("inside", inside) if not inside.empty else "")
             + f". Prose KL without sinks vs with {int(pairs['n_sink_sinks'].iloc[0])}: {each}.")]


def c11(q: dict, t) -> list[tuple[str, str, str]]:
    """PyramidKV at least SnapKV minus the tolerance at every shared budget (same tasks, modes and depths)."""
    acc = q["eviction_accuracy"]
    keys = ["model", "shape", "question_mode", "budget", "depth"]
    both = plain(acc, "PyramidKVPress").merge(plain(acc, "SnapKVPress"), on=keys, suffixes=("_p", "_s"))
    if both.empty:
        return [("", "not measured", "needs PyramidKV and SnapKV on the same tasks")]
    per = []
    for budget, g in both.groupby("budget", sort=False):
        n = g["rows_p"].sum()
        per.append((budget, (g["accuracy_p"] * g["rows_p"]).sum() / n, (g["accuracy_s"] * g["rows_s"]).sum() / g["rows_s"].sum(), n))
    holds = all(p >= s - t.tolerance_points / 100 for _, p, s, _ in per)
    full = (both["full_accuracy_p"] * both["rows_p"]).sum() / both["rows_p"].sum()
    return [("", _verdict(holds, [full]),
             "; ".join(f"{b:g}: PyramidKV {p:.1%} vs SnapKV {s:.1%} ({n} answers each)" for b, p, s, n in per)
             + " (every scored task shape and question mode both ran).")]
