"""Decode throughput after each method's compression, by context length, batch and device."""

import altair as alt
import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import svg, table

TITLE = "Decode throughput"
QUERIES = ("throughput",)


def chart(speed: pd.DataFrame) -> alt.TopLevelMixin:
    """Decode tokens/s vs context length, one line per method at each budget, one panel per device and batch."""
    data = speed.assign(variant=speed["method"] + speed["budget"].map(lambda b: f"@{b:g}" if b < 1 else ""))
    return alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("context_tokens:Q", title="context tokens", scale=alt.Scale(type="log", base=2)),
        y=alt.Y("tokens_per_s:Q", title="decode tokens / s (all sequences)"),
        color=alt.Color("variant:N", title="method"),
        tooltip=["variant", "context_tokens", "batch", "tokens_per_s", "kv_bytes"],
    ).properties(width=420, height=240).facet(column=alt.Column("device:N", title="device"), row=alt.Row("batch:O", title="batch"))


NOT_RUN = ("<p><b>Not run</b>: this run's <code>speed_benchmarks</code> leaves out <code>{job}</code> (a run of only "
           "its evaluation jobs); list it there to measure it.</p>")


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    if q["throughput"].empty:
        return NOT_RUN.format(job="throughput")
    return (
        "<p>Greedy decoding after each method's compression (EOS ignored, so every method decodes "
        "the same number of steps), labelled with the device it ran on; a batch is that many copies of the "
        "compressed cache decoded together (<code>throughput.batches</code>), and tokens/s counts them all. "
        "On CUDA, <code>graph_tokens_per_s</code> times one decode step captured in a CUDA graph and replayed "
        "(every kernel launch and Python call taken out, as serving engines decode): what the device itself "
        "spends per step, where a small model's eager decoding is bound by the host. "
        "On a CPU with a small model, reading the weights dominates each step; "
        "fewer cached tokens matter more at long contexts, large batches and on accelerators. <code>decode_path</code> says how "
        "each quantized cache was read: <b>triton codes</b> (on CUDA, kvlab's kernel attends to the packed codes "
        "directly, see the next section) or <b>dequantize</b> (codes rebuilt in full precision at every step, "
        "as transformers' quantized caches do; the CPU path), which decodes slower than the full cache.</p>"
        + (svg(chart(q["throughput"])) if not q["throughput"].empty else "") + table(q["throughput"])
    )
