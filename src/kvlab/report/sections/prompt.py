"""Prompt compression (article §7): LLMLingua-style token dropping before the prompt is cached; claim C17."""

import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule, cells
from kvlab.report.html import table, verdict_list

TITLE = "Prompt compression (article §7)"
QUERIES = ()
CLAIMS = [17]
SHOWN = ["model", "shape", "question_mode", "method", "budget", "kv_fraction_bf16", "accuracy", "accuracy_low",
         "accuracy_high", "full_accuracy", "full_low", "full_high", "drop_low", "drop_high", "kl_mean_nats", "kl_low", "kl_high", "decision", "samples"]


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    a = q["answers"]
    rows = a[a["method_kind"] == "prompt_compression"]
    if rows.empty:
        return "<p>No prompt_compression method was configured in this run.</p>"
    c = cells(rows, rule, by=["model", "shape", "question_mode"])
    return (
        "<p>Fewer input tokens instead of a smaller cache: the evaluated model scores each token of the user's text "
        "by its self-information (−log p given the tokens before it), the least informative are dropped down to "
        "the budget's share, and the shorter prompt is cached from position 0 (the chat template's head and, "
        "question-aware, the question are kept). Token by token, as LLMLingua's token-level step; its budget "
        "controller and iterative segments are not reproduced. The bytes (kv_fraction_bf16) fall with the tokens "
        "kept, so it sits on the accuracy-vs-bytes curves beside eviction. Accuracy with its Wilson 95% interval, "
        "the paired drop against the full cache in points, on prose the per-token KL along the true "
        "continuation; samples: distinct prompts.</p>"
        + verdict_list(verdicts(CLAIMS, q, rule))
        + table(c[[col for col in SHOWN if col in c]])
    )
