"""Accuracy against the KV bytes each method stored, the smallest safe budget per task, accuracy per task."""

import altair as alt
import pandas as pd

from kvlab.report.decision import Rule, cells
from kvlab.report.html import svg, table
from kvlab.report.tables import with_wilson

TITLE = "Accuracy vs KV bytes"
QUERIES = ("accuracy_bytes", "versus_full", "accuracy")


def chart(acc: pd.DataFrame) -> alt.TopLevelMixin:
    """Accuracy vs KV bytes stored (fraction of the full bf16 cache, log scale), one line per method
    (evicting methods across their budgets; quantized ones a point each) with each point's Wilson 95% interval
    as a bar, one panel per task shape and question mode; the full cache is the point at 1."""
    data = with_wilson(acc).assign(kv=acc["kv_fraction_bf16"].clip(lower=1e-3))
    x = alt.X("kv:Q", title="KV bytes stored / full cache in bf16", scale=alt.Scale(type="log", domain=[0.02, 1]))
    color = alt.Color("method:N", title="method", scale=alt.Scale(scheme="tableau20"))
    line = alt.Chart().mark_line(point=True).encode(
        x=x, y=alt.Y("accuracy:Q", title="accuracy", scale=alt.Scale(domain=[0, 1])), color=color, order="kv:Q",
        tooltip=["method", "budget", "accuracy", "accuracy_low", "accuracy_high", "kv_fraction_bf16", "rows"],
    )
    bars = alt.Chart().mark_rule(opacity=0.6).encode(x=x, y="accuracy_low:Q", y2="accuracy_high:Q", color=color)
    return alt.layer(line, bars, data=data).properties(width=230, height=160).facet(
        row=alt.Row("shape:N", title=None), column=alt.Column("question_mode:N", title=None)
    )


def figure(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return svg(chart(q["accuracy_bytes"]))


def safe_budgets(versus: pd.DataFrame, rule: Rule) -> str:
    """One line per (model, task, context, question mode): for each method the smallest measured budget decided
    safe by the rule, else whether some budget was inconclusive."""
    rows = []
    every = cells(versus, rule, by=["model", "task", "context_tokens", "question_mode"])
    for (model, task, ctx, mode), g in every.groupby(["model", "task", "context_tokens", "question_mode"], sort=True):
        full = g["full_accuracy"].iloc[0]
        if full == 0:
            continue
        row = {"model": model, "task": task, "context": ctx, "question": mode, "full cache": f"{full:.0%}",
               "samples": g["samples"].max()}
        for method, m in g.groupby("method"):
            safe = m[m["decision"] == "safe"]
            row[method] = (f"{safe['budget'].min():g}" if len(safe)
                           else "inconclusive" if (m["decision"] == "inconclusive").any() else "not safe")
        rows.append(row)
    if not rows:
        scored = every[["model", "task", "context_tokens", "question_mode"]].drop_duplicates()
        return ("<p><b>No row</b>: " + (
            f"the full cache itself answered no prompt correctly in any of the {len(scored)} scored cells (task, context "
            "length, question mode), so no budget can be decided safe against it (a random model, such as the smoke "
            "preset's, answers nothing).</p>" if len(scored) else "no task of this run is scored by its answers.</p>"))
    return (
        f"<p>Each method's column gives the smallest fraction of the KV cache it kept while decided safe — the "
        f"one-sided 95% upper bound of its drop vs the full cache on the same samples at most "
        f"{rule.tolerance_points:g} points (1: a method that evicts nothing; 'inconclusive': no budget decided safe, "
        f"some undecided at this n; 'not safe': every budget decided unsafe; tasks the full cache fails are left "
        f"out).</p>" + table(pd.DataFrame(rows))
    )


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        figure(q, rule)
        + "<p class='note'>x: bytes the method stored after compression over the full cache's bytes, both "
        "counted in bf16 (quantized codes and metadata as stored). Question agnostic: the context was compressed "
        "before the question was seen. Aware: the question was part of the compressed prompt (inside SnapKV's "
        "observation window). multi_turn: a later question on the cache compressed for the first.</p>"
        + "<h3>Smallest safe budget per task</h3>" + safe_budgets(q["versus_full"], rule)
        + "<h3>Accuracy per task, method and budget</h3><p class='note'>With the Wilson 95% interval over the "
        "answers.</p>" + table(with_wilson(q["accuracy"], count="samples"))
    )
