"""Agreement with the full cache (issue 54): workloads without references, scored by whether each compressed answer
is the full cache's answer to the same prompt. A cell's drop is then the share of answers the compression changed,
decided as every cell is (safe when its upper bound is within the tolerance, unsafe when its lower bound exceeds
it). Beside each cell: the full cache's own change rate under batch noise on the same task (the noise floor: its
answer read one token at a time in another batch, changed somewhere; a 95% Wilson interval), since a tolerance
below that floor cannot be met, and the per-token KL along the full cache's answer."""

import pandas as pd

from kvlab.report.decision import Rule, cells
from kvlab.report.html import esc, table
from kvlab.stats.intervals import per_sample, wilson

TITLE = "Agreement with the full cache (no references)"
QUERIES = ("agreement",)
BATCH = "one-token steps in another batch"  # the noise_floor query's batch change
BY = ["model", "shape", "question_mode"]


def _floor(noise: pd.DataFrame, model: str, tasks: set) -> tuple[int, int, float, float]:
    """The full cache's scored answers on `tasks` whose batch-noise reading changed them: (n, changed, Wilson low, high)."""
    g = noise[(noise["model"] == model) & noise["task"].isin(tasks) & (noise["change"] == BATCH) & noise["scored"]]
    k = int(g["changed"].sum())
    return len(g), k, *wilson(k, len(g))


def agreement_cells(q: dict, rule: Rule) -> pd.DataFrame:
    """One row per printed cell of the agreement tasks: the share of changed answers with its bounds (points) and
    the table's decision, the noise floor of the full cache on the cell's tasks, and the mean per-token KL."""
    ag = q["agreement"]
    if ag.empty:
        return pd.DataFrame()
    keys = set(zip(ag["model"], ag["task"]))
    a = q["answers"]
    rows = a[[k in keys for k in zip(a["model"], a["task"])]]
    c = cells(rows, rule, by=BY)
    out = []
    for _, r in c.iterrows():
        g = ag[(ag["model"] == r["model"]) & (ag["shape"] == r["shape"]) & (ag["question_mode"] == r["question_mode"])
               & (ag["method"] == r["method"]) & (ag["budget"] == r["budget"])]
        n, k, low, high = _floor(q["noise_floor"], r["model"], set(g["task"]))
        kl = per_sample(g, ["kl_vs_full"])["kl_vs_full"] if g["kl_vs_full"].notna().any() else pd.Series(dtype=float)
        out.append({
            **{k: r[k] for k in BY}, "metric": ", ".join(sorted(set(g["metric"]))), "method": r["method"], "budget": r["budget"],
            "kv_fraction_bf16": r.get("kv_fraction_bf16"), "changed_points": r["drop_points"], "changed_low": r["drop_low"],
            "changed_high": r["drop_high"], "decision": r["table_decision"], "samples": r["samples"],
            "noise_changed": f"{k}/{n}" if n else "not measured", "noise_low_points": 100 * low if n else None,
            "noise_high_points": 100 * high if n else None, "kl_mean_nats": kl.mean() if len(kl) else None,
        })
    return pd.DataFrame(out)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    c = agreement_cells(q, rule)
    if c.empty:
        return ("<p>No task of this run was scored by agreement (metric agreement or agreement_f1: a dataset task whose "
                "rows leave out answers, or one that asks for it).</p>")
    below = c[c["noise_low_points"].notna() & (c["noise_low_points"] > rule.tolerance_points)]
    floor = "".join(
        f"<p>On {esc(shape)} ({esc(model)}) the full cache's own answers change under batch noise more often than "
        f"the tolerance ({rule.tolerance_points:g} points): at least {g['noise_low_points'].iloc[0]:.1f} points, so no "
        "method can be decided safe there at this tolerance.</p>"
        for (model, shape), g in below.groupby(["model", "shape"], sort=False))
    return (
        "<p>Your traffic without reference answers: each compressed answer is compared with the full cache's answer "
        "to the same prompt (agreement: the same after SQuAD's normalisation, 1 or 0; agreement_f1: their token F1), so "
        "the full cache scores 1 by definition and a cell's drop is the share of answers the compression changed "
        "(changed_points, with its anytime bounds over prompts in draw order). A cell is <b>safe</b> when "
        "changed_high is within decision.tolerance_points, <b>unsafe</b> when changed_low exceeds it (decision: the "
        "table's, after e-BH). Beside it, the noise floor: how many of the full cache's own answers on the same task "
        "change when read one token at a time in another batch (noise_changed, 95% Wilson interval in points): a "
        "tolerance below it cannot be met. kl_mean_nats: the mean per-token KL along the full cache's answer.</p>"
        + floor + table(c)
    )
