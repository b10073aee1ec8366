"""The report's 'Where the answers went' section and the inconclusive cells' reasons, on hand-made answers rows
that carry the evaluation rounds (draw, round, max_samples)."""

import math

import pandas as pd
import pytest

from kvlab.report.decision import Rule, cells, evidence
from kvlab.report.sections import allocation


def cell(method, n, lost_every=0, cap=96, first=6, step=6, budget=0.5):
    """n samples of one cell in draw order: a lost answer at every `lost_every`-th sample (0: none); rounds of
    `first` then `step` samples; the job could reach `cap`."""
    rows = []
    for i in range(n):
        round_ = 1 if i < first else 2 + (i - first) // step
        rows.append({"model": "m", "shape": "single needle", "task": "niah", "task_kind": "niah", "context_tokens": 1024,
                     "question_mode": "aware", "method": method, "method_kind": "kvpress", "press": "P", "wrapper": None,
                     "scheme": None, "bits": None, "key_axis": None, "value_axis": None, "policy": None,
                     "budget": budget, "turn": 1, "kv_fraction_bf16": budget, "sample_id": f"s{i}", "prompt_sha1": f"p{i}",
                     "draw": i, "round": round_, "max_samples": cap, "kl_vs_full": None, "full_score": 1.0,
                     "score": 0.0 if lost_every and i % lost_every == 0 else 1.0})
    return rows


def test_decided_at_and_its_round_and_why_cells_stay_open():
    """A lossless cell is decided safe at sample 66 (round 12: 6, then 6 a round); a cell losing every answer is
    unsafe at sample 6 (round 1); one losing every tenth that used all 96 prompts says it reached max_samples; one
    stopped at 30 says about how many more it needs."""
    rows = pd.DataFrame(cell("lossless", 70) + cell("broken", 12, lost_every=1) + cell("tenth", 96, lost_every=10)
                        + cell("short", 30, lost_every=10))
    c = cells(rows, Rule(), by=["model", "shape", "question_mode"]).set_index("method")
    assert c.loc["lossless", "decision"] == "safe" and c.loc["lossless", "decided_at"] == 66
    assert c.loc["lossless", "decided_round"] == 2 + (66 - 1 - 6) // 6 == 11
    assert c.loc["broken", "decision"] == "unsafe" and c.loc["broken", "decided_at"] == 6 and c.loc["broken", "decided_round"] == 1
    assert c.loc["tenth", "decision"] == "inconclusive" and c.loc["tenth", "cap"] == 96
    assert "reached max_samples (96)" in evidence(c.loc["tenth"].to_dict())
    short = evidence(c.loc["short"].to_dict())
    assert "needs about" in short and "more samples" in short and math.isnan(c.loc["short", "decided_at"])


def test_section_shows_where_the_answers_went_and_ebh():
    rows = pd.DataFrame(cell("lossless", 70) + cell("broken", 12, lost_every=1) + cell("tenth", 96, lost_every=10))
    c = allocation.scored_cells(rows, Rule()).set_index("method")
    # 3 cells, 6 tests whose nulls split the line (3 true): e-BH at 2α keeps the k largest with e_(k) ≥ 3/(0.05·k):
    # 60 for one, 30 for two
    e = {m: c.loc[m, "e_safe" if m == "lossless" else "e_unsafe"] for m in ("lossless", "broken")}
    assert min(e.values()) >= 20
    expect = [e["broken"] >= 60 or min(e.values()) >= 30, e["lossless"] >= 60 or min(e.values()) >= 30]
    assert [c.loc["broken", "ebh"], c.loc["lossless", "ebh"]] == expect and not c.loc["tenth", "ebh"]
    spent = allocation.spent(c.reset_index()).set_index("decision")
    assert spent.loc["inconclusive", "samples spent"] == 96 and spent.loc["unsafe", "samples spent"] == 12
    html = allocation.body({"answers": rows}, Rule())
    assert "<svg" in html and "2 of 3 scored cells are decided per cell (1 safe, 1 unsafe)" in html
    assert f"keeps {int(sum(expect))} of the 2 decisions" in html and "after 66 samples" in html and "reached max_samples (96)" in html


def test_ebh_keeps_strong_decisions_across_a_table():
    """Twenty cells that lose every answer over 30 samples: their e-values are far above 20/(0.05·20) = 20, so e-BH
    keeps all twenty unsafe decisions."""
    rows = pd.DataFrame([r for k in range(20) for r in cell(f"m{k}", 30, lost_every=1)])
    c = allocation.scored_cells(rows, Rule())
    assert (c["decision"] == "unsafe").all() and c["ebh"].all()


def test_the_section_names_the_cells_a_time_limit_left_open_and_their_cost():
    """A job stopped by sequential.stop_after_minutes (rows: stopped_by 'time') after 30 samples, its last round of 6
    prompts in 12 s (2 s a prompt): its cell losing every tenth answer is listed open with the samples that would
    decide it and their minutes at that pace; its cell that lost every answer (unsafe after 12) is not listed; a run
    without a limit adds nothing to the section."""
    timed = pd.DataFrame(cell("short", 30, lost_every=10) + cell("broken", 12, lost_every=1)).assign(round_s=12.0,
                                                                                                    stopped_by="time")
    left = allocation.left_by_time(timed, Rule())
    assert list(left["method"]) == ["short"] and left.loc[0, "samples"] == 30
    c = cells(timed, Rule(), by=["model", "shape", "question_mode"]).set_index("method")
    more = c.loc["short", "n_to_decide"] - 30
    assert left.loc[0, "more samples"] == more and left.loc[0, "about minutes more"] == pytest.approx(more * 2 / 60)
    assert left.loc[0, "why open"] == f"needs about {more:,.0f} more samples"
    html = allocation.body({"answers": timed}, Rule())
    assert "Left open by the time limit" in html and "1 job(s) stopped adding rounds" in html and "niah @ 1,024" in html
    assert "1 job cell(s) stayed open" in html and "valid at any stopping time" in html
    plain = pd.DataFrame(cell("short", 30, lost_every=10)).assign(round_s=12.0, stopped_by="max_samples")
    assert allocation.left_by_time(plain, Rule()).empty and "time limit" not in allocation.body({"answers": plain}, Rule())
