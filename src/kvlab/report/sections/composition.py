"""Compositions (article §7): eviction then quantization of what is kept, and MiKV-style mixed precision (what
eviction would drop kept as low-bit codes), beside eviction alone and quantization alone, on one
accuracy-or-KL-against-compression curve per task shape."""

import altair as alt
import pandas as pd

from kvlab.report.decision import Rule, cells
from kvlab.report.html import svg, table

TITLE = "Compositions: eviction × quantization and mixed precision (article §7)"
QUERIES = ()
SHOWN = ["model", "shape", "question_mode", "route", "method", "budget", "compression", "accuracy", "accuracy_low",
         "accuracy_high", "drop_low", "drop_high", "kl_mean_nats", "kl_low", "kl_high", "decision", "samples"]


def route(r) -> str:
    if r["method_kind"] == "mikv":
        return "mixed precision (MiKV)"
    if r["method_kind"] == "quant":
        return "eviction, then quantization" if isinstance(r["press"], str) else "quantization"
    return "eviction"


def rows(answers: pd.DataFrame) -> pd.DataFrame:
    """The compositions (quant with a press, mikv) and, on the same models and tasks, plain SnapKV and the
    quantized caches without eviction."""
    a = answers
    composed = (a["method_kind"] == "mikv") | ((a["method_kind"] == "quant") & a["press"].notna())
    alone = (((a["method_kind"] == "kvpress") & (a["press"] == "SnapKVPress") & a["wrapper"].isna())
             | ((a["method_kind"] == "quant") & a["press"].isna()))
    tasks = a.loc[composed, ["model", "task"]].drop_duplicates()
    return a[composed | alone].merge(tasks, on=["model", "task"])


def chart(c: pd.DataFrame) -> alt.TopLevelMixin:
    """Accuracy (scored shapes) or mean KL (prose) against compression, one line per method, per shape."""
    c = c.assign(value=c["accuracy"].fillna(c["kl_mean_nats"]) if "kl_mean_nats" in c else c["accuracy"],
                 measure=["KL (nat)" if pd.isna(a) else "accuracy" for a in c.get("accuracy", [float("nan")] * len(c))])
    return alt.Chart(c).mark_line(point=True).encode(
        x=alt.X("compression:Q", scale=alt.Scale(type="log"), title="compression vs bf16 (measured bytes)"),
        y=alt.Y("value:Q", title="accuracy, or mean KL on prose"),
        color=alt.Color("route:N"), detail="method:N",
        tooltip=["method", "budget", "compression", "value", "decision", "samples"],
    ).properties(width=260, height=180).facet(facet=alt.Facet("shape:N"), columns=3).resolve_scale(y="independent")


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    r = rows(q["answers"])
    if r.empty:
        return "<p>No composed method (a quant method with a press, or kind mikv) was configured in this run.</p>"
    c = cells(r, rule, by=["model", "shape", "question_mode", "method_kind", "press"])
    c = c.assign(route=[route(x) for _, x in c.iterrows()], compression=1 / c["kv_fraction_bf16"])
    c = c.sort_values(["model", "shape", "question_mode", "route", "method", "budget"])
    return (
        "<p>Two ways to go past what eviction or quantization reaches alone. <b>Eviction, then quantization</b>: "
        "SnapKV keeps the budget's share and that share is stored as codes (snapkv_fp8: the article's 8×). "
        "<b>Mixed precision</b> (MiKV, Yang et al. 2024): the tokens SnapKV would keep stay in full precision and "
        "the ones it would evict stay too, as low-bit KIVI codes, so no token leaves the cache; its budget is the "
        "full-precision share. Compression is measured from the stored bytes against the full cache in bf16. A "
        "method sits on the curve of its route; a point left of another at the same accuracy reached it with "
        "fewer bytes. Accuracy with its Wilson 95% interval and the paired drop bounds, on prose the mean "
        "per-token KL with its betting bounds; decision as in the decision table; samples: distinct prompts.</p>"
        + svg(chart(c))
        + table(c[[col for col in SHOWN if col in c]])
    )
