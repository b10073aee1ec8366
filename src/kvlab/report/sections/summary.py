"""The grid in one sentence, then the article's question answered per task shape and question mode: which
methods reach ≥ the target's fewer bytes than bf16 and stay safe (the decision table's rule)."""

import pandas as pd

from kvlab.report.decision import ON_AVERAGE, Rule, cells, decision_table, evidence, over_cap
from kvlab.report.html import esc

TITLE = "Summary"
QUERIES = ("answers",)


def decided(answers: pd.DataFrame, rule: Rule) -> str:
    """How many of the run's cells (method × budget per shape and question mode) its samples decide, cell by cell
    and across the table (the decisions e-BH keeps), with the guarantee of each."""
    if answers.empty:
        return ""
    c = cells(answers, rule, by=["model", "shape", "question_mode"])
    own, table = c["decision"].value_counts(), c["table_decision"].value_counts()
    n = len(c)
    parts = ", ".join(f"{int(table.get(d, 0))} {d}" for d in ("safe", "unsafe", "inconclusive"))
    unjudged = n - int(sum(own.get(d, 0) for d in ("safe", "unsafe", "inconclusive")))
    rest = f", {unjudged} not judged (the full cache scores 0%)" if unjudged else ""
    per_cell = int(own.get("safe", 0) + own.get("unsafe", 0))
    return (f"<p><b>How sure:</b> of {n} cells (a method at a budget, per task shape and question mode), the table "
            f"decides {int(table.get('safe', 0) + table.get('unsafe', 0))}: {parts}{rest}. Across the table, the "
            f"expected share of wrong decisions among these is at most 5% (e-BH over every cell's e-values). Cell by "
            f"cell, {per_cell} are decided ({int(own.get('safe', 0))} safe, {int(own.get('unsafe', 0))} unsafe), each "
            f"wrong with chance at most 5% however early its job stopped; 'Where the answers went' lists which e-BH "
            f"keeps.</p>")


def safe_list(answers: pd.DataFrame, rule: Rule) -> str:
    """The methods decided safe, with their n and bounds (on prose their documents above the KL cap: a cell with any
    reads 'safe on average'), by task shape and question mode."""
    if answers.empty:
        return ""
    c = cells(answers, rule, by=["model", "shape", "question_mode"])
    safe = c[c["table_decision"] == "safe"].sort_values(["shape", "question_mode", "kv_fraction_bf16", "method"])
    if safe.empty:
        return "<p><b>Decided safe:</b> no method on any cell of this run.</p>"
    items = "".join(f"<li>{esc(r['shape'])} ({esc(r['question_mode'])}): <b>{esc(r['method'])}"
                    f"{'@' + format(r['budget'], 'g') if r['budget'] < 1 else ''}</b> ({1 / r['kv_fraction_bf16']:.1f}×): "
                    f"{ON_AVERAGE + ' — ' if over_cap(r) else ''}{esc(evidence(r))}</li>"
                    for _, r in safe.iterrows())
    return f"<p><b>Decided safe</b> (each with its n and one-sided 95% bounds):</p><ul>{items}</ul>"


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    models, acc = q["models"], q["accuracy"]
    names = ", ".join(models["name"])
    grid = (
        f"tasks {', '.join(sorted(acc['task'].unique()))}; context {', '.join(map(str, sorted(acc['context_tokens'].unique())))} "
        f"tokens; methods {', '.join(sorted(acc['method'].unique()))}; budgets "
        f"{', '.join(f'{b:g}' for b in sorted(acc.loc[acc['budget'] < 1, 'budget'].unique(), reverse=True))} of the KV cache kept; "
        f"question modes "
        f"{', '.join(sorted(acc['question_mode'].unique()))}"
    )
    items = []
    for _, r in decision_table(q["answers"], rule).iterrows():
        where, safe = f"{r['shape']} ({r['question mode']})", r["safe (most compression first)"]
        reach, open_ = r[f"safe at ≥ {rule.target:g}×"], r[f"inconclusive at ≥ {rule.target:g}×"]
        pending = f"; inconclusive: {open_}" if open_ not in ("none", "") else ""
        if safe.startswith("—"):
            items.append(f"<li>{esc(where)}: the full cache itself scores 0% — nothing to judge.</li>")
        elif reach != "none":
            items.append(f"<li>{esc(where)}: <b>{esc(reach)}</b>{esc(pending)}</li>")
        else:
            best = f" (best safe: {safe.split(', ')[0]})" if safe != "none" else " (nothing decided safe at any budget)"
            items.append(f"<li>{esc(where)}: none decided safe at ≥ {rule.target:g}×{esc(best + pending)}</li>")
    return (
        f"<p>Model(s): <b>{esc(names)}</b>. Grid: {esc(grid)}.</p>" + decided(q["answers"], rule) + safe_list(q["answers"], rule) +
        f"<p><b>The article's question — 40 GB → 10 GB, which method is safe on which task?</b> On this run, the "
        f"methods that stored at most 1/{rule.target:g} of the full cache's bf16 bytes and are decided safe: the "
        f"one-sided 95% upper bound of their accuracy drop is at most {rule.tolerance_points:g} points (on prose: of "
        f"their KL, {rule.kl_safe:g} nat), by task shape and question mode (measured compression in brackets). "
        f"Methods the run's samples cannot decide are named as inconclusive, with n and their bounds:</p><ul>{''.join(items)}</ul>"
        "<p class='note'>The decision table below gives every safe method and the rule; the claims table gives each of the "
        "study's claims its verdict.</p>"
    )
