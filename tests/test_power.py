"""The decision picture, the power table and distinct prompts per cell, on hand-made answers rows."""

import math
import re

import duckdb
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from kvlab.report.build import build
from kvlab.report.decision import decision_table, outcomes
from kvlab.report.sections import power, verdict_grid
from kvlab.stats.intervals import drop_bounds, lossless_samples
from kvlab.tasks.base import Prompt, Turn


def cell(method, shape, budget, scores, full=None, mode="aware", fraction=None, prompts=None):
    """One cell of the answers query: sample i scores scores[i] (the full cache: full[i], default all right) on
    prompt prompts[i] (default: its own)."""
    full = full or [1.0] * len(scores)
    prompts = prompts or [f"{shape}-{i}" for i in range(len(scores))]
    base = {"model": "m", "shape": shape, "task": shape, "context_tokens": 512, "question_mode": mode,
            "method": method, "method_kind": "kvpress", "press": None, "wrapper": None, "scheme": None, "bits": None,
            "key_axis": None, "value_axis": None, "policy": None, "budget": budget, "turn": 1, "kl_vs_full": None,
            "kv_fraction_bf16": fraction if fraction is not None else budget}
    return [{**base, "sample_id": f"{shape}-{i}", "prompt_sha1": p, "score": s, "full_score": f}
            for i, (s, f, p) in enumerate(zip(scores, full, prompts))]


def frame(*cells) -> pd.DataFrame:
    return pd.DataFrame([r for c in cells for r in c])


def test_power_matches_a_hand_computation():
    # 4 samples, one lost: the per-sample drops 0, 1, 0, 0 have mean 1/4 and sd √(1/4) = 50 points
    rows = frame(cell("snapkv", "single needle", 0.25, [1.0, 0.0, 1.0, 1.0]))
    (r,) = power.power_table(rows, power.Rule()).to_dict("records")
    z, sd = stats.norm.ppf(0.95), 50.0
    assert r["samples"] == 4 and r["sd_points"] == pytest.approx(sd)
    assert r["detectable_drop_points"] == pytest.approx(z * sd / 2)  # z·sd/√4
    b = drop_bounds(np.ones(4), np.array([1.0, 0.0, 1.0, 1.0]), 1)
    assert r["samples_for_±1_point"] == b.n_to_decide(1) > 4
    assert r["drop_points"] == 25.0 and r["drop_low"] <= 25.0 <= r["drop_high"]


def test_power_at_large_n_and_the_lossless_need():
    # 500 samples, half lost: the drops' sd is 50 points, so the detectable drop is z·50/√500 ≈ 3.7 points, and
    # the 1-point statement is already decided (unsafe) at this n; a lossless cell of 100 samples would need 333 in
    # all (the betting bound at 1 point, kvlab.stats.anytime; the 'full' preset's max_samples covers it)
    (r,) = power.power_table(frame(cell("x", "recency", 0.5, [1.0, 0.0] * 250)), power.Rule()).to_dict("records")
    z = stats.norm.ppf(0.95)
    assert r["detectable_drop_points"] == pytest.approx(z * 50 / math.sqrt(500), rel=0.01)
    assert r["samples_for_±1_point"] == 500
    (lossless,) = power.power_table(frame(cell("y", "recency", 0.5, [1.0] * 100)), power.Rule()).to_dict("records")
    assert lossless["samples_for_±1_point"] == lossless_samples(1) == 333


def test_distinct_prompts_per_cell_flag_a_repeat():
    rows = frame(
        cell("snapkv", "single needle", 0.25, [1.0, 1.0, 0.0], prompts=["a", "a", "b"]),  # two samples, one prompt
        cell("snapkv", "recency", 0.25, [1.0, 1.0, 0.0]),
    )
    counted = power.prompts(rows).set_index("shape")
    assert counted.loc["single needle", "prompts"] == 2 and counted.loc["recency", "prompts"] == 3
    t = power.power_table(rows, power.Rule()).set_index("shape")
    assert t.loc["single needle", "repeated prompts"] == "yes: 1 of 3 samples repeat one"
    assert t.loc["recency", "repeated prompts"] == "" and (t["samples"] == 3).all()
    page = power.body({"answers": rows}, power.Rule())
    assert "<b>1 cell(s) repeat a prompt</b>" in page and "yes: 1 of 3 samples repeat one" in page


def test_prompt_hash_tells_prompts_apart_by_every_token_fed():
    one = Prompt([1, 2, 3], [4], [5])
    assert one.sha1 == Prompt([1, 2, 3], [4], [5]).sha1
    assert len({one.sha1, Prompt([1, 2, 9], [4], [5]).sha1, Prompt([1, 2], [3, 4], [5]).sha1,
                Prompt([1, 2, 3], [4], [5], followups=(Turn([6], ["x"]),)).sha1}) == 4


def grid_rows() -> pd.DataFrame:
    return frame(
        cell("snapkv", "single needle", 0.5, [1.0] * 200),
        cell("snapkv", "single needle", 0.25, [1.0] * 200),  # safe, most compressed at 4×
        cell("h2o", "single needle", 0.5, [1.0] * 100 + [0.0] * 100),  # 50 points down: unsafe
        cell("pyramidkv", "single needle", 0.25, [1.0, 1.0, 0.0]),  # 3 samples: inconclusive
        cell("kivi4", "single needle", 1.0, [1.0] * 200, fraction=0.35),  # safe at 2.9×
        cell("snapkv", "reasoning", 0.25, [0.0] * 20, full=[0.0] * 20, mode="agnostic"),  # full cache fails
    )


def table_outcome(table_row, method) -> str:
    """A method's outcome read back from the decision table's text columns."""
    def names(text):
        return {re.split(r"[@ ]", m)[0] for m in text.split(", ") if m and m != "none"}
    if table_row["safe (most compression first)"].startswith("—"):
        return "not judged"
    if method in names(table_row["safe (most compression first)"]):
        return "safe"
    return "unsafe" if method in names(table_row["unsafe at every budget"]) else "inconclusive"


def test_picture_colours_are_the_decision_tables_outcomes():
    rows = grid_rows()
    grid = outcomes(rows)
    table = decision_table(rows).set_index(["shape", "question mode"])
    expected = {(r.shape, r.method): table_outcome(table.loc[(r.shape, r.question_mode)], r.method) for r in grid.itertuples()}
    assert set(expected.values()) == {"safe", "unsafe", "inconclusive", "not judged"}
    spec = verdict_grid.chart(grid).to_dict()
    scale = spec["spec"]["layer"][0]["encoding"]["color"]["scale"]
    colour_of = dict(zip(scale["domain"], scale["range"]))
    drawn = {(d["shape"], d["method"]): colour_of[d["outcome"]] for d in next(iter(spec["datasets"].values()))}
    assert drawn == {k: verdict_grid.COLOURS[o] for k, o in expected.items()}
    labels = {(d["shape"], d["method"]): d["label"] for d in next(iter(spec["datasets"].values()))}
    assert labels[("single needle", "snapkv")] == "✓ 4.0×\nn=200" and labels[("single needle", "kivi4")] == "✓ 2.9×\nn=200"
    assert labels[("single needle", "h2o")] == "✗ 2.0×\nn=200" and labels[("single needle", "pyramidkv")] == "? 4.0×\nn=3"
    page = verdict_grid.figure({"answers": rows}, power.Rule())
    for colour in verdict_grid.COLOURS.values():
        assert colour in page  # every outcome's colour is drawn


def test_a_database_that_lacks_a_column_fails_in_one_line(tmp_path):
    db = tmp_path / "old.duckdb"
    duckdb.connect(str(db)).close()
    with pytest.raises(RuntimeError) as error:
        build(db, tmp_path / "r.html", "t")
    assert "query 'tasks' of queries.sql failed" in str(error.value) and "\n" not in str(error.value)


def test_rows_without_a_prompt_hash_fail_in_one_line():
    rows = frame(cell("snapkv", "recency", 0.25, [1.0, 0.0]))
    rows.loc[0, "prompt_sha1"] = None
    with pytest.raises(ValueError, match=r"^eval rows without prompt_sha1 \(tasks recency: evaluated by an older kvlab\)"):
        power.prompts(rows)
