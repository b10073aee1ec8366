"""Calibration: C1 and C2, and what the cache and attention look like (channel magnitude, massive
activations, token-0 attention, concentration by layer)."""

import altair as alt
import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule
from kvlab.report.html import svg, table, verdict_list

TITLE = "Calibration: what the cache and attention look like"
QUERIES = ("calib_c1", "calib_c2")
CLAIMS = [1, 2]


def charts(q: dict[str, pd.DataFrame]) -> str:
    """Heatmaps of channel magnitude, massive activations, token-0 attention and concentration by layer."""
    channels = alt.Chart(q["calib_channels"]).mark_rect().encode(
        x=alt.X("channel:O", title="KV head × channel", axis=None),
        y=alt.Y("layer:O", title="layer"),
        color=alt.Color("absmax:Q", scale=alt.Scale(type="log", scheme="viridis"), title="|x| max"),
    ).properties(width=220, height=160).facet(
        row=alt.Row("model:N", title=None), column=alt.Column("tensor:N", title=None, sort=["key_pre_rope", "key_post_rope", "value"])
    ).resolve_scale(x="independent", y="independent")
    massive = alt.Chart(q["calib_massive"]).mark_line(point=True).encode(
        x=alt.X("layer:Q"), y=alt.Y("max_abs:Q", scale=alt.Scale(type="log"), title="largest |hidden| entering the layer"),
        color=alt.Color("position_class:N", title="positions"), tooltip=["layer", "position_class", "max_abs", "token", "channel"],
    ).properties(width=300, height=180).facet(column=alt.Column("model:N", title=None)).resolve_scale(x="independent")
    sinks = alt.Chart(q["calib_sinks"]).mark_rect().encode(
        x=alt.X("head:O", title="query head"), y=alt.Y("layer:O"),
        color=alt.Color("token0_mass:Q", scale=alt.Scale(domain=[0, 1], scheme="orangered"), title="mass on token 0"),
    ).properties(width=200, height=180).facet(column=alt.Column("model:N", title=None)).resolve_scale(x="independent", y="independent")
    conc = alt.Chart(q["calib_concentration"]).transform_fold(
        ["token0_mass", "keys90_fraction"], as_=["measure", "value"]
    ).mark_line(point=True).encode(
        x="layer:Q", y=alt.Y("value:Q", title="fraction", scale=alt.Scale(domain=[0, 1])), color=alt.Color("measure:N", title=None),
    ).properties(width=300, height=180).facet(column=alt.Column("model:N", title=None)).resolve_scale(x="independent")
    return (
        "<h3>Channel magnitude: keys before and after RoPE, values</h3>" + svg(channels)
        + "<h3>Massive activations: the residual stream entering each layer</h3>" + svg(massive)
        + "<h3>Attention on token 0, by layer and query head</h3>" + svg(sinks)
        + "<h3>Attention concentration by layer</h3>"
        + "<p class='note'>keys90_fraction: share of the visible keys that hold 90% of a query's attention "
        "(mean over heads, query positions and sequences); token0_mass: attention on token 0.</p>" + svg(conc)
    )


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        "<p>Each model read prose the tasks never use (the last tenth of the King James Bible); one forward "
        "pass per sequence, attention weights computed for a subset of query positions.</p>"
        + verdict_list(verdicts(CLAIMS, q, rule)) + charts(q)
        + "<h3>Secondary sinks</h3><p class='note'>Positions other than token 0 that take at least the sink "
        "threshold of a layer's attention in some sequence (no rows: none found).</p>"
        + table(q["calib_secondary_sinks"])
        + "<h3>Handed to later stages</h3>" + table(q["calib_fed_forward"])
    )
