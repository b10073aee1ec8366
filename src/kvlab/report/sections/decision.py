"""The article's decision table (§7.2) regenerated, and each of its testable statements against this run."""

import pandas as pd

from kvlab.report.decision import Rule, article_comparison, decision_table
from kvlab.report.html import table

TITLE = "Decision table (article §7.2), regenerated"
QUERIES = ("decision",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    dec = q["decision"]
    if dec.empty:
        return "<p>No compressed method was evaluated in this run.</p>"
    return (
        f"<p><b>Rule:</b> a method is safe at a budget when its accuracy is within {rule.tolerance_points:g} point of the "
        f"full cache on the same answers (turns and tasks of a shape pooled), or, on prose with no answers to score, "
        f"when its per-token KL to the full cache is at most {rule.kl_safe:g} nat. Each safe method appears once, at its "
        f"most compressed safe budget, with the compression it reached (bytes stored vs the full cache in bf16, "
        f"measured). The article's question — 40 GB → 10 GB — asks for ≥ {rule.target:g}×.</p>"
        + table(decision_table(dec, rule))
        + "<h3>Against the article's decision table</h3><p class='note'>Each recommendation of the article's "
        "table that this run can test, on the task shape that stands for its workload. Methods are recognized by "
        "what they store (INT4: 4-bit KIVI without eviction; FP8 + SnapKV 25%: FP8 storage of SnapKV's 25%), not by "
        "name. A 'safe' statement agrees when some such method is safe; a 'not safe' statement when none is.</p>"
        + table(article_comparison(dec, rule))
    )
