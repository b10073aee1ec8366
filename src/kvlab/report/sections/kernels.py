"""The decode attention kernel over packed codes: device time and bandwidth per format and path (CUDA only)."""

import altair as alt
import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import svg, table

TITLE = "Decode attention kernel over packed codes"
QUERIES = ("decode_kernels",)


def charts(rows: pd.DataFrame) -> str:
    """Decode-attention time and bandwidth vs context, one line per format and path, one panel per batch."""
    data = rows.assign(variant=rows["format"] + " · " + rows["path"])
    base = alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("context_tokens:Q", title="context tokens", scale=alt.Scale(type="log", base=2)),
        color=alt.Color("variant:N", title="format · path"),
        tooltip=["variant", "context_tokens", "batch", "ms", "call_ms", "gb_per_s", "speedup_vs_sdpa"],
    ).properties(width=300, height=200)
    time = base.encode(y=alt.Y("ms:Q", title="ms per call on the device", scale=alt.Scale(type="log"))).facet(column=alt.Column("batch:O", title="batch"))
    bandwidth = base.encode(y=alt.Y("gb_per_s:Q", title="GB/s (bytes the path must read)")).facet(column=alt.Column("batch:O", title="batch"))
    return svg(time) + svg(bandwidth)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    rows = q["decode_kernels"]
    intro = (
        "<p>One decode step of one layer: a query token per sequence against a cache of N tokens with the model's "
        "head shape (or the configured one), timed on the device (median of repeated calls, each after a 256 MB "
        "write that evicts the cache from L2, so every path reads from device memory). <b>ms</b> is the device's "
        "time: the call replayed from a CUDA graph, with no Python or launch latency; <b>call_ms</b> is the call "
        "made from Python, which also pays the host's work where it outlasts the kernels. <b>sdpa</b>: torch's "
        "SDPA on the dense cache; <b>flash</b>: FlashAttention, when installed; <b>triton</b>: kvlab's kernel reading "
        "the packed codes (FP8 E4M3 from sm_89 on, KIVI INT4/INT2 with the configured group and residual) and "
        "dequantizing in registers; <b>dequantize</b>: the same codes rebuilt in full precision, then SDPA — what transformers' and "
        "kvpress's quantized caches do at every step. Bandwidth counts the bytes each path must read: the cache as "
        "stored (codes, scales, zero points, residual), the query and the output.</p>"
    )
    if rows.empty:
        return intro + ("<p><b>Not measured in this run</b>: the kernel benchmark runs when config.yaml sets "
                        "<code>device: cuda</code> (without a GPU, Triton only interprets its kernels) and "
                        "<code>speed_benchmarks</code> lists <code>decode_kernels</code> (it does by default).</p>")
    return intro + charts(rows) + table(rows)
