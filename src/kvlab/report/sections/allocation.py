"""Where the answers went: each decision cell's samples, the round that decided it, and the false-decision rate
across the table (e-BH over the job cells' e-values, kvlab.report.decision.annotate)."""

import altair as alt
import numpy as np
import pandas as pd

from kvlab.stats.anytime import ALPHA
from kvlab.report.decision import JOB, Rule, cells, job_cells, why_open
from kvlab.stats.intervals import lossless_samples, quiet_kl_samples
from kvlab.report.html import svg, table

TITLE = "Where the answers went: decisions and the samples they took"
QUERIES = ("answers",)
KEYS = ["model", "shape", "question_mode", "method", "budget"]


def scored_cells(rows: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """The cells of the decision table (scored answers and prose KL), each with `ebh`: whether e-BH over the whole
    table keeps its decision (kvlab.report.decision.kept: each job cell's two tests)."""
    if rows.empty:
        return pd.DataFrame()
    c = cells(rows, rule, by=["model", "shape", "question_mode"])
    c = c[c["decision"].isin(["safe", "unsafe", "inconclusive"])].reset_index(drop=True)
    c["ebh"] = c["decision"].isin(["safe", "unsafe"]) & (c["table_decision"] == c["decision"])
    return c


def chart(c: pd.DataFrame) -> alt.TopLevelMixin:
    """One bar per cell, its samples, coloured by its decision, longest first."""
    data = c.assign(cell=[f"{m} · {s} · {q} · {meth}@{b:g}" for m, s, q, meth, b in c[KEYS].itertuples(index=False)])
    data = data.sort_values(["samples", "cell"], ascending=[False, True])
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("cell:N", sort=list(data["cell"]), axis=alt.Axis(labels=False, ticks=False), title="cells, most samples first"),
        y=alt.Y("samples:Q", title="samples (distinct prompts) spent"),
        color=alt.Color("decision:N", scale=alt.Scale(domain=["safe", "unsafe", "inconclusive"],
                                                      range=["#2a9d5c", "#c0392b", "#999999"])),
        tooltip=["cell", "samples", "decision", "decided_at", *[k for k in ("drop_points", "drop_low", "drop_high",
                 "kl_mean_nats", "kl_low", "kl_high") if k in data]],
    ).properties(width=640, height=220)


def spent(c: pd.DataFrame) -> pd.DataFrame:
    """Per outcome: cells, samples spent in all, and the median samples per cell."""
    g = c.groupby("decision")["samples"]
    return pd.DataFrame({"cells": g.size(), "samples spent": g.sum(), "median per cell": g.median()}).reset_index()


def per_cell(c: pd.DataFrame) -> pd.DataFrame:
    out = c[[*KEYS, "samples", "cap", "decision", "decided_at", "decided_round",
             *[k for k in ("drop_points", "drop_low", "drop_high", "kl_mean_nats", "kl_low", "kl_high") if k in c],
             "e_safe", "e_unsafe", "ebh"]].copy()
    out["why open"] = [why_open(r) if r["decision"] == "inconclusive" else "" for _, r in c.iterrows()]
    return out.rename(columns={"cap": "max samples", "decided_at": "decided at sample", "decided_round": "in round",
                               "ebh": f"kept by e-BH at {ALPHA:.0%}"})


def pace(rows: pd.DataFrame) -> float:
    """A job's seconds per prompt in its last round (that round's wall seconds over its prompts), NaN unknown."""
    if "round_s" not in rows or rows["round_s"].isna().all():
        return float("nan")
    last = rows[rows["round"] == rows["round"].max()]
    return float(last["round_s"].max()) / last["sample_id"].nunique()


def left_by_time(rows: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """The job cells still open in jobs that sequential.stop_after_minutes stopped (rows' `stopped_by` 'time'): their
    n and bounds, why they are open, about how many more samples would decide them (n_to_decide, a low estimate) and
    what those would cost at their job's last round's pace (seconds per prompt, with every open variant of the job:
    an upper estimate for one cell)."""
    if "stopped_by" not in rows or not (rows["stopped_by"] == "time").any():
        return pd.DataFrame()
    timed = rows[rows["stopped_by"] == "time"]
    jc = job_cells(timed, rule, by=["model", "shape", "question_mode"])
    jc = jc[jc["decision"] == "inconclusive"].reset_index(drop=True)
    if jc.empty:
        return jc
    paces = {key: pace(g) for key, g in timed.groupby(["model", *JOB])}
    finite = np.isfinite(jc["n_to_decide"].astype(float))  # inf: no n decides it; nan: one sample is too few to say
    more = (jc["n_to_decide"] - jc["samples"]).clip(lower=1).where(finite)
    seconds = more * [paces[(m, t, c)] for m, t, c in jc[["model", *JOB]].itertuples(index=False)]
    out = jc[[*KEYS[:3], *JOB, *KEYS[3:], "samples",
              *[k for k in ("drop_points", "drop_low", "drop_high", "kl_mean_nats", "kl_low", "kl_high") if k in jc]]].copy()
    out["why open"] = [why_open(r) for _, r in jc.iterrows()]
    out["more samples"], out["about minutes more"] = more, seconds / 60
    return out


def time_note(rows: pd.DataFrame, rule: Rule) -> str:
    """What sequential.stop_after_minutes left open, or '' when no job stopped by time."""
    if "stopped_by" not in rows or not (rows["stopped_by"] == "time").any():
        return ""
    left = left_by_time(rows, rule)
    jobs = rows[rows["stopped_by"] == "time"].drop_duplicates(["model", *JOB])
    names = ", ".join(f"{t} @ {c:,}" for t, c in jobs[JOB].itertuples(index=False))
    head = (f"<h3>Left open by the time limit</h3><p>{len(jobs)} job(s) stopped adding rounds when their share of "
            f"<code>sequential.stop_after_minutes</code> was spent ({names}). Their decided cells stand: the bounds "
            f"are valid at any stopping time, by time or otherwise (kvlab.stats.anytime). ")
    if left.empty:
        return head + "No cell of theirs was left open.</p>"
    return (head + f"{len(left)} job cell(s) stayed open; 'more samples' is about how many more samples like their "
            "own would decide each (a low estimate), 'about minutes more' what those would take at the job's last "
            "round's pace (with all its open variants: an upper estimate for one cell). A longer limit, or none, "
            "continues them. Where a job stops by time depends on the machine's speed, so such runs can differ "
            "between machines; runs without a limit stay identical.</p>" + table(left))


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    c = scored_cells(q["answers"], rule)
    if c.empty:
        return "<p>No scored cell in this run.</p>"
    decided = c[c["decision"] != "inconclusive"]
    kept = int(c["ebh"].sum())
    lossless, stop = lossless_samples(rule.tolerance_points), lossless_samples(rule.tolerance_points, rule.stop_e)
    quiet = quiet_kl_samples(rule.kl_safe, rule.kl_cap_ratio, rule.kl_tail_share)
    return (
        f"<p>Each evaluation job runs in rounds (config <code>sequential</code>, src/kvlab/state/sequential.py): its task's "
        f"first samples on every method, then a few prompts at a time on the full cache and on the methods with a cell "
        f"still open, until none is or the job reaches <code>max_samples</code>. Cells that fail fast stop early, "
        f"and the prompts go to the cells that look lossless, the only ones that can be called safe. The bounds behind "
        f"every decision are betting confidence sequences over samples in draw order (kvlab.stats.anytime): at each cell's "
        f"threshold, the chance of calling a method safe whose true drop is at least {rule.tolerance_points:g} points, or "
        f"unsafe when it is below that, is at most {ALPHA:.0%} at every n at once, so the rule that stopped the job "
        f"cannot bias them. A cell that loses no answer is decided safe after {lossless} samples. Prose cells are decided "
        f"the same way on their per-sample KL against {rule.kl_safe:g} nat, each sample capped at "
        f"{rule.kl_cap_ratio:g} × the threshold, and with at most {rule.kl_tail_share:.0%} of samples above the cap; a "
        f"KL near 0 is safe after {quiet} samples. A decided cell stays open until the e-value of its decision reaches "
        f"1/({ALPHA:g} × {rule.planned_share:g}) = {rule.stop_e:.3g} (config <code>decision.planned_share</code>): a "
        f"lossless cell then runs to {stop} samples.</p>"
        f"<p><b>Across the table:</b> {len(decided)} of {len(c)} scored cells are decided per cell "
        f"({int((c['decision'] == 'safe').sum())} safe, {int((c['decision'] == 'unsafe').sum())} unsafe). Two "
        f"guarantees: <b>each cell's own decision</b> is wrong with chance at most {ALPHA:.0%}; <b>the table's "
        f"decisions</b>, those that e-BH (Wang &amp; Ramdas 2022) over every job cell's e-values keeps, contain wrong "
        f"ones at an expected share of at most {ALPHA:.0%}, whatever the dependence between cells (a method whose drop "
        f"equals the tolerance counts as unsafe). e-BH keeps {kept} of the {len(decided)} decisions; the decision "
        f"table, the grid and the summary print those, and the column 'kept by e-BH' marks them.</p>"
        + svg(chart(c)) + table(spent(c))
        + "<h3>Every scored cell</h3><p class='note'>samples: distinct prompts (a sample's turns averaged); max samples: "
        "what its jobs could reach; decided at sample: the sample (in draw order) at which its bound first decided it, "
        "and the evaluation round that sample ran in; e_safe, e_unsafe: the e-values of its two tests at its last "
        f"sample (a cell's own decision needed {1 / ALPHA:g} at some sample); why open: it reached max_samples, or about how many more "
        "samples like its own would decide it.</p>"
        + table(per_cell(c))
        + time_note(q["answers"], rule)
    )
