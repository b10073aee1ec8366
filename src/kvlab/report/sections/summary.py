"""The grid in one sentence, then the article's question answered per task shape and question mode: which
methods reach ≥ the target's fewer bytes than bf16 and stay safe (the decision table's rule)."""

import pandas as pd

from kvlab.report.decision import Rule, decision_table
from kvlab.report.html import esc

TITLE = "Summary"
QUERIES = ("decision",)


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
    for _, r in decision_table(q["decision"], rule).iterrows():
        where, safe, reach = f"{r['shape']} ({r['question mode']})", r["safe (most compression first)"], r[f"safe at ≥ {rule.target:g}×"]
        if safe.startswith("—"):
            items.append(f"<li>{esc(where)}: the full cache itself scores 0% — nothing to judge.</li>")
        elif reach != "none":
            items.append(f"<li>{esc(where)}: <b>{esc(reach)}</b></li>")
        else:
            best = f" (best safe: {safe.split(', ')[0]})" if safe != "none" else " (nothing safe at any budget)"
            items.append(f"<li>{esc(where)}: none at ≥ {rule.target:g}×{esc(best)}</li>")
    return (
        f"<p>Model(s): <b>{esc(names)}</b>. Grid: {esc(grid)}.</p>"
        f"<p><b>The article's question — 40 GB → 10 GB, which method is safe on which task?</b> On this run, the "
        f"methods that stored at most 1/{rule.target:g} of the full cache's bf16 bytes and stayed within "
        f"{rule.tolerance_points:g} accuracy point of it (on prose: KL ≤ {rule.kl_safe:g} nat), by task shape and question "
        f"mode (measured compression in brackets):</p><ul>{''.join(items)}</ul>"
        "<p class='note'>The decision table below gives every safe method; the claims table gives each of the "
        "study's claims its verdict.</p>"
    )
