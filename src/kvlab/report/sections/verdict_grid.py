"""The decision table as a picture, for the first screen: task shape (and question mode) × method, each cell
coloured by the decision table's outcome for the method (kvlab.report.decision.outcomes) and holding the
compression it reached and n."""

import altair as alt
import pandas as pd

from kvlab.report.decision import OUTCOMES, Rule, outcomes
from kvlab.report.html import svg

TITLE = "The answer at a glance: which method is safe on which task"
QUERIES = ("answers",)
COLOURS = dict(zip(OUTCOMES, ("#1a9850", "#d73027", "#fee08b", "#e0e0e0")))
MARKS = dict(zip(OUTCOMES, ("✓", "✗", "?", "–")))  # the outcome without its colour (grey print, colour blindness)
INK = dict(zip(OUTCOMES, ("white", "white", "#222", "#222")))


def chart(grid: pd.DataFrame) -> alt.TopLevelMixin:
    """One rect per row of `outcomes`, coloured by its outcome, labelled with its mark, compression and n, and on
    prose its documents above the KL cap ('3 > cap'; the tooltip gives the tail in words); one panel per model."""
    data = grid.assign(
        row=grid["shape"] + " · " + grid["question_mode"],
        label=[f"{MARKS[o]} {c:.1f}×\nn={n}" + ("" if pd.isna(k) else f"\n{k:.0f} > cap")
               for o, c, n, k in zip(grid["outcome"], grid["compression"], grid["samples"], grid["over_cap"])],
        ink=grid["outcome"].map(INK),
    )
    x = alt.X("method:N", title=None, sort="ascending", axis=alt.Axis(orient="top", labelAngle=-35))
    y = alt.Y("row:N", title="task shape · question mode", sort="ascending")
    domain = list(OUTCOMES)
    rect = alt.Chart().mark_rect(stroke="white", strokeWidth=2).encode(
        x=x, y=y, color=alt.Color("outcome:N", title="outcome", legend=alt.Legend(orient="bottom"),
                                  scale=alt.Scale(domain=domain, range=[COLOURS[o] for o in domain])),
        tooltip=["model", "shape", "question_mode", "method", "shown", "budget", "compression", "samples"],
    )
    text = alt.Chart().mark_text(fontSize=10, lineBreak="\n").encode(
        x=x, y=y, text="label:N", color=alt.Color("ink:N", scale=None),
    )
    return alt.layer(rect, text, data=data).properties(width=alt.Step(62), height=alt.Step(40)).facet(
        row=alt.Row("model:N", title=None)
    )


def figure(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return svg(chart(outcomes(q["answers"], rule)))


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    if q["answers"].empty:
        return "<p>No compressed method was evaluated in this run.</p>"
    return "<div class='wide'>" + figure(q, rule) + "</div>" + (  # one column per method: wider than the page with many
        f"<p class='note'>Each cell: one method on one task shape and question mode, decided by the decision "
        f"table's rule (below), with the compression it reached (the full cache's bf16 bytes over the bytes it "
        f"stored, measured) and n, the samples behind the decision. <b>Safe</b> (green, ✓): the one-sided 95% upper "
        f"bound of its accuracy drop vs the full cache on the same samples is at most {rule.tolerance_points:g} "
        f"points (on prose: of its capped mean KL, {rule.kl_safe:g} nat, with the share of documents above the cap of "
        f"{rule.kl_cap_ratio * rule.kl_safe:g} nat at most {rule.kl_tail_share:.0%}), shown at its most compressed safe "
        f"budget. A prose cell says how many of its documents went above the cap ('3 > cap'): one with any is safe "
        f"on average only, and the decision table names them. "
        f"<b>Unsafe</b> (red, ✗): the lower bound exceeds it at every budget (shown at the least compressed). "
        f"<b>Inconclusive</b> (yellow, ?): the data cannot decide — the interval straddles the tolerance (shown at "
        f"the most compressed undecided budget). Not judged (grey, –): the full cache itself scores 0%. Blank: the "
        f"method did not run on that shape. The article asks for ≥ {rule.target:g}×.</p>"
    )
