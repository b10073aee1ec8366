"""The article's decision table (§7.2) compared with this run: each of its statements (`ARTICLE`) against the cells
it is about, decided by kvlab.report.decision, and claim C12 (the decision table, regenerated) from the comparison."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvlab.report.decision import Rule, cells, evidence, measured_on


def _int4(d):
    return (d["scheme"] == "kivi") & (d["bits"] == 4) & (d["key_axis"] == "channel") & (d["policy"] == "kivi") & (d["budget"] == 1)


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


def _int2(d):
    return (d["bits"] == 2) & (d["budget"] == 1)


@dataclass(frozen=True)
class Statement:
    """One recommendation of the article's §7.2 table, as this run can test it: its workload and the context it is
    about, the task shapes that stand for it (the first one this run measured is used: RULER's document QA before
    kvlab's single needle), the question modes pooled, which rows it is about (methods recognized by what they
    store, not by config name: INT4 = 4-bit KIVI, keys per channel, no eviction; FP8 + SnapKV 25% = FP8 storage of
    what SnapKV keeps at budget 0.25; eviction = any method that keeps a share of the context) and whether the
    article expects them safe. `outside`: why no run of kvlab's can test it, or the least context it is about,
    in tokens (a run whose rows are all shorter is outside it)."""

    workload: str
    context: str
    shapes: tuple[str, ...]
    modes: tuple[str, ...]
    says: str
    pick: object = None
    expect_safe: bool = True
    outside: str | int | None = None


ARTICLE = [
    Statement("general chat", "< 32K", (), (), "FP8 KV is safe",
              outside="no open-ended chat task: kvlab scores answers it can check"),
    Statement("long-document QA, question after the document", "long", ("document QA", "single needle"), ("aware",),
              "INT4 KV is safe", _int4),
    Statement("long-document QA, question after the document", "long", ("document QA", "single needle"), ("agnostic",),
              "INT4 KV is safe", _int4),
    Statement("long-document QA, question after the document", "long", ("document QA", "single needle"), ("aware",),
              "FP8 + SnapKV 25% is safe", _fp8_snapkv25),
    Statement("long-document QA, question after the document", "long", ("document QA", "single needle"), ("aware",),
              "H2O is not safe", _h2o, False),
    Statement("multi-turn agent, question unknown", "long history", ("multi-turn",), ("multi_turn", "agnostic"),
              "INT4 KV is safe", _int4),
    Statement("multi-turn agent, question unknown", "long history", ("multi-turn",), ("multi_turn", "agnostic"),
              "no eviction is safe", _eviction, False),
    Statement("streaming, recent context only", "any", ("recency",), ("agnostic",), "StreamingLLM is safe", _streaming),
    Statement("reasoning, long outputs", "long outputs", ("reasoning",), ("agnostic", "aware"), "FP8 KV is safe", _fp8),
    Statement("reasoning, long outputs", "long outputs", ("reasoning",), ("agnostic", "aware"), "no eviction is safe",
              _eviction, False),
    Statement("beyond 128K, exact retrieval", "> 128K", ("single needle",), ("agnostic", "aware"), "FP8 KV is safe",
              _fp8, outside=131073),
    Statement("beyond 128K, exact retrieval", "> 128K", ("single needle",), ("agnostic", "aware"), "2-bit KV is not safe",
              _int2, False, outside=131073),
    Statement("beyond 128K, exact retrieval", "> 128K", ("single needle",), ("agnostic", "aware"), "no eviction is safe",
              _eviction, False, outside=131073),
    Statement("training possible, long context central", "long", (), (), "sparse attention or shared KV trained in",
              outside="needs training; the section on trained-for structures applies them post hoc instead"),
]


def article_comparison(rows: pd.DataFrame, rule: Rule = Rule()) -> pd.DataFrame:
    """Each statement of the article's decision table against this run: the cells it is about (methods × budgets,
    the listed question modes pooled by sample) and whether the data agree. A 'safe' statement agrees when some
    such cell is decided safe and disagrees when all are decided unsafe; a 'not safe' statement agrees when all
    are decided unsafe and disagrees when some is decided safe; anything else is inconclusive. A statement this
    run cannot reach (no such task, or contexts longer than it measured) says so and why."""
    out = []
    for st in ARTICLE:
        shape = next((sh for sh in st.shapes if (rows["shape"] == sh).any()), st.shapes[0] if st.shapes else "—")
        picked = rows[(rows["shape"] == shape) & rows["question_mode"].isin(st.modes)]
        picked = picked[st.pick(picked)] if len(picked) else picked
        where = [st.workload, st.context, shape, ", ".join(st.modes), st.says, measured_on(picked) if len(picked) else ""]
        if isinstance(st.outside, str):
            out.append([*where, "not measured", st.outside])
            continue
        if isinstance(st.outside, int):
            longest = int(rows["context_tokens"].max()) if len(rows) else 0
            if longest < st.outside:
                out.append([*where, "not measured", f"outside this run: it is about contexts {st.context}, this run "
                                                    f"measured up to {longest:,} tokens"])
                continue
        if picked.empty:
            out.append([*where, "not measured", "no matching method in this run"])
            continue
        c = cells(picked, rule, by=[])
        if (c["full_accuracy"] == 0).all():
            out.append([*where, "not measured", "the full cache scores 0% here"])
            continue
        safe, unsafe = (c["decision"] == "safe").any(), (c["decision"] == "unsafe").all()
        if st.expect_safe:
            verdict = "agrees" if safe else "disagrees" if unsafe else "inconclusive"
        else:
            verdict = "agrees" if unsafe else "disagrees" if safe else "inconclusive"
        each = "; ".join(f"{r['method']}{'@' + format(r['budget'], 'g') if r['budget'] < 1 else ''} {r['decision']}: "
                         f"{evidence(r)}" for _, r in c.iterrows())
        out.append([*where, verdict, each])
    return pd.DataFrame(out, columns=["article's workload", "article's context", "our shape", "question modes",
                                      "article says", "measured on", "this run", "evidence"])


def c12_verdict(comparison: pd.DataFrame) -> tuple[str, str]:
    """C12: the decision table regenerated — holds when every testable statement of the article agrees, does not
    hold when one disagrees, and is inconclusive otherwise."""
    tested = comparison[comparison["this run"] != "not measured"]
    if tested.empty:
        return "not measured", "no statement of the article's decision table could be tested"
    said = tested["this run"]
    verdict = "does not hold" if (said == "disagrees").any() else "holds" if (said == "agrees").all() else "inconclusive"

    def listed(what: str) -> str:
        names = "; ".join(f"{r['article says']} ({r['our shape']})" for _, r in tested[said == what].iterrows())
        return f"; {what}: {names}" if names else ""

    return verdict, (f"{int((said == 'agrees').sum())} of {len(tested)} testable statements agree with this run"
                     + listed("disagrees") + listed("inconclusive") + f" ({len(comparison) - len(tested)} not measured).")


def c12(q: dict, t) -> list[tuple[str, str, str]]:
    """The claims table's verdict function for C12 (kvlab.report.claims)."""
    return [("", *c12_verdict(article_comparison(q["answers"], t.rule)))]
