"""Eviction methods: C6, C7, C8 and C11, accuracy per shape, mode and budget, and KL on prose."""

import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule
from kvlab.report.html import esc, table, verdict_list
from kvlab.report.tables import with_kl_bounds, with_wilson

TITLE = "Eviction: which tokens survive"
QUERIES = ("eviction_accuracy", "eviction_kl")
CLAIMS = [6, 7, 8, 11]


def _score(frame: pd.DataFrame) -> pd.Series:
    """Accuracy and the full cache's accuracy on the same answers, weighted by rows; and the row count."""
    n = frame["rows"].sum()
    return pd.Series({"accuracy": (frame["accuracy"] * frame["rows"]).sum() / n,
                      "full_accuracy": (frame["full_accuracy"] * frame["rows"]).sum() / n, "rows": int(n)})


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    acc, kl = q["eviction_accuracy"], q["eviction_kl"]
    if acc.empty and kl.empty:
        return "<p>No eviction method was configured in this run.</p>"
    masking = acc[acc["kept_tokens"] < acc["stored_tokens"] - 0.5]
    note = ""
    if not masking.empty:
        names = ", ".join(sorted(masking["method"].unique()))
        note = (f"<p class='note'>{esc(names)}: the press masks evicted keys per head and frees nothing — "
                "stored tokens stay the prompt's, attended tokens drop to the budget (see the bytes section).</p>")
    pooled_modes = acc.groupby(["model", "shape", "question_mode", "method", "budget"], sort=False).apply(
        _score, include_groups=False).reset_index()
    return (
        "<p>Eviction compresses once, after the prompt part is prefilled (question-agnostic: the context alone; "
        "aware: context and question; multi_turn: the aware cache asked a later question about another needle). "
        "H2O also evicts at every decoding step. Positions: kept keys keep their rotation and decoding continues "
        "at the prompt's length, except for methods wrapped in KeyRerotationPress (StreamingLLM's own scheme: "
        "keys re-rotated to 0…n−1, decoding from n). Sliding-window layers (Gemma 3) are never compressed.</p>"
        + verdict_list(verdicts(CLAIMS, q, rule)) + note + table(with_wilson(pooled_modes)) + "<h3>On real prose</h3>"
        + table(with_kl_bounds(kl, q["answers"], ["model", "method", "budget", "context_tokens"], rule.kl_min_samples))
    )
