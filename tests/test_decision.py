"""The decision table and its comparison with the article, on hand-made result tables; C9 on the cost rows."""

import numpy as np
import pandas as pd
import pytest

from kvlab.stats.anytime import sequence
from kvlab.report.claims import verdicts
from kvlab.report.article import article_comparison, c12_verdict
from kvlab.report.decision import Rule, decision_table
from kvlab.report.verdicts.cost import matches as _matches
from kvlab.stats.intervals import kl_bounds


def row(method, shape, mode, budget, accuracy, full=1.0, fraction=None, kl=None, scheme=None, bits=None, press=None,
        kind="kvpress", rows=200):
    """`rows` samples of one cell of the answers query: accuracy × rows answers right (the full cache's: full ×
    rows, a superset), spread over the samples in a seeded random order as a run's draws would be (the bounds read
    samples in draw order), or on prose every sample at KL `kl`."""
    rank = np.random.default_rng(0).permutation(rows)
    base = {"model": "m", "shape": shape, "task": shape, "context_tokens": 512, "question_mode": mode, "method": method,
            "method_kind": kind, "press": press, "wrapper": None, "scheme": scheme, "bits": bits,
            "key_axis": "channel" if scheme == "kivi" else None, "value_axis": "token" if scheme == "kivi" else None,
            "policy": "kivi" if scheme == "kivi" else None, "budget": budget, "turn": 1, "kv_fraction_bf16": fraction if fraction is not None else budget}
    return [{**base, "sample_id": f"{shape}-{i}", "kl_vs_full": kl,
             "score": None if kl is not None else float(rank[i] < round(accuracy * rows)),
             "full_score": None if kl is not None else float(rank[i] < round(full * rows))} for i in range(rows)]


def answers(*cells) -> pd.DataFrame:
    return pd.DataFrame([r for cell in cells for r in cell])


def test_decision_table_lists_safe_methods_at_their_most_compressed_budget():
    dec = answers(
        row("snapkv", "single needle", "aware", 0.5, 1.0, press="SnapKVPress"),
        row("snapkv", "single needle", "aware", 0.25, 1.0, press="SnapKVPress"),
        row("snapkv", "single needle", "aware", 0.1, 0.5, press="SnapKVPress"),  # outside tolerance
        row("kivi4", "single needle", "aware", 1.0, 1.0, fraction=0.35, scheme="kivi", bits=4, kind="quant"),
        row("h2o", "single needle", "aware", 0.5, 0.83, kind="h2o"),  # 17 points down at its best
        row("kivi4", "prose", "agnostic", 1.0, None, kl=0.004, fraction=0.35, scheme="kivi", bits=4, kind="quant"),
        row("kivi2", "prose", "agnostic", 1.0, None, kl=0.15, fraction=0.23, scheme="kivi", bits=2, kind="quant"),
        row("snapkv", "reasoning", "agnostic", 0.5, 0.0, full=0.0, press="SnapKVPress"),
    )
    t = decision_table(dec).set_index(["shape", "question mode"])
    needle = t.loc[("single needle", "aware")]
    assert needle["safe (most compression first)"] == "snapkv@0.25 (4.0×), kivi4 (2.9×)"
    assert needle["best safe compression"] == "4.0×" and needle["safe at ≥ 4×"] == "snapkv@0.25 (4.0×)"
    assert needle["unsafe at every budget"] == "h2o" and needle["full cache"] == "100% [98%, 100%], n=200"
    prose = t.loc[("prose", "agnostic")]
    share = kl_bounds(np.full(200, 0.004), 0.01).tail_high  # no document above the cap: the tail is shown anyway
    assert prose["safe (most compression first)"] == f"kivi4 (2.9×) [0 of 200 documents above 0.05 nat (share ≤ {share:.1%})]"
    assert prose["unsafe at every budget"] == "kivi2"
    assert t.loc[("reasoning", "agnostic")]["safe (most compression first)"].startswith("— (the full cache scores 0%")


def comparison_rows(int4=1.0, fp8_snap=1.0, h2o=0.2, mt_int4=1.0, mt_evict=0.0):
    return answers(
        row("kivi4", "single needle", "aware", 1.0, int4, scheme="kivi", bits=4, kind="quant"),
        row("snapkv_fp8", "single needle", "aware", 0.25, fp8_snap, scheme="fp8", bits=8, press="SnapKVPress", kind="quant"),
        row("h2o", "single needle", "aware", 0.25, h2o, kind="h2o"),
        row("kivi4", "multi-turn", "multi_turn", 1.0, mt_int4, scheme="kivi", bits=4, kind="quant"),
        row("snapkv", "multi-turn", "multi_turn", 0.25, mt_evict, press="SnapKVPress"),
        row("snapkv", "multi-turn", "agnostic", 0.25, mt_evict, press="SnapKVPress"),
    )


def test_article_comparison_agrees_where_the_data_say_what_the_article_says():
    out = article_comparison(comparison_rows()).set_index(["our shape", "question modes", "article says"])["this run"]
    assert out[("single needle", "aware", "INT4 KV is safe")] == "agrees"
    assert out[("single needle", "aware", "FP8 + SnapKV 25% is safe")] == "agrees"
    assert out[("single needle", "aware", "H2O is not safe")] == "agrees"
    assert out[("single needle", "agnostic", "INT4 KV is safe")] == "not measured"  # no agnostic INT4 rows
    assert out[("multi-turn", "multi_turn, agnostic", "no eviction is safe")] == "agrees"
    assert out[("recency", "agnostic", "StreamingLLM is safe")] == "not measured"
    verdict, evidence = c12_verdict(article_comparison(comparison_rows()))
    assert verdict == "holds" and evidence.startswith("5 of 5 testable statements agree")


@pytest.mark.parametrize("change,statement", [
    ({"int4": 0.5}, "INT4 KV is safe"), ({"h2o": 1.0}, "H2O is not safe"), ({"mt_evict": 1.0}, "no eviction is safe"),
])
def test_article_comparison_disagrees_where_the_data_contradict(change, statement):
    comparison = article_comparison(comparison_rows(**change))
    assert "disagrees" in set(comparison.loc[comparison["article says"] == statement, "this run"])
    verdict, evidence = c12_verdict(comparison)
    assert verdict == "does not hold" and statement in evidence


def test_printed_figures_read_in_binary_or_decimal_units():
    assert _matches("40 GB", 40 * 1024**3) and _matches("320 KB/token", 327_680)
    assert _matches("70 KB/token", 70_272)  # 70.3 decimal kB
    assert _matches("12.5 GB + 40 MB", 12.539 * 1024**3) and not _matches("12.5 GB", 12.7 * 1024**3)
    assert _matches("≈3.1 GB", 3.164 * 1024**3) and not _matches("3.1 GB", 3.164 * 1024**3)
    assert not _matches("8.8 GB", 9_210_691_584)  # 8.58 GiB, 9.21 GB: neither prints as 8.8


def cost_verdict(costs: pd.DataFrame) -> tuple[str, str, str]:
    (out,) = verdicts([9], {"cost_article": costs})
    return out


def test_cost_verdict_names_the_figures_it_cannot_reproduce():
    from kvlab.steps.costs import article_cost_table

    rows = pd.DataFrame(article_cost_table())
    claim, verdict, evidence = cost_verdict(rows)
    assert verdict == "does not hold" and "DeepSeek-V3 bf16: printed 8.8 GB" in evidence
    llama = rows[rows["model"] == "Llama-3.1-70B"]
    assert cost_verdict(llama)[1] == "holds"


def test_decision_table_names_undecided_methods_inconclusive_not_safe():
    """Two answers, both right for both caches: not enough to call the method safe at 4×."""
    dec = answers(row("snapkv", "single needle", "aware", 0.25, 1.0, press="SnapKVPress", rows=2),
                  row("h2o", "single needle", "aware", 0.25, 0.0, kind="h2o", rows=2))
    needle = decision_table(dec).set_index(["shape", "question mode"]).loc[("single needle", "aware")]
    assert needle["safe (most compression first)"] == "none" and needle["safe at ≥ 4×"] == "none"
    assert needle["inconclusive at ≥ 4×"].startswith("h2o@0.25 (4.0×): 0% [0%, 66%] vs full 100%")
    assert "snapkv@0.25 (4.0×): 100% [34%, 100%] vs full 100% [34%, 100%], drop +0.0 pts" in needle["inconclusive at ≥ 4×"]
    # a lossless cell is decided safe at sequence(zeros).down_at samples (66) and one that loses every answer unsafe
    # at 6 (kvlab.stats.anytime): 2 here, so 64 and 4 more
    lossless = sequence(np.zeros(200), -1.0, 1.0, 0.05).down_at
    assert lossless == 66
    assert f"drop +0.0 pts, bounds [-100.0, +100.0], n=2; needs about {lossless - 2} more samples" in needle["inconclusive at ≥ 4×"]
    assert "n=2; needs about 4 more samples" in needle["inconclusive at ≥ 4×"] and needle["unsafe at every budget"] == ""


def test_article_comparison_is_inconclusive_on_too_few_samples():
    few = answers(row("kivi4", "single needle", "aware", 1.0, 1.0, scheme="kivi", bits=4, kind="quant", rows=2))
    out = article_comparison(few).set_index(["our shape", "question modes", "article says"])["this run"]
    assert out[("single needle", "aware", "INT4 KV is safe")] == "inconclusive"
    verdict, evidence = c12_verdict(article_comparison(few))
    assert verdict == "inconclusive" and "inconclusive: INT4 KV is safe (single needle)" in evidence


def test_document_qa_decides_the_long_document_row_where_the_run_has_it():
    """RULER's qa tasks (shape 'document QA') stand for the article's long-document QA row in place of the single
    needle, in both question modes, and the row names the tasks and lengths that decided it."""
    def qa(task, mode, accuracy):
        return [{**r, "task": task, "sample_id": f"{task}-{mode}-{r['sample_id']}", "context_tokens": 4096}
                for r in row("kivi4", "document QA", mode, 1.0, accuracy, scheme="kivi", bits=4, kind="quant", rows=100)]

    rows = pd.concat([comparison_rows(), answers(qa("ruler_qa_1", "aware", 1.0), qa("ruler_qa_2", "aware", 1.0),
                                                 qa("ruler_qa_1", "agnostic", 0.5), qa("ruler_qa_2", "agnostic", 0.5))])
    out = article_comparison(rows)
    aware = one(out, **{"question modes": "aware", "article says": "INT4 KV is safe"})
    agnostic = one(out, **{"question modes": "agnostic", "article says": "INT4 KV is safe"})
    assert aware["our shape"] == agnostic["our shape"] == "document QA"
    assert aware["this run"] == "agrees" and agnostic["this run"] == "disagrees"
    assert aware["measured on"] == "ruler_qa_1 @ 4,096 (100), ruler_qa_2 @ 4,096 (100)"
    # FP8 + SnapKV was measured on the single needle only: the statement stays on document QA and says so
    assert one(out, **{"article says": "FP8 + SnapKV 25% is safe"})["this run"] == "not measured"
    table = decision_table(rows).set_index(["shape", "question mode"])
    assert table.loc[("document QA", "agnostic"), "measured on"] == "ruler_qa_1 @ 4,096 (100), ruler_qa_2 @ 4,096 (100)"
    assert table.loc[("single needle", "aware"), "measured on"] == "single needle @ 512 (200)"


def test_statements_beyond_the_measured_context_say_so():
    """The article's > 128K row is tested only by rows that long: at 512 tokens it is 'not measured' and says how
    far the run reached; rows past 128K decide it. Rows no kvlab task can test give their reason."""
    short = answers(row("fp8", "single needle", "aware", 1.0, 1.0, fraction=0.5, scheme="fp8", bits=8, kind="quant"))
    beyond = {"article's workload": "beyond 128K, exact retrieval", "article says": "FP8 KV is safe"}
    out = one(article_comparison(short), **beyond)
    assert out["this run"] == "not measured" and "measured up to 512 tokens" in out["evidence"]
    chat = one(article_comparison(short), **{"article's workload": "general chat"})
    assert chat["evidence"].startswith("no open-ended chat task")
    assert one(article_comparison(short.assign(context_tokens=200_000)), **beyond)["this run"] == "agrees"


def one(frame: pd.DataFrame, **equal) -> pd.Series:
    """The one row of `frame` whose columns equal the given values."""
    for column, value in equal.items():
        frame = frame[frame[column] == value]
    assert len(frame) == 1, equal
    return frame.iloc[0]


def test_summary_and_claims_count_what_the_samples_decide():
    """The summary counts the cells the samples decide (safe, unsafe) against those left inconclusive or not judged;
    the claims section tallies verdicts."""
    from kvlab.report.sections.claims import tally
    from kvlab.report.sections.summary import decided

    rows = answers(row("snapkv", "single needle", "aware", 0.5, 1.0, press="SnapKVPress"),  # safe at n=200
                   row("snapkv", "single needle", "aware", 0.1, 0.5, press="SnapKVPress"),  # unsafe
                   row("kivi4", "single needle", "aware", 1.0, 1.0, scheme="kivi", bits=4, kind="quant", rows=2),
                   row("snapkv", "reasoning", "agnostic", 0.5, 0.0, full=0.0, press="SnapKVPress"))
    text = decided(rows, Rule())
    assert "of 4 cells" in text and "the table decides 2: 1 safe, 1 unsafe, 1 inconclusive, 1 not judged" in text
    assert "Cell by cell, 2 are decided (1 safe, 1 unsafe)" in text
    frame = pd.DataFrame({"verdict": ["holds", "holds", "inconclusive", "not measured"]})
    assert tally(frame) == "4 verdicts: 2 hold, 0 does not hold, 1 inconclusive, 1 not measured"


def test_a_prose_cell_is_decided_on_its_capped_mean_and_its_tail_share():
    """Prose cells use kl_bounds: 120 samples at 0.004 nat are safe at 0.01; the same with one sample at 0.2 (above
    the cap, 5 × 0.01) are not (one in 120 above the cap leaves the tail share's bound over 3%), and the evidence
    says so. KL 0 needs 110 samples: the tail share's bound first falls under 3% there."""
    from kvlab.report.decision import evidence, judge

    rule = Rule()
    calm = pd.DataFrame(row("kivi4", "prose", "agnostic", 1.0, None, kl=0.004, kind="quant", rows=120))
    assert judge(calm, rule)["decision"] == "safe"
    spiky = calm.copy()
    spiky.loc[0, "kl_vs_full"] = 0.2  # the first sample in draw order
    out = judge(spiky, rule)
    assert out["decision"] == "inconclusive" and out["kl_over_cap"] == 1 and out["kl_high"] < rule.kl_safe
    assert out["kl_tail_high"] > rule.kl_tail_share  # the tail alone keeps it open
    assert "1 of 120 documents above 0.05 nat (share ≤ 4.9%)" in evidence(pd.Series(out))
    assert judge(pd.DataFrame(row("x", "prose", "agnostic", 1.0, None, kl=0.0, kind="quant", rows=109)), rule)["decision"] == "inconclusive"
    assert judge(pd.DataFrame(row("x", "prose", "agnostic", 1.0, None, kl=0.0, kind="quant", rows=110)), rule)["decision"] == "safe"


def test_a_safe_prose_cell_with_documents_above_the_cap_never_reads_plain_safe():
    """Under a relaxed tail (kl_tail_share 0.1), 96 samples at 0.004 nat with two at 1 nat are safe on average: the
    decision table, the grid's outcomes, the summary's evidence and the progress table print their two documents
    and the share's bound beside 'safe'; a cell without any reads safe with '0 of 96' beside it."""
    from kvlab.report.decision import cells, outcomes, shown
    from kvlab.tools.progress import table_so_far

    rule = Rule(kl_tail_share=0.1)
    hit = pd.DataFrame(row("kivi4", "prose", "agnostic", 1.0, 0.0, kl=0.004, kind="quant", fraction=0.3, rows=96))
    hit.loc[[5, 40], "kl_vs_full"] = 1.0
    calm = pd.DataFrame(row("fp8", "prose", "agnostic", 1.0, 0.0, kl=0.004, kind="quant", fraction=0.5, rows=96))
    rows = pd.concat([hit, calm], ignore_index=True)
    words = "safe on average; 2 of 96 documents above 0.05 nat (share ≤ 8.7%)"
    c = cells(rows, rule, by=["model", "shape", "question_mode"]).set_index("method")
    assert c.loc["kivi4", "table_decision"] == "safe" and shown(c.loc["kivi4"]) == words
    assert shown(c.loc["fp8"]) == "safe"
    safe = decision_table(rows, rule).iloc[0]["safe (most compression first)"]
    none = kl_bounds(np.full(96, 0.004), rule.kl_safe, rule.kl_cap_ratio, rule.kl_tail_share).tail_high
    assert safe == f"kivi4 (3.3×) [{words}], fp8 (2.0×) [0 of 96 documents above 0.05 nat (share ≤ {none:.1%})]"
    grid = outcomes(rows, rule).set_index("method")
    assert grid.loc["kivi4", "outcome"] == "safe" and grid.loc["kivi4", "over_cap"] == 2
    assert grid.loc["kivi4", "shown"] == words and grid.loc["fp8", "over_cap"] == 0
    progress = table_so_far(rows.assign(task="prose", context_tokens=512), rule).set_index("method")
    assert progress.loc["kivi4", "state"] == f"decided {words}" and progress.loc["fp8", "state"] == "decided safe"
    assert progress.loc["kivi4", "bounds"].endswith("; 2 of 96 documents above 0.05 nat (share ≤ 8.7%)")


def test_cells_judge_each_distinct_cell_once_and_a_changed_row_or_rule_anew():
    """The report's sections pool the same cells under different groupings; `cells` keeps one judgement per
    distinct cell (its rows and the rule), so a second grouping reuses it, and a changed score or a changed rule
    is judged again."""
    from kvlab.report import decision
    from kvlab.report.decision import cells, judge

    rule = Rule()
    dec = answers(row("snapkv", "single needle", "aware", 0.5, 0.97, press="SnapKVPress", rows=60),
                  row("h2o", "single needle", "aware", 0.5, 0.8, kind="h2o", rows=60))
    direct = [judge(g, rule)["decision"] for _, g in dec.groupby("method", sort=False)]
    decision._judged.clear()
    first = cells(dec, rule, by=["model", "shape", "question_mode"])
    assert list(first["decision"]) == direct == ["inconclusive", "unsafe"] and len(decision._judged) == 2
    again = cells(dec, rule, by=["task"])
    assert len(decision._judged) == 2 and list(again["decision"]) == direct
    pd.testing.assert_frame_equal(first.drop(columns=["model", "shape", "question_mode"]), again.drop(columns="task"))
    worse = dec.copy()
    worse.loc[worse["method"] == "snapkv", "score"] = 0.0
    assert list(cells(worse, rule, by=[])["decision"]) == ["unsafe", "unsafe"] and len(decision._judged) == 3
    assert list(cells(dec, Rule(tolerance_points=25), by=[])["decision"]) == ["safe", "safe"]
    assert len(decision._judged) == 5


def flipped(method, losses, gains, rows=100, right=0.8, ctx=512):
    """One cell whose full cache answers `right` × rows right; the method loses the first `losses` of those and gains
    the first `gains` of the full cache's wrong ones (exact counts, in the row() helper's seeded order)."""
    out = row(method, "single needle", "aware", 0.5, right, full=right, press="SnapKVPress", rows=rows)
    hits = [r for r in out if r["full_score"] == 1.0][:losses]
    misses = [r for r in out if r["full_score"] == 0.0][:gains]
    for r in hits:
        r["score"] = 0.0
    for r in misses:
        r["score"] = 1.0
    return [{**r, "context_tokens": ctx} for r in out]


def test_flips_count_losses_and_gains_separately_with_their_samples():
    """Accuracy moves by losses − gains only: 3 lost and 2 gained read a drop of 1 point, yet 5 answers changed."""
    from kvlab.report.decision import cells, evidence, judge

    one = judge(pd.DataFrame(flipped("snapkv", 3, 2)), Rule())
    assert (one["losses"], one["gains"], one["samples"]) == (3, 2, 100)
    assert one["drop_points"] == pytest.approx(1.0)
    c = cells(answers(flipped("snapkv", 3, 2), flipped("snapkv", 4, 0, rows=50, ctx=1024),
                      row("kivi4", "single needle", "aware", 1.0, 0.9, scheme="kivi", bits=4, kind="quant", rows=100)),
              Rule(), by=["model", "shape", "question_mode"]).set_index("method")
    # a printed cell over two jobs (two context lengths) counts the flips of both
    assert (c.loc["snapkv", "losses"], c.loc["snapkv", "gains"], c.loc["snapkv", "samples"]) == (7, 2, 150)
    assert (c.loc["kivi4", "losses"], c.loc["kivi4", "gains"], c.loc["kivi4", "samples"]) == (10, 0, 100)
    assert "drop +10.0 pts" in evidence(c.loc["kivi4"].to_dict())
    assert "; flips: 10 of 100 samples lost, 0 gained" in evidence(c.loc["kivi4"].to_dict())
    assert "; flips: 7 of 150 samples lost, 2 gained" in evidence(c.loc["snapkv"].to_dict())
    prose = judge(pd.DataFrame(row("x", "prose", "agnostic", 1.0, None, kl=0.0, kind="quant", rows=40)), Rule())
    assert "losses" not in prose and ", n=40" in evidence(prose)


def test_flips_with_partial_scores_and_turns():
    """A partial score (token F1) below the full cache's is a loss and above it a gain, however small; a sample's
    turns are averaged first (as its bounds read them), so one turn lost and one gained is no flip."""
    from kvlab.report.decision import judge

    scores = [(0.5, 1.0), (0.25, 0.2), (0.6, 0.6), (0.0, 0.1), (1.0, 1.0)]  # (method, full): loss, gain, same, loss, same
    base = row("f1", "workload", "aware", 0.5, 1.0, rows=1)[0]
    rows = [{**base, "sample_id": f"s{i}", "score": m, "full_score": f} for i, (m, f) in enumerate(scores)]
    rows += [{**base, "sample_id": "turns", "turn": t, "score": m, "full_score": f} for t, m, f in ((1, 1.0, 0.0), (2, 0.0, 1.0))]
    out = judge(pd.DataFrame(rows), Rule())
    assert (out["losses"], out["gains"], out["samples"]) == (2, 1, 6)


def test_the_database_keeps_flips_as_a_view():
    """collect.add_views: `flips` in results/kvlab.duckdb, per (model, task, context, question mode, method, budget),
    the same counts as the decision table's, from the eval rows (the full cache's rows beside each method's)."""
    import duckdb

    from kvlab.steps.collect import add_views

    cell = pd.DataFrame(flipped("snapkv", 3, 2) + flipped("snapkv", 4, 0, rows=50, ctx=1024))
    full = cell.assign(method="full", method_kind="full", budget=1.0, score=cell["full_score"])
    ev = pd.concat([cell, full]).drop(columns=["full_score"]).assign(metric="string_match")
    con = duckdb.connect()
    con.register("frame", ev)
    con.execute("CREATE TABLE eval AS SELECT * FROM frame")
    add_views(con)
    got = con.execute("SELECT * FROM flips").df()
    assert got[["context_tokens", "method", "losses", "gains", "samples"]].values.tolist() == [
        [512, "snapkv", 3, 2, 100], [1024, "snapkv", 4, 0, 50]]
