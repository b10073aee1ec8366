"""Output length: whether each task's decoding cap lets the full cache finish its answers, and how much longer
(or shorter) each compressed method's answers run than the full cache's on the same prompts (compression often
makes a model ramble: a longer answer costs decode steps the bytes saved per step must pay for)."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import esc, table
from kvlab.stats.intervals import LEVEL, mean_bounds, per_sample, wilson

TITLE = "Output length"
QUERIES = ("output_lengths",)
MIN_SAMPLES = 5  # fewer samples bound no mean length change (bootstrap over samples, as for KL)
KEYS = ["model", "task", "context_tokens"]


def caps(rows: pd.DataFrame) -> pd.DataFrame:
    """Per task: the cap, the full cache's accuracy and the share of its answers that reached the cap (Wilson
    intervals over answers), and its mean answer length."""
    out = []
    for key, g in rows[rows["method_kind"] == "full"].groupby(KEYS, sort=True):
        at_cap = int((g["new_tokens"] >= g["max_new_tokens"]).sum())
        acc_low, acc_high = wilson(g["score"].sum(), len(g))
        cap_low, cap_high = wilson(at_cap, len(g))
        out.append({**dict(zip(KEYS, key)), "max_new_tokens": int(g["max_new_tokens"].max()), "answers": len(g),
                    "full_accuracy": g["score"].mean(), "accuracy_low": acc_low, "accuracy_high": acc_high,
                    "full_tokens_mean": g["new_tokens"].mean(), "at_cap": at_cap / len(g), "at_cap_low": cap_low,
                    "at_cap_high": cap_high})
    return pd.DataFrame(out)


def changes(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (task, method, budget): the mean change in answer length against the full cache's answer to the same
    prompt, averaged within a sample first (its question modes and turns) and bounded by a bootstrap over samples
    (one-sided 95% bounds; under MIN_SAMPLES samples, unbounded); longer / shorter when a bound excludes 0."""
    out = []
    compressed = rows[rows["method_kind"] != "full"].assign(change=lambda r: r["new_tokens"] - r["full_tokens"])
    for key, g in compressed.groupby([*KEYS, "method", "budget"], sort=False):
        b = mean_bounds(per_sample(g, ["change"])["change"], MIN_SAMPLES)
        out.append({**dict(zip([*KEYS, "method", "budget"], key)), "samples": b.n, "tokens_mean": g["new_tokens"].mean(),
                    "full_tokens_mean": g["full_tokens"].mean(), "change_tokens": b.mean, "change_low": b.low,
                    "change_high": b.high, "at_cap": (g["new_tokens"] >= g["max_new_tokens"]).mean(),
                    "outcome": "longer" if b.low > 0 else "shorter" if b.high < 0 else "undecided"})
    return pd.DataFrame(out)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    rows = q["output_lengths"]
    if rows.empty:
        return "<p>No task with scored answers ran.</p>"
    c, d = caps(rows), changes(rows)
    short = c[c["at_cap"] > 0.5]
    cap_note = (f"At its cap the full cache ran out of tokens on more than half its answers in: "
                f"{', '.join(f'{t} ({s:.0%} of {n})' for t, s, n in zip(short['task'], short['at_cap'], short['answers']))}; "
                f"there a score says more about the cap than about the method, and the KL along the full cache's "
                f"answer is the better measure." if len(short) else
                "On every task the full cache ended most of its answers before the cap.")
    if d.empty:
        return f"<p>{esc(cap_note)}</p>" + table(c) + "<p>No compressed method answered these tasks.</p>"
    counts = d["outcome"].value_counts()
    summary = (f"Of {len(d)} method cells, answers run longer than the full cache's in {counts.get('longer', 0)}, "
               f"shorter in {counts.get('shorter', 0)} and neither is decided in {counts.get('undecided', 0)} "
               f"(one-sided {LEVEL:.0%} bounds over samples; cells under {MIN_SAMPLES} samples are left unbounded).")
    longer = d[d["outcome"] == "longer"].sort_values("change_tokens", ascending=False).head(8)
    top = ("Longest: " + "; ".join(f"{m} ({b:g}) on {t}: {x:+.1f} tokens [{lo:+.1f}, {hi:+.1f}], n={n}" for m, b, t, x, lo, hi, n in
                                   zip(longer["method"], longer["budget"], longer["task"], longer["change_tokens"],
                                       longer["change_low"], longer["change_high"], longer["samples"])) + ".") if len(longer) else ""
    return (
        "<p>Per task, the decoding cap and how the full cache's answers fit in it (accuracy and the share of answers "
        f"that reached the cap, each with a {LEVEL:.0%} Wilson interval over answers). A cap the full cache "
        "outruns cuts every method's answers alike.</p>"
        f"<p>{esc(cap_note)}</p>" + table(c) +
        "<p>Per method and budget, the change in answer length against the full cache's answer to the same prompt "
        "(tokens, EOS included), its bootstrap bounds over samples and the share of its answers at the cap.</p>"
        f"<p>{esc(summary)} {esc(top)}</p>" + table(d)
    )
