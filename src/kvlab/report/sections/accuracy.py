"""Accuracy against the KV bytes each method stored, the smallest safe budget per task, accuracy per task."""

import altair as alt
import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import svg, table

TITLE = "Accuracy vs KV bytes"
QUERIES = ("accuracy_bytes", "versus_full", "accuracy")


def chart(acc: pd.DataFrame) -> alt.TopLevelMixin:
    """Accuracy vs KV bytes stored (fraction of the full bf16 cache, log scale), one line per method
    (evicting methods across their budgets; quantized ones a point each), one panel per task shape and
    question mode; the full cache is the point at 1."""
    data = acc.assign(kv=acc["kv_fraction_bf16"].clip(lower=1e-3))
    return alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("kv:Q", title="KV bytes stored / full cache in bf16", scale=alt.Scale(type="log", domain=[0.02, 1])),
        y=alt.Y("accuracy:Q", title="accuracy", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("method:N", title="method", scale=alt.Scale(scheme="tableau20")), order="kv:Q",
        tooltip=["method", "budget", "accuracy", "kv_fraction_bf16", "rows"],
    ).properties(width=230, height=160).facet(
        row=alt.Row("shape:N", title=None), column=alt.Column("question_mode:N", title=None)
    )


def figure(q: dict[str, pd.DataFrame]) -> str:
    return svg(chart(q["accuracy_bytes"]))


def safe_budgets(versus: pd.DataFrame, rule: Rule) -> str:
    """One line per (model, task, context, question mode): for each method the smallest measured budget that
    stays within the rule's tolerance of the full cache."""
    rows = []
    for (model, task, ctx, mode), g in versus.groupby(["model", "task", "context_tokens", "question_mode"], sort=True):
        full = g["full_accuracy"].iloc[0]
        if full == 0:
            continue
        row = {"model": model, "task": task, "context": ctx, "question": mode, "full cache": f"{full:.0%}"}
        for method, m in g.groupby("method"):
            safe = m[m["delta_points"] >= -rule.tolerance_points]
            row[method] = f"{safe['budget'].min():g}" if len(safe) else "not safe"
        rows.append(row)
    return (
        f"<p>Each method's column gives the smallest fraction of the KV cache it kept while staying within "
        f"{rule.tolerance_points:g} accuracy point of the full cache on the same samples (1: a method that evicts "
        f"nothing; 'not safe': no measured budget did; tasks the full cache fails are left out).</p>"
        + table(pd.DataFrame(rows))
    )


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        figure(q)
        + "<p class='note'>x: bytes the method stored after compression over the full cache's bytes, both "
        "counted in bf16 (quantized codes and metadata as stored). Question agnostic: the context was compressed "
        "before the question was seen. Aware: the question was part of the compressed prompt (inside SnapKV's "
        "observation window). multi_turn: a later question on the cache compressed for the first.</p>"
        + "<h3>Smallest safe budget per task</h3>" + safe_budgets(q["versus_full"], rule)
        + "<h3>Accuracy per task, method and budget</h3>" + table(q["accuracy"])
    )
