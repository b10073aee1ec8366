"""Power per decision cell: its n, its distinct prompts (a repeated prompt is flagged), the smallest accuracy
drop it can detect and the samples the article's 1-point statement would need at its observed spread."""

import pandas as pd

from kvlab.report.claims import BY_NUMBER
from kvlab.report.decision import NO_REFERENCE, Rule, cells
from kvlab.report.html import esc, table
from kvlab.stats.intervals import LEVEL, Z, detectable, drop_bounds, lossless_samples, per_sample

TITLE = "Power: what each cell can detect"
QUERIES = ("answers",)
KEYS = ["model", "shape", "question_mode", "method", "budget"]
POINTS = BY_NUMBER[5].thresholds["points"]  # C5 "INT4 within 1 point": the article's finest statement, in points


def prompts(rows: pd.DataFrame) -> pd.DataFrame:
    """Per cell (KEYS): its distinct prompts (prompt_sha1: every token id the prompt feeds)."""
    if rows["prompt_sha1"].isna().any():
        tasks = ", ".join(sorted(rows.loc[rows["prompt_sha1"].isna(), "task"].unique()))
        raise ValueError(f"eval rows without prompt_sha1 (tasks {tasks}: evaluated by an older kvlab); rerun "
                         f"them: snakemake --forcerun evaluate")
    return rows.groupby(KEYS, sort=False, dropna=False).agg(prompts=("prompt_sha1", "nunique")).reset_index()


def power_table(rows: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """Per cell: n, distinct prompts and whether some repeat, the decision with its drop (or KL) and bounds, the
    per-sample spread, the smallest drop n samples tell from 0 at one-sided 95% (normal approximation) and the
    samples in all that the betting bound would take to decide the cell at POINTS if its samples went on alike
    (kvlab.stats.anytime; prose cells, decided on KL: blank)."""
    c = cells(rows, rule, by=["model", "shape", "question_mode"]).merge(prompts(rows), on=KEYS, validate="1:1")
    scored = c["drop_points"].notna() if "drop_points" in c else pd.Series(False, index=c.index)
    sd = c["sample_sd"].where(scored)
    c["repeated prompts"] = [f"yes: {n - p} of {n} samples repeat one" if p < n else "" for n, p in
                             zip(c["samples"], c["prompts"])]
    c["detectable_drop_points"] = [detectable(s, n) if ok else float("nan") for s, n, ok in zip(sd, c["samples"], scored)]
    need = {}
    for key, g in rows[rows["kl_vs_full"].isna()].groupby(KEYS, sort=False, dropna=False):
        s = per_sample(g, ["full_score", "score"])
        need[key] = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), POINTS).n_to_decide(POINTS)
    c[f"samples_for_±{POINTS:g}_point"] = [need.get(tuple(r), float("nan")) if ok else float("nan")
                                           for r, ok in zip(c[KEYS].itertuples(index=False), scored)]
    c["sd_points"] = sd
    shown = [*KEYS, "samples", "prompts", "repeated prompts", "decision", "drop_points", "drop_low", "drop_high",
             "kl_mean_nats", "kl_low", "kl_high", "sd_points", "detectable_drop_points", f"samples_for_±{POINTS:g}_point"]
    return c[[k for k in shown if k in c]]


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    rows = q["answers"]
    if rows.empty:
        return "<p>No compressed method was evaluated in this run.</p>"
    t = power_table(rows, rule)
    judged = t["decision"] != NO_REFERENCE  # a cell whose full cache scores 0% shows no drop to detect
    need = t.loc[judged, f"samples_for_±{POINTS:g}_point"].dropna()
    repeats = int((t["repeated prompts"] != "").sum())
    level = f"{LEVEL:.0%}"
    need = need[need < float("inf")]
    needed = (f"If their samples went on alike, the cells would need {need.min():,.0f} to {need.max():,.0f} samples "
              f"(median {need.median():,.0f}) for the decision's bound to settle the article's {POINTS:g}-point "
              f"statement (claim C5, INT4 within {POINTS:g} point) either way (a cell that loses no answer: {lossless_samples(POINTS):,}); this "
              f"run has {t.loc[need.index, 'samples'].min():,} to "
              f"{t.loc[need.index, 'samples'].max():,} per cell (cells the rule judges).") if len(need) else (
        "No cell the rule judges has answers to score.")
    flag = (f"<b>{repeats} cell(s) repeat a prompt</b>: their samples are not all independent, and n overstates "
            f"what they show." if repeats else
            "No cell repeats a prompt: every sample of a cell is its own prompt. kvlab's generators draw each sample "
            "of a task at one length again until it shares no prompt, needle or stretch of prose with an earlier one; "
            "RULER's samples are as RULER's seed draws them.")
    return (
        f"<p>Per decision cell (model, task shape, question mode, method, budget): n, the samples the decision "
        f"resamples; prompts, the distinct prompts among them (a SHA-1 of every token id the prompt feeds: "
        f"document, needle, question, later turns); detectable drop, the smallest mean accuracy drop in points the "
        f"cell tells from 0 at one-sided {level} — z·sd/√n, the normal approximation for a paired mean difference "
        f"(a guide: the decision's own bound is a betting confidence sequence, a little wider), with z = {Z:.3f} "
        f"(scipy.stats.norm.ppf({LEVEL:g})) and sd the per-sample spread of the drop. A true drop of that size is "
        f"detected half the time. samples_for_±{POINTS:g}_point: the samples in all that the decision's betting bound, "
        f"tuned to {POINTS:g} point, would take to decide the cell there if its samples went on alike (at the best "
        f"constant stake: a low estimate; blank where none would). Prose cells are decided on KL (their bounds shown) "
        f"and have no accuracy drop.</p>"
        f"<p>{esc(needed)}</p><p>{flag}</p>" + table(t)
    )
