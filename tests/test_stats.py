"""The intervals and the three-outcome rule behind the report's verdicts (kvlab.stats.intervals), on counts and
paired answers whose answer is known."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from kvlab.report.decision import Rule, judge
from kvlab.stats.intervals import drop_bounds, mean_bounds, wilson


@pytest.mark.parametrize("k,n", [(0, 10), (5, 10), (10, 10), (37, 120), (199, 200)])
def test_wilson_matches_scipy_and_the_closed_form(k, n):
    low, high = wilson(k, n)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert (low, high) == pytest.approx((ci.low, ci.high))
    z, p = stats.norm.ppf(0.975), k / n  # Wilson (1927): centre and half-width of the score interval
    centre, half = (p + z**2 / (2 * n)) / (1 + z**2 / n), z / (1 + z**2 / n) * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    assert (low, high) == pytest.approx((max(centre - half, 0), min(centre + half, 1)))


def test_wilson_known_values():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(7, 10) == pytest.approx((0.3968, 0.8922), abs=1e-4)
    assert wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)


@pytest.mark.parametrize("n,p_full,lost,gained", [(50, 0.8, 0.15, 0.2), (100, 0.7, 0.2, 0.1)])
def test_paired_bounds_cover_a_planted_drop(n, p_full, lost, gained):
    """500 simulated grids of n paired answers with a known true drop (the full cache right with p_full; a method
    loses a right answer with `lost` and fixes a wrong one with `gained`): each one-sided 95% bound of drop_bounds
    falls on its side of the true drop in at least 93% of them."""
    rng = np.random.default_rng(1)
    true = 100 * (p_full - (p_full * (1 - lost) + (1 - p_full) * gained))
    low_ok = high_ok = 0
    for _ in range(500):
        full = rng.random(n) < p_full
        u = rng.random(n)
        method = np.where(full, u >= lost, u < gained)
        b = drop_bounds(full.astype(float), method.astype(float), 5)
        low_ok += b.low <= true
        high_ok += b.high >= true
    assert low_ok >= 0.93 * 500 and high_ok >= 0.93 * 500


def test_identical_answers_at_n200_are_safe():
    b = drop_bounds(np.ones(200), np.ones(200), 5)
    assert b.decide(5) == "safe" and b.low < 0 < b.high <= 5


def test_a_30_point_drop_at_n100_is_unsafe():
    full, method = np.ones(100), np.r_[np.zeros(30), np.ones(70)]
    b = drop_bounds(full, method, 5)
    assert b.mean == pytest.approx(30) and b.decide(5) == "unsafe" and b.low > 5


@pytest.mark.parametrize("method", [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
def test_two_samples_decide_nothing(method):
    b = drop_bounds(np.ones(2), np.array(method), 5)
    assert b.decide(5) == "inconclusive" and b.n == 2


def test_the_n_to_decide_decides_at_the_observed_effect():
    """1 of 20 answers lost: inconclusive at 10 points; the same pattern (one loss in 20, the samples repeated in
    order) is decided safe at exactly the n it names (the estimate runs the same stakes on the samples repeated), and
    not one sample before."""
    full, method = np.ones(20), np.r_[0.0, np.ones(19)]
    b = drop_bounds(full, method, 10)
    assert b.decide(10) == "inconclusive"
    n = int(b.n_to_decide(10))
    assert n > 20

    def pattern(k):
        return drop_bounds(np.ones(k), (np.arange(k) % 20 != 0).astype(float), 10)

    assert pattern(n).decide(10) == "safe"
    assert pattern(n - 1).decide(10) == "inconclusive"


def cell(rows: list[tuple[str, float, float]]) -> pd.DataFrame:
    return pd.DataFrame([{"model": "m", "method": "x", "budget": 0.5, "sample_id": s, "turn": 1, "question_mode": "aware",
                          "score": m, "full_score": f, "kl_vs_full": None} for s, m, f in rows])


def test_bootstrap_resamples_by_sample_not_by_row():
    """Forty copies of one sample's row are one sample: the interval does not shrink (a row bootstrap would
    see 59 answers and narrow it)."""
    base = [(f"s{i}", float(i % 3 != 0), 1.0) for i in range(20)]
    once = judge(cell(base), Rule())
    copied = judge(cell(base + [base[0]] * 40), Rule())
    assert once["samples"] == copied["samples"] == 20 and copied["answers"] == 60
    for key in ("drop_points", "drop_low", "drop_high", "decision"):
        assert copied[key] == once[key]
    rows = cell(base + [base[0]] * 40)
    by_row = drop_bounds(rows["full_score"].to_numpy(), rows["score"].to_numpy(), 5)
    assert by_row.high - by_row.low < once["drop_high"] - once["drop_low"]


def test_turns_of_a_sample_are_paired_and_pooled():
    """Turn 2 of a sample counts within its sample, not as a sample of its own."""
    rows = cell([(f"s{i}", 1.0, 1.0) for i in range(10)] * 2).assign(turn=[1] * 10 + [2] * 10)
    out = judge(rows, Rule())
    assert out["samples"] == 10 and out["answers"] == 20


def test_kl_needs_enough_samples_then_decides_both_ways():
    assert mean_bounds(np.full(5, 0.001), min_samples=10).decide(0.01) == "inconclusive"
    rng = np.random.default_rng(0)
    assert mean_bounds(rng.exponential(0.002, 40), min_samples=10).decide(0.01) == "safe"
    assert mean_bounds(rng.exponential(0.05, 40), min_samples=10).decide(0.01) == "unsafe"
