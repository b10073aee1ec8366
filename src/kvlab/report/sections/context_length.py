"""Accuracy against context length: one curve per method and budget for each task shape measured at more than
one length, the full cache's beside them, with Wilson intervals; every (shape, length) cell decided by the decision
table's rule, beside the article's statements about length; and what each length cost: seconds per sample and peak
memory per job."""

import altair as alt
import pandas as pd

from kvlab.report.decision import Rule, cells, measured_on
from kvlab.report.html import svg, table
from kvlab.report.tables import with_wilson

TITLE = "Accuracy vs context length"
QUERIES = ("answers", "length_costs")
# The article's statements about length that these curves test (the claims section decides C5 on the default grid).
ARTICLE = ("INT4 (KIVI) stays within 1 point of the full cache up to 32K (C5); quantization error accumulates over long "
           "sequences (§2.3); eviction (SnapKV, PyramidKV, StreamingLLM) loses needles as the context grows while the "
           "share it keeps stays the same.")
KEYS = ["model", "shape", "generator", "question_mode", "context_tokens"]
SHOWN = ["model", "shape", "generator", "question_mode", "context_tokens", "method", "budget", "samples", "accuracy", "accuracy_low",
         "accuracy_high", "full_accuracy", "full_low", "full_high", "drop_points", "drop_low", "drop_high", "decision", "n_to_decide"]


def with_generator(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows with `generator`: RULER's or kvlab's own, so a curve never joins two generators' prompts."""
    ruler = rows["task_kind"].eq("ruler") if "task_kind" in rows else pd.Series(False, index=rows.index)
    return rows.assign(generator=ruler.map({True: "RULER", False: "kvlab"}))


def curves(rows: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per (model, shape, question mode, context length, method @ budget), the full cache's as method
    'full' (each of its answers once), with Wilson 95% intervals over the answers."""
    rows = with_generator(rows)
    full = rows.drop_duplicates([*KEYS, "sample_id", "turn"]).assign(variant="full", score=lambda d: d["full_score"])
    every = pd.concat([rows.assign(variant=[m if b >= 1 else f"{m}@{b:g}" for m, b in zip(rows["method"], rows["budget"])]),
                       full], ignore_index=True)
    out = every.groupby([*KEYS, "variant"], sort=True).agg(accuracy=("score", "mean"), answers=("score", "size")).reset_index()
    return with_wilson(out, count="answers")


def chart(points: pd.DataFrame) -> alt.TopLevelMixin:
    x = alt.X("context_tokens:Q", title="context (tokens)", scale=alt.Scale(type="log", base=2))
    color = alt.Color("variant:N", title="method", scale=alt.Scale(scheme="tableau20"))
    line = alt.Chart().mark_line(point=True).encode(
        x=x, y=alt.Y("accuracy:Q", title="accuracy", scale=alt.Scale(domain=[0, 1])), color=color,
        tooltip=["variant", "context_tokens", "accuracy", "accuracy_low", "accuracy_high", "answers"],
    )
    bars = alt.Chart().mark_rule(opacity=0.6).encode(x=x, y="accuracy_low:Q", y2="accuracy_high:Q", color=color)
    points = points.assign(panel=points["shape"] + " (" + points["generator"] + ")")
    return alt.layer(line, bars, data=points).properties(width=230, height=160).facet(
        row=alt.Row("panel:N", title=None), column=alt.Column("question_mode:N", title=None)
    )


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    rows = q["answers"]
    rows = with_generator(rows[rows["score"].notna()])
    lengths = rows.groupby(["shape", "generator"])["context_tokens"].nunique()
    several = lengths[lengths > 1].index
    if rows.empty or several.empty:
        where = "; ".join(f"{shape}: {measured_on(g)}" for shape, g in rows.groupby("shape", sort=True))
        return (f"<p>This run measured each task shape at one context length ({where or 'no scored task'}). Give a "
                f"task several <code>context_tokens</code> to draw accuracy against length.</p>")
    rows = rows[rows.set_index(["shape", "generator"]).index.isin(several)]
    every = cells(rows, rule, by=KEYS)
    return (
        svg(chart(curves(rows)))
        + "<p class='note'>One line per method and budget (method@budget: the share of the context kept), the full "
        "cache's as 'full'; bars: Wilson 95% intervals over the answers. One panel per shape and generator (kvlab's "
        "own tasks or RULER's), so a curve never joins two generators' prompts; shapes measured at one length only "
        "are left out. kvlab's own generators seed each length apart (its needles, values and haystack are drawn anew), so "
        "its points at different lengths are independent samples; RULER's generators use RULER's seed at every "
        "length.</p>"
        + "<h3>Per length, decided</h3><p class='note'>The decision table's rule per (shape, question mode, length): "
        "the drop vs the full cache on the same prompts with its one-sided 95% bounds (the betting confidence "
        f"sequence over samples, valid under the jobs' early stopping) against {rule.tolerance_points:g} points.</p>"
        + table(every[[c for c in SHOWN if c in every]])
        + f"<p class='note'>The article's statements: {ARTICLE} A statement holds at a length where its method is decided "
        "safe there, fails where it is decided unsafe, and is untested where the cell is inconclusive.</p>"
        + costs(q.get("length_costs", pd.DataFrame()), rows)
    )


def costs(jobs: pd.DataFrame, rows: pd.DataFrame) -> str:
    """What each length cost: per evaluation job of the shapes drawn above, its samples, seconds per sample, peak RSS
    (Snakemake's benchmark file: the whole job, model included), the most waves a sample ran in under the job's
    memory budget, the dtype and CPU it ran on."""
    if jobs.empty:
        return ""
    jobs = jobs[jobs["task"].isin(rows["task"].unique())]
    skipped = jobs.dropna(subset=["dtype_floor_skipped"]) if "dtype_floor_skipped" in jobs else jobs.iloc[:0]
    note = (" The dtype floor was skipped in " + "; ".join(f"{t} at {c}: {w}" for t, c, w in zip(
        skipped["task"], skipped["context_tokens"], skipped["dtype_floor_skipped"])) + "." if len(skipped) else "")
    return ("<h3>What each length cost</h3><p class='note'>Per evaluation job: seconds per sample (its wall time over "
            "its samples, every method and question mode together) and its peak memory (peak RSS of the whole job, "
            "model included; empty where the job has no benchmark file), with the dtype and CPU it ran on. A sample's "
            f"variants ran in as many waves as its memory budget needed (kvlab.state.memory).{note}</p>" + table(jobs))
