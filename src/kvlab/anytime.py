"""Bounds on the mean of a bounded score that hold however the samples were stopped: betting confidence sequences
(Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2023), their e-values,
and e-BH (Wang & Ramdas 2022) over many of them.

Why betting. kvlab's evaluation jobs stop giving prompts to a cell once its verdict is reached (kvlab.evaluate). A
fixed-n interval (a bootstrap, a Wilson or t interval) read after each round and acted on covers the mean less
often than its level says; tests/test_anytime.py measures it. A confidence sequence covers the mean at every n at
once, so no stopping rule can break it. Among them the betting ones are the tightest known for bounded means, and
they need no distributional assumption beyond the range. We write our own (about 60 lines) because the packaged
implementation (`confseq` on PyPI) needs a C++ build and offers no test at a chosen threshold nor stopped e-values.

How it works here. Scores x_i lie in [lo, hi] (a paired accuracy drop: [−1, 1]). To test "the mean is m", a
gambler starting with wealth 1 stakes, on each new sample, a fraction λ_i fixed before seeing it:
    upward bet    K⁺_t(m) = ∏ (1 + λ⁺_i (x_i − m)),   λ⁺_i ≤ c / (m − lo)     (grows when the mean exceeds m)
    downward bet  K⁻_t(m) = ∏ (1 − λ⁻_i (x_i − m)),   λ⁻_i ≤ c / (hi − m)     (grows when the mean lies below m)
The caps keep wealth positive. If the true mean is m (or lies on the gambler's losing side), the wealth is a
nonnegative supermartingale, so by Ville's inequality it ever reaches 1/α with probability at most α. Hence
    lower bound L_t = the largest m whose upward wealth reached 1/α at some n ≤ t,
    upper bound U_t = the smallest m whose downward wealth reached 1/α at some n ≤ t,
each a one-sided (1 − α) bound valid at every t simultaneously (kept as running intersections, so they never widen).
A decision at a threshold θ is the same test at m = θ: 'safe' once U ≤ θ (the drop is below θ), 'unsafe' once L ≥ θ.
The wealth at θ at a cell's last sample is an e-value (the job stopped at a stopping time): e-BH over a table of
them bounds the share of wrong decisions in the table (`ebh`).

The stakes. The wealth is a mix (any mix of test martingales is one): a share WEIGHT is bet with the empirical
Kelly stake at θ (the paper's GRAPA): stake t is the fraction in [0, c/width] that would have grown the wealth most
over samples 1..t−1 (0 while none would). This is what makes decisions fast: a cell that never loses an answer
stakes the cap from its second sample on, and one that loses answers stops betting on 'safe' until the losses look
rare. The rest is bet with the predictable plug-in stake sqrt(2 log(1/α) / (σ̂² · t · log(1 + t))) (σ̂² from the
earlier samples and one pseudo-sample at the middle of the range with variance (range/4)²), which keeps the bounds
narrow away from θ. Neither stake depends on m except through the cap, so each wealth is monotone in m and the
bounds are intervals. With c = 0.95, α = 0.05 and θ = 5 points, a cell that loses no answer is decided safe after
63 samples (no level-5% test can do it before 59, the exact binomial floor) and one that loses every answer is
decided unsafe after 6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # one-sided error of each bound and each decision
CAP = 0.95  # the largest share of the wealth a stake may risk (c above)
WEIGHT = 0.9  # the share of the starting wealth bet with the Kelly stakes at the threshold (the rest: plug-in stakes)
STAKES = 100  # stakes tried by the empirical Kelly choice, evenly in [0, cap]
GRID = 2000  # points of m across [lo, hi] at which the bounds are read (the threshold is always one of them)


@dataclass(frozen=True)
class Sequence:
    """The betting confidence sequence of x_1..x_n at its last sample.

    low, high: the one-sided (1 − α) bounds (running intersections); e_up, e_down: the e-values at the threshold
    (the upward and downward wealth at the last sample: the samples stopped at a stopping time, so each is an
    e-value by optional stopping); up_at, down_at: the sample (1-based) at which that wealth first reached 1/α, 0 if
    never; more: about how many more samples like these the open side needs to decide
    (inf where no stake grows at these samples' mean, 0 when decided)."""

    low: float
    high: float
    e_up: float
    e_down: float
    up_at: int
    down_at: int
    more: float


def _plug_in(x: np.ndarray, lo: float, hi: float, alpha: float) -> np.ndarray:
    """The predictable plug-in stakes sqrt(2 log(1/α) / (σ̂² t log(1 + t))), σ̂² from the earlier samples and one
    pseudo-sample at the middle of the range with variance (range/4)²."""
    n = len(x)
    mid, var0 = (lo + hi) / 2, ((hi - lo) / 4) ** 2
    count = np.arange(1, n + 2, dtype=float)
    mu = np.concatenate([[mid], mid + np.cumsum(x)]) / count  # mu[i]: the mean after i samples
    var = (np.concatenate([[var0], var0 + np.cumsum((x - mu[1:]) ** 2)]) / count)[:-1]
    t = np.arange(1, n + 1, dtype=float)
    return np.sqrt(2 * math.log(1 / alpha) / (np.maximum(var, 1e-12) * t * np.log1p(t)))


def _kelly(x: np.ndarray, threshold: float, cap: float, sign: int) -> np.ndarray:
    """The predictable empirical Kelly stakes at `threshold` (the paper's GRAPA): stake t is the fraction in [0, cap]
    that would have grown the wealth most over samples 1..t−1 (0 for the first sample, and whenever no stake grows)."""
    lam = np.linspace(0, cap, STAKES + 1)
    grown = np.cumsum(np.log1p(sign * lam[:, None] * (x[None, :] - threshold)), axis=1)  # [stake, t]
    before = np.concatenate([np.zeros((len(lam), 1)), grown[:, :-1]], axis=1)
    return lam[np.argmax(before, axis=0)]


def _log_wealth(x, m, kelly, plug_in, width, sign):
    """log of the mixed wealth W·K_kelly(m) + (1 − W)·K_plug-in(m) for every m (rows) and n (columns): sign +1
    upward (width m − lo), −1 downward (width hi − m); each stake capped at CAP / width."""
    def log_k(stake):
        lam = np.minimum(stake[None, :], CAP / width[:, None])
        return np.cumsum(np.log1p(sign * lam * (x[None, :] - m[:, None])), axis=1)

    return np.logaddexp(math.log(WEIGHT) + log_k(kelly), math.log(1 - WEIGHT) + log_k(plug_in))


def _bisect(grid: np.ndarray, test) -> int:
    """The first index of `grid` where the monotone `test` (false, …, false, true, …) holds; len(grid) if none."""
    a, b = 0, len(grid)
    while a < b:
        mid = (a + b) // 2
        if test(grid[mid]):
            b = mid
        else:
            a = mid + 1
    return a


def _first(crossed: np.ndarray) -> int:
    return int(np.argmax(crossed)) + 1 if crossed.any() else 0


def _growth(x: np.ndarray, threshold: float, cap: float, sign: int) -> float:
    """The best per-sample log growth of a constant stake at `threshold` on these samples (0 if none grows)."""
    lam = np.linspace(0, cap, 200)[1:]
    g = np.log1p(sign * lam[:, None] * (x[None, :] - threshold)).mean(axis=1)
    return float(max(g.max(), 0.0))


def sequence(x, lo: float, hi: float, threshold: float, alpha: float = ALPHA) -> Sequence:
    """The betting confidence sequence of the scores `x` (in the order they were gathered, each in [lo, hi]) at its
    last sample, with the tests at `threshold`; empty `x`: the whole range."""
    x = np.asarray(x, float)
    if not lo < threshold < hi:
        raise ValueError(f"threshold {threshold} must lie strictly inside the scores' range [{lo}, {hi}]")
    if len(x) == 0:
        return Sequence(lo, hi, 1.0, 1.0, 0, 0, math.inf)
    if np.isnan(x).any():
        raise ValueError(f"scores must be numbers in [{lo}, {hi}]; got NaN at sample {int(np.argmax(np.isnan(x))) + 1}")
    if x.min() < lo - 1e-9 or x.max() > hi + 1e-9:
        raise ValueError(f"scores must lie in [{lo}, {hi}]; got values from {x.min()} to {x.max()}")
    x = np.clip(x, lo, hi)
    plug_in = _plug_in(x, lo, hi, alpha)
    up = _kelly(x, threshold, CAP / (threshold - lo), +1)
    down = _kelly(x, threshold, CAP / (hi - threshold), -1)
    grid = np.union1d(np.linspace(lo, hi, GRID + 1)[1:-1], [threshold])
    level = math.log(1 / alpha)

    def rejected_up(m: float) -> bool:  # true for every m up to the lower bound (the wealth falls as m rises)
        at = np.array([m])
        return bool((_log_wealth(x, at, up, plug_in, at - lo, +1) >= level).any())

    def rejected_down(m: float) -> bool:  # true for every m from the upper bound on
        at = np.array([m])
        return bool((_log_wealth(x, at, down, plug_in, hi - at, -1) >= level).any())

    first_kept = _bisect(grid, lambda m: not rejected_up(m))  # the first grid point the upward bets keep
    low = float(grid[first_kept - 1]) if first_kept > 0 else lo
    first_out = _bisect(grid, rejected_down)
    high = float(grid[first_out]) if first_out < len(grid) else hi
    at = np.array([threshold])
    wealth_up = _log_wealth(x, at, up, plug_in, at - lo, +1)[0]
    wealth_down = _log_wealth(x, at, down, plug_in, hi - at, -1)[0]
    up_at, down_at = _first(wealth_up >= level), _first(wealth_down >= level)
    e_up, e_down = math.exp(wealth_up[-1]), math.exp(wealth_down[-1])
    if up_at or down_at:
        more = 0.0
    else:  # the side the samples lean to, at its best constant stake
        sign, wealth, cap = (+1, wealth_up[-1], CAP / (threshold - lo)) if x.mean() > threshold else (-1, wealth_down[-1], CAP / (hi - threshold))
        g = _growth(x, threshold, cap, sign)
        more = math.ceil((level - max(wealth, 0.0)) / g) if g > 0 else math.inf
    return Sequence(low, high, e_up, e_down, up_at, down_at, float(more))


def ebh(e_values, alpha: float = ALPHA) -> np.ndarray:
    """e-BH (Wang & Ramdas 2022): which of K hypotheses to reject so that the expected share of wrong rejections
    among the rejected stays at most α, whatever the dependence between the e-values: the k largest, for the
    largest k with e_(k) ≥ K / (α k)."""
    e = np.asarray(e_values, float)
    if len(e) == 0:
        return np.zeros(0, bool)
    order = np.argsort(-e, kind="stable")
    k = np.arange(1, len(e) + 1)
    ok = e[order] >= len(e) / (alpha * k)
    keep = np.zeros(len(e), bool)
    if ok.any():
        keep[order[: int(k[ok].max())]] = True
    return keep
