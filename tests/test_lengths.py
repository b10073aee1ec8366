"""The output-length section on hand-made rows: the cap each task's full cache fits in, and the change in answer
length of each method against the full cache's answer to the same prompt, bounded over samples."""

from html import escape

import pandas as pd
import pytest
from scipy import stats

from kvlab.report.decision import Rule
from kvlab.report.sections import lengths


def answers(method, task, lengths_, full, cap=8, modes=("aware",), budget=1.0):
    """Rows of output_lengths: sample i answers with lengths_[i] tokens, the full cache with full[i]."""
    kind = "full" if method == "full" else "kvpress"
    return [{"model": "m", "task": task, "context_tokens": 512, "question_mode": mode, "method": method,
             "method_kind": kind, "budget": budget, "sample_id": f"{task}-{i}", "turn": 1, "max_new_tokens": cap,
             "new_tokens": n, "full_tokens": f, "score": 1.0 if n < cap else 0.0}
            for i, (n, f) in enumerate(zip(lengths_, full)) for mode in modes]


def test_caps_count_the_full_answers_that_reach_it():
    full = [8, 8, 3, 8]
    rows = pd.DataFrame(answers("full", "arith", full, full) + answers("full", "needle", [2, 3, 2, 4], [2, 3, 2, 4]))
    c = lengths.caps(rows).set_index("task")
    low, high = stats.binomtest(3, 4).proportion_ci(0.95, method="wilson")
    assert c.loc["arith", "at_cap"] == 0.75 and c.loc["arith", "at_cap_low"] == pytest.approx(low)
    assert c.loc["arith", "at_cap_high"] == pytest.approx(high) and c.loc["arith", "full_accuracy"] == 0.25
    assert c.loc["needle", "at_cap"] == 0 and c.loc["needle", "full_tokens_mean"] == 2.75
    page = lengths.body({"output_lengths": rows}, Rule())
    assert "arith (75% of 4)" in page and "needle (" not in page and "No compressed method answered" in page


def test_length_changes_are_paired_and_bounded_over_samples():
    full = [4, 5, 6, 4, 5, 6]
    rows = pd.DataFrame(
        answers("full", "t", full, full, modes=("aware", "agnostic"))
        + answers("longer", "t", [n + 3 for n in full], full, modes=("aware", "agnostic"))  # +3 on every prompt
        + answers("mixed", "t", [n + d for n, d in zip(full, [2, -2] * 3)], full)  # ±2: no direction
        + answers("few", "t", [n + 3 for n in full[:3]], full[:3])  # +3 on 3 samples only: too few to bound
    )
    d = lengths.changes(rows).set_index("method")
    assert d.loc["longer", ["change_tokens", "change_low", "change_high", "samples"]].tolist() == [3, 3, 3, 6]
    assert d.loc["longer", "outcome"] == "longer"
    assert d.loc["mixed", "change_tokens"] == 0 and d.loc["mixed", "outcome"] == "undecided"
    assert d.loc["mixed", "change_low"] < 0 < d.loc["mixed", "change_high"]
    assert d.loc["few", "change_tokens"] == 3 and d.loc["few", "outcome"] == "undecided" and d.loc["few", "samples"] == 3
    # a sample's modes are averaged before resampling: +4 in one mode and 0 in the other is +2 for that sample
    two = pd.DataFrame(answers("full", "u", [4] * 5, [4] * 5)
                       + [dict(r, new_tokens=8 if r["question_mode"] == "aware" else 4) for r in
                          answers("half", "u", [4] * 5, [4] * 5, modes=("aware", "agnostic"))])
    (r,) = lengths.changes(two).to_dict("records")
    assert r["change_tokens"] == 2 and r["change_low"] == r["change_high"] == 2 and r["samples"] == 5
    page = lengths.body({"output_lengths": rows}, Rule())
    assert escape("longer than the full cache's in 1, shorter in 0 and neither is decided in 2") in page
    assert "Longest: longer (1) on t: +3.0 tokens [+3.0, +3.0], n=6." in page
