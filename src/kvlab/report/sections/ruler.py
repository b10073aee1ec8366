"""RULER's tasks laid out as kvpress's leaderboard lays them out: one row per RULER task, one score column per
(method, compression ratio), per context length and question mode; every score with its Wilson interval, and the
average's drop vs the full cache with its paired bounds."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import esc, table
from kvlab.stats.intervals import drop_bounds, per_sample, wilson

TITLE = "RULER (kvpress leaderboard layout)"
QUERIES = ("ruler",)
# RULER's order of its 13 tasks (synthetic.yaml); the report's env does not install RULER, so it is written here.
ORDER = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]


def column(method: str, budget: float) -> str:
    """A score column's name: the method, and for a method that evicts, kvpress's compression ratio (1 − budget,
    the share of the context removed) as its leaderboard writes it."""
    return method if budget >= 1 else f"{method} {1 - budget:g}"


def score(rows: pd.DataFrame, scores: str = "score") -> str:
    low, high = wilson(rows[scores].sum(), len(rows))
    return f"{100 * rows[scores].mean():.1f} [{100 * low:.0f}, {100 * high:.0f}]"


def leaderboard(rows: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """One table for rows of one (model, context length, question mode): a row per RULER task (RULER's order) with
    its distinct prompts, the full cache's score and one column per (method, ratio); then the average over every
    answer, and its drop vs the full cache in points with the one-sided 95% bounds (the decision table's betting bounds
    over samples, tuned to `tolerance`)."""
    rank = {t: i for i, t in enumerate(ORDER)}
    tasks = sorted(rows["ruler_task"].unique(), key=lambda t: (rank.get(t, len(ORDER)), t))
    variants = rows[["method", "budget"]].drop_duplicates().sort_values(["method", "budget"], ascending=[True, False])
    names = [column(m, b) for m, b in variants.itertuples(index=False)]
    out = []
    for task in tasks:
        g = rows[rows["ruler_task"] == task]
        full = g.drop_duplicates("sample_id")
        line = {"RULER task": task, "prompts": g["sample_id"].nunique(), "full": score(full, "full_score")}
        for (method, budget), name in zip(variants.itertuples(index=False), names):
            v = g[(g["method"] == method) & (g["budget"] == budget)]
            line[name] = score(v) if len(v) else ""
        out.append(line)
    full = rows.drop_duplicates("sample_id")
    average = {"RULER task": "average (every answer)", "prompts": rows["sample_id"].nunique(), "full": score(full, "full_score")}
    drop = {"RULER task": "drop vs full (points) [bounds]", "prompts": "", "full": ""}
    for (method, budget), name in zip(variants.itertuples(index=False), names):
        v = rows[(rows["method"] == method) & (rows["budget"] == budget)]
        s = per_sample(v, ["score", "full_score"])
        b = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), tolerance)
        average[name] = score(v)
        drop[name] = f"{b.mean:+.1f} [{b.low:+.1f}, {b.high:+.1f}]"
    return pd.DataFrame([*out, average, drop])


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    rows = q["ruler"]
    if rows.empty:
        return ("<p>This run has no RULER task (kind <code>ruler</code>). Preset <code>ruler</code> runs the "
                "leaderboard's grid: the 13 tasks at 4K, both question modes, kvpress's compression ratios.</p>")
    html = [
        "<p>RULER's own samples (its generators and data, for this model's tokenizer) and metrics, laid out as "
        "kvpress's leaderboard: one column per method and compression ratio, where kvpress's ratio is the share "
        "of the context removed (1 − kvlab's budget); a quantized method has no ratio. Each score is RULER's metric "
        "in percent, averaged over the task's answers, with its Wilson 95% interval (partial credit counts as its "
        "sum). Unlike the leaderboard (Qwen3-8B and Llama-3.1-8B at 4K, 500 samples per task, on a GPU), this run "
        "evaluates the model below on a CPU, with the prompts counted in each row.</p>"
    ]
    for (model, ctx, mode), g in rows.groupby(["model", "context_tokens", "question_mode"], sort=True):
        html.append(f"<h3>{esc(model)} · {ctx:,} tokens · question {esc(mode)}</h3>" + table(leaderboard(g, rule.tolerance_points)))
    return "".join(html)
