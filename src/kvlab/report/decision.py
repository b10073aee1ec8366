"""The article's decision table (§7.2), regenerated from this run's rows, and its comparison with the article.

Input is the `decision` query: per (model, task shape, question mode, method, budget) the accuracy beside the
full cache on the same answers, or, for prose, the per-token KL; and the bytes the method stored as a
fraction of the full cache in bf16. A method is *safe* at a budget when it passes the `Rule`; the table lists,
per shape and mode, the safe methods by the compression they reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Rule:
    """When a compressed method is safe, and the compression the article asks for."""

    tolerance_points: float = 1.0  # within this many accuracy points of the full cache on the same answers
    kl_safe: float = 0.01  # … or, on prose (no answers to score), per-token KL vs the full cache at most this (nats)
    target: float = 4.0  # the article's question: 40 GB → 10 GB, i.e. at least 4× fewer bytes than bf16


def safe(frame: pd.DataFrame, rule: Rule = Rule()) -> pd.Series:
    """Per row: whether the method stays within tolerance (accuracy rows need a full cache that scores)."""
    by_kl = frame["kl_mean_nats"].notna()
    by_acc = (frame["full_accuracy"] > 0) & (frame["accuracy"] >= frame["full_accuracy"] - rule.tolerance_points / 100)
    return (by_kl & (frame["kl_mean_nats"] <= rule.kl_safe)) | (~by_kl & by_acc)


def _label(r) -> str:
    budget = f"@{r.budget:g}" if r.budget < 1 else ""
    return f"{r.method}{budget} ({1 / r.kv_fraction_bf16:.1f}×)"


def decision_table(dec: pd.DataFrame, rule: Rule = Rule()) -> pd.DataFrame:
    """One row per (model, shape, question mode): the safe methods, most compression first (each at its
    most compressed safe budget), the best compression reached, and the methods safe at no budget."""
    columns = ["model", "shape", "question mode", "full cache", "safe (most compression first)", "best safe compression",
               f"safe at ≥ {rule.target:g}×", "not safe at any budget"]
    rows = []
    for (model, shape, mode), g in dec.groupby(["model", "shape", "question_mode"], sort=True):
        g = g.assign(safe=safe(g, rule))
        prose = g["kl_mean_nats"].notna().all()
        full = "KL reference" if prose else f"{(g['full_accuracy'] * g['rows']).sum() / g['rows'].sum():.0%}"
        if not prose and (g["full_accuracy"] == 0).all():
            rows.append([model, shape, mode, full, "— (the full cache scores 0%: nothing to lose)", "", "", ""])
            continue
        best = g[g["safe"]].sort_values("kv_fraction_bf16").groupby("method", sort=False).head(1)
        best = best.sort_values(["kv_fraction_bf16", "method"])
        unsafe = sorted(set(g["method"]) - set(best["method"]))
        reach = best[1 / best["kv_fraction_bf16"] >= rule.target - 1e-9]
        rows.append([
            model, shape, mode, full,
            ", ".join(_label(r) for r in best.itertuples()) or "none",
            f"{1 / best['kv_fraction_bf16'].min():.1f}×" if len(best) else "",
            ", ".join(_label(r) for r in reach.itertuples()) or "none",
            ", ".join(unsafe),
        ])
    return pd.DataFrame(rows, columns=columns)


# The article's §7.2 recommendations that this run can test, as (workload in the article, our shape and
# question modes, statement, which rows it is about, whether the article expects them safe). Methods are
# recognized by what they store, not by their config names: INT4 = 4-bit KIVI (keys per channel) without
# eviction; FP8 + SnapKV 25% = FP8 storage of what SnapKV keeps at budget 0.25; eviction = any method that
# keeps a fraction of the context.
def _int4(d):
    return (d["scheme"] == "kivi") & (d["bits"] == 4) & (d["key_axis"] == "channel") & (d["budget"] == 1)


def _fp8_snapkv25(d):
    return (d["scheme"] == "fp8") & (d["press"] == "SnapKVPress") & (d["budget"] == 0.25)


def _fp8(d):
    return (d["scheme"] == "fp8") & (d["budget"] == 1)


def _h2o(d):
    return d["method_kind"] == "h2o"


def _eviction(d):
    return d["budget"] < 1


def _streaming(d):
    return (d["press"] == "StreamingLLMPress") & d["wrapper"].isna()


ARTICLE = [
    ("long-document QA, question known", ("single needle", ("aware",)), "INT4 KV is safe", _int4, True),
    ("long-document QA, question known", ("single needle", ("aware",)), "FP8 + SnapKV 25% is safe", _fp8_snapkv25, True),
    ("long-document QA, question known", ("single needle", ("aware",)), "H2O is not safe", _h2o, False),
    ("multi-turn agent, question unknown", ("multi-turn", ("multi_turn", "agnostic")), "INT4 KV is safe", _int4, True),
    ("multi-turn agent, question unknown", ("multi-turn", ("multi_turn", "agnostic")), "no eviction is safe", _eviction, False),
    ("streaming, recent context only", ("recency", ("agnostic",)), "StreamingLLM is safe", _streaming, True),
    ("reasoning, long outputs", ("reasoning", ("agnostic", "aware")), "FP8 KV is safe", _fp8, True),
    ("reasoning, long outputs", ("reasoning", ("agnostic", "aware")), "no eviction is safe", _eviction, False),
]


def article_comparison(dec: pd.DataFrame, rule: Rule = Rule()) -> pd.DataFrame:
    """Each testable statement of the article's decision table against this run: the rows it is about
    (methods × budgets, pooled over the listed question modes per method and budget) and whether the data
    agree. Safe statements agree when some such configuration is safe; 'not safe' statements when none is."""
    out = []
    for workload, (shape, modes), statement, pick, expect_safe in ARTICLE:
        rows = dec[(dec["shape"] == shape) & dec["question_mode"].isin(modes)]
        rows = rows[pick(rows)] if len(rows) else rows
        if rows.empty:
            out.append([workload, shape, ", ".join(modes), statement, "not measured", "no matching method in this run"])
            continue
        g = rows.assign(correct=rows["accuracy"] * rows["rows"], full_correct=rows["full_accuracy"] * rows["rows"])
        g = g.groupby(["method", "budget"], sort=False).agg(
            correct=("correct", "sum"), full_correct=("full_correct", "sum"), rows=("rows", "sum"),
            kv_fraction_bf16=("kv_fraction_bf16", "mean"),
        ).reset_index()
        g["accuracy"], g["full_accuracy"] = g["correct"] / g["rows"], g["full_correct"] / g["rows"]
        g["kl_mean_nats"] = float("nan")
        if (g["full_accuracy"] == 0).all():
            out.append([workload, shape, ", ".join(modes), statement, "not measured", "the full cache scores 0% here"])
            continue
        ok = safe(g, rule)
        agrees = bool(ok.any()) if expect_safe else not bool(ok.any())
        evidence = "; ".join(
            f"{r.method}{'@' + format(r.budget, 'g') if r.budget < 1 else ''} {r.accuracy:.0%} vs full {r.full_accuracy:.0%}"
            for r in g.itertuples()
        )
        out.append([workload, shape, ", ".join(modes), statement, "agrees" if agrees else "disagrees", evidence])
    return pd.DataFrame(out, columns=["article's workload", "our shape", "question modes", "article says", "this run", "evidence"])


def c12_verdict(comparison: pd.DataFrame) -> tuple[str, str]:
    """C12: the decision table regenerated — holds when every testable statement of the article agrees."""
    tested = comparison[comparison["this run"] != "not measured"]
    if tested.empty:
        return "not measured", "no statement of the article's decision table could be tested"
    agree = int((tested["this run"] == "agrees").sum())
    verdict = "holds" if agree == len(tested) else "does not hold"
    against = "; ".join(f"{r['article says']} ({r['our shape']})" for _, r in tested[tested["this run"] == "disagrees"].iterrows())
    return verdict, (f"{agree} of {len(tested)} testable statements agree with this run"
                     + (f"; disagree: {against}" if against else "") + f" ({len(comparison) - len(tested)} not measured).")


def c12(q: dict, t) -> list[tuple[str, str, str]]:
    """The claims table's verdict function for C12 (kvlab.report.claims)."""
    return [("", *c12_verdict(article_comparison(q["decision"], t.rule)))]
