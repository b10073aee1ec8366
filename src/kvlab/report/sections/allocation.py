"""Where the answers went: each decision cell's samples, the round that decided it, and the false-decision rate
across the table (e-BH over the cells' e-values)."""

import altair as alt
import numpy as np
import pandas as pd

from kvlab.anytime import ALPHA, ebh
from kvlab.report.decision import Rule, cells, why_open
from kvlab.report.html import svg, table

TITLE = "Where the answers went: decisions and the samples they took"
QUERIES = ("answers",)
KEYS = ["model", "shape", "question_mode", "method", "budget"]


def scored_cells(rows: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """The cells of the decision table (scored answers and prose KL), each with `ebh`: whether its decision survives
    e-BH at ALPHA over every cell's two tests (safe and unsafe; a KL cell with a sample above its cap has no safe
    test: e-value 1)."""
    if rows.empty:
        return pd.DataFrame()
    c = cells(rows, rule, by=["model", "shape", "question_mode"])
    c = c[c["decision"].isin(["safe", "unsafe", "inconclusive"])].reset_index(drop=True)
    kept = ebh(np.nan_to_num(np.r_[c["e_safe"].to_numpy(), c["e_unsafe"].to_numpy()], nan=1.0), ALPHA)
    safe, unsafe = kept[: len(c)], kept[len(c):]
    c["ebh"] = np.where(c["decision"] == "safe", safe, np.where(c["decision"] == "unsafe", unsafe, False))
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


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    c = scored_cells(q["answers"], rule)
    if c.empty:
        return "<p>No scored cell in this run.</p>"
    decided = c[c["decision"] != "inconclusive"]
    kept = int(c["ebh"].sum())
    return (
        f"<p>Each evaluation job runs in rounds (config <code>sequential</code>, src/kvlab/sequential.py): its task's "
        f"first samples on every method, then a few prompts at a time on the full cache and on the methods with a cell "
        f"still undecided, until none is or the job reaches <code>max_samples</code>. Cells that fail fast stop early, "
        f"and the prompts go to the cells that look lossless, the only ones that can be called safe. The bounds behind "
        f"every decision are betting confidence sequences over samples in draw order (kvlab.anytime): at each cell's "
        f"threshold, the chance of calling a method safe whose true drop is at least {rule.tolerance_points:g} points, or "
        f"unsafe when it is at most that, is at most {ALPHA:.0%} at every n at once, so the rule that stopped the job "
        f"cannot bias them. A cell that loses no answer is decided safe after 63 samples. Prose cells are decided the "
        f"same way on their per-sample KL against {rule.kl_safe:g} nat, a range assumed: each sample's KL at most "
        f"{rule.kl_cap_ratio:g} × the threshold (a cell with one above it is never called safe); a KL near 0 is safe "
        f"after 15 samples.</p>"
        f"<p><b>Across the table:</b> {len(decided)} of {len(c)} scored cells are decided "
        f"({int((c['decision'] == 'safe').sum())} safe, {int((c['decision'] == 'unsafe').sum())} unsafe). Each decision "
        f"holds its own {ALPHA:.0%} level; taken together, if every one of them were a true null, chance alone would "
        f"make about {ALPHA * len(decided):.1f} of them wrong. e-BH (Wang &amp; Ramdas 2022) over the cells' e-values "
        f"(each cell's safe and unsafe test, {2 * len(c)} in all) keeps {kept} of the {len(decided)} decisions with the "
        f"expected share of wrong ones among them at most {ALPHA:.0%}, whatever the dependence between cells; the column "
        f"'kept by e-BH' marks them.</p>"
        + svg(chart(c)) + table(spent(c))
        + "<h3>Every scored cell</h3><p class='note'>samples: distinct prompts (a sample's turns averaged); max samples: "
        "what its jobs could reach; decided at sample: the sample (in draw order) at which its bound first decided it, "
        "and the evaluation round that sample ran in; e_safe, e_unsafe: the e-values of its two tests at its last "
        f"sample (a decision needed {1 / ALPHA:g} at some sample); why open: it reached max_samples, or about how many more "
        "samples like its own would decide it.</p>"
        + table(per_cell(c))
    )
