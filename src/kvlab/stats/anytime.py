"""Bounds on the mean of a bounded score that hold however the samples were stopped: betting confidence sequences
(Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2023), their e-values,
and e-BH (Wang & Ramdas 2022) over many of them.

Why betting. kvlab's evaluation jobs stop giving prompts to a cell once its verdict is reached (kvlab.steps.evaluate). A
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

The stakes. Each wealth is a mix of stakes fixed before the sample they bet on (any mix of test martingales is one).
- Downward (the bet behind 'safe'): a share SAFE_WEIGHT is bet with the empirical Kelly stake at θ computed as if
  PRIOR pseudo-samples at the neutral value (no change: 0) had come first, capped at SAFE_CAP of the largest stake.
  The prior keeps the stake high after one early loss (plain empirical Kelly, the paper's GRAPA, drops to ~0.7 of
  the cap after one loss in 60 and needed 181 samples to call such a cell safe; the exact binomial test at a fixed n
  needs 93), and the cap keeps the loss that a stake at the very top of the range would take (×0.05) from costing
  ~14 samples; losses that keep coming pull the stake down as plain Kelly would. The rest is bet with the predictable
  plug-in stake sqrt(2 log(1/α) / (σ̂² · t · log(1 + t))) (σ̂² from the earlier samples and one pseudo-sample at the
  middle of the range with variance (range/4)²), which keeps the upper bound finite for cells far above θ.
- Upward (the bet behind 'unsafe'): a share WEIGHT with plain empirical Kelly at θ, the rest plug-in.
Neither stake depends on m except through the cap, so each wealth is monotone in m and the bounds are intervals.
The numbers this gives (α = 0.05, θ = 5 points, scores in [−1, 1]; tests/test_anytime.py computes each): a cell
that loses no answer is decided safe after 66 samples (no level-5% test can before 59, the exact binomial floor),
one with a single loss among its first 60 by 116, one that loses every answer unsafe after 6.

Wealth is kept in logs: a cell of thousands of samples far from θ has a wealth past any float (e^709), so e-values
are read as logs (`log_e_up`, `log_e_down`) and e-BH compares logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

ALPHA = 0.05  # one-sided error of each bound and each decision
CAP = 0.95  # the largest share of the wealth a stake may risk (c above)
WEIGHT = 0.9  # upward: the share of the starting wealth bet with the Kelly stakes at the threshold (the rest: plug-in)
SAFE_WEIGHT = 0.97  # downward: the share bet with the Kelly stakes after the prior (the rest: plug-in)
SAFE_CAP = 0.94  # downward: the Kelly stakes' largest, as a share of the largest stake the range allows
PRIOR = 200  # downward: pseudo-samples at the neutral value counted before the first real one
HORIZON = 20_000  # `more` looks this far ahead (samples in all) before it calls a cell undecidable
STAKES = 100  # stakes tried by the empirical Kelly choice, evenly in [0, cap]
GRID = 2000  # points of m across [lo, hi] at which the bounds are read (the threshold is always one of them)


@dataclass(frozen=True)
class Sequence:
    """The betting confidence sequence of x_1..x_n at its last sample.

    low, high: the one-sided (1 − α) bounds (running intersections); e_up, e_down: the e-values at the threshold
    (the upward and downward wealth at the last sample: the samples stopped at a stopping time, so each is an
    e-value by optional stopping); up_at, down_at: the sample (1-based) at which that wealth first reached 1/α, 0 if
    never; e_up, e_down: the same e-values (inf past the largest float); more: about how many more samples like these
    the open side needs to decide
    (inf where no stake grows at these samples' mean, 0 when decided)."""

    low: float
    high: float
    log_e_up: float
    log_e_down: float
    up_at: int
    down_at: int
    inputs: tuple = field(default=(), repr=False, compare=False)  # (x, lo, hi, threshold, neutral, alpha): for `more`

    @cached_property
    def more(self) -> float:
        """About how many more samples like these the open side needs (0 when decided; computed when asked: it
        runs the stakes over up to HORIZON samples)."""
        if self.up_at or self.down_at:
            return 0.0
        return _more(*self.inputs) if self.inputs else math.inf

    @property
    def e_up(self) -> float:
        return e_value(self.log_e_up)

    @property
    def e_down(self) -> float:
        return e_value(self.log_e_down)


def e_value(log_e: float) -> float:
    """e^log_e, inf past the largest float (a wealth of thousands of samples can exceed it)."""
    return math.exp(log_e) if log_e < 709 else math.inf


def _plug_in(x: np.ndarray, lo: float, hi: float, alpha: float) -> np.ndarray:
    """The predictable plug-in stakes sqrt(2 log(1/α) / (σ̂² t log(1 + t))), σ̂² from the earlier samples and one
    pseudo-sample at the middle of the range with variance (range/4)²; x of shape (..., n), samples on the last axis."""
    n = x.shape[-1]
    mid, var0 = (lo + hi) / 2, ((hi - lo) / 4) ** 2
    count = np.arange(1, n + 2, dtype=float)
    start = np.full(x.shape[:-1] + (1,), mid)
    mu = np.concatenate([start, mid + np.cumsum(x, axis=-1)], axis=-1) / count  # mu[..., i]: the mean after i samples
    spread = np.cumsum((x - mu[..., 1:]) ** 2, axis=-1)
    var = (np.concatenate([np.full(x.shape[:-1] + (1,), var0), var0 + spread], axis=-1) / count)[..., :-1]
    t = np.arange(1, n + 1, dtype=float)
    return np.sqrt(2 * math.log(1 / alpha) / (np.maximum(var, 1e-12) * t * np.log1p(t)))


def _kelly(x: np.ndarray, threshold: float, cap: float, sign: int, prior: int = 0, neutral: float = 0.0) -> np.ndarray:
    """The predictable empirical Kelly stakes at `threshold` (the paper's GRAPA): stake t is the fraction in [0, cap]
    that would have grown the wealth most over `prior` pseudo-samples at `neutral`, then samples 1..t−1 (0 whenever
    no stake grows); x of shape (..., n), samples on the last axis."""
    lam = np.linspace(0, cap, STAKES + 1).reshape((-1,) + (1,) * x.ndim)
    grown = np.cumsum(np.log1p(sign * lam * (x[None] - threshold)), axis=-1)  # [stake, ..., t]
    before = np.concatenate([np.zeros(grown.shape[:-1] + (1,)), grown[..., :-1]], axis=-1)
    before += prior * np.log1p(sign * lam * (neutral - threshold))
    return lam.reshape(-1)[np.argmax(before, axis=0)]


def _stakes(x: np.ndarray, lo: float, hi: float, threshold: float, neutral: float) -> tuple[np.ndarray, np.ndarray]:
    """The Kelly stakes of the upward bet (plain) and of the downward bet (after the prior, capped at SAFE_CAP)."""
    up = _kelly(x, threshold, CAP / (threshold - lo), +1)
    down = _kelly(x, threshold, SAFE_CAP * CAP / (hi - threshold), -1, PRIOR, min(max(neutral, lo), hi))
    return up, down


def _at_threshold(x, threshold, stake, plug_in, width, sign) -> np.ndarray:
    """log of the mixed wealth at the threshold after each sample (as `_log_wealth` at m = threshold), for x of shape
    (..., n)."""
    weight = WEIGHT if sign > 0 else SAFE_WEIGHT

    def log_k(lam):
        return np.cumsum(np.log1p(sign * np.minimum(lam, CAP / width) * (x - threshold)), axis=-1)

    return np.logaddexp(math.log(weight) + log_k(stake), math.log(1 - weight) + log_k(plug_in))


def wealth_at(x, lo: float, hi: float, threshold: float, alpha: float = ALPHA,
              neutral: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The log wealth at the threshold of the upward and downward bets after each sample: x of shape (..., n), each
    row in draw order, every value in [lo, hi] (many cells at once for simulations). The stakes `sequence` uses: a
    decision at the threshold is its wealth's first reaching log(1/α)."""
    x = np.asarray(x, float)
    up, down = _stakes(x, lo, hi, threshold, neutral)
    plug_in = _plug_in(x, lo, hi, alpha)
    return (_at_threshold(x, threshold, up, plug_in, threshold - lo, +1),
            _at_threshold(x, threshold, down, plug_in, hi - threshold, -1))


def _log_wealth(x, m, kelly, plug_in, width, sign):
    """log of the mixed wealth W·K_kelly(m) + (1 − W)·K_plug-in(m) for every m (rows) and n (columns): sign +1
    upward (width m − lo, W = WEIGHT), −1 downward (width hi − m, W = SAFE_WEIGHT); each stake capped at CAP / width."""
    def log_k(stake):
        lam = np.minimum(stake[None, :], CAP / width[:, None])
        return np.cumsum(np.log1p(sign * lam * (x[None, :] - m[:, None])), axis=1)

    weight = WEIGHT if sign > 0 else SAFE_WEIGHT
    return np.logaddexp(math.log(weight) + log_k(kelly), math.log(1 - weight) + log_k(plug_in))


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


def _more(x: np.ndarray, lo: float, hi: float, threshold: float, neutral: float, alpha: float) -> float:
    """About how many more samples like these would decide the side they lean to: the samples repeated in the same
    order (as the wealth would meet them if the cell went on alike), run through the same stakes until that side's
    wealth at the threshold reaches the level; inf where it does not within HORIZON samples in all."""
    n, upward = len(x), x.mean() > threshold
    repeats, most = 2, max(2, -(-HORIZON // n))
    # Every stake and wealth at sample t depends on samples 1..t only (cumulative sums, taken in order), so the wealth
    # over k repeats is the first k·n values of the wealth over more: the repeats double until the side crosses or
    # the horizon is reached, which gives the crossing the whole horizon gives (often 100x sooner).
    while True:
        repeats = min(repeats, most)
        up, down = wealth_at(np.tile(x, repeats), lo, hi, threshold, alpha, neutral)
        crossed = np.flatnonzero((up if upward else down)[n:] >= math.log(1 / alpha))
        if len(crossed):
            return float(crossed[0] + 1)
        if repeats == most:
            return math.inf
        repeats *= 2


def sequence(x, lo: float, hi: float, threshold: float, alpha: float = ALPHA, neutral: float = 0.0) -> Sequence:
    """The betting confidence sequence of the scores `x` (in the order they were gathered, each in [lo, hi]) at its
    last sample, with the tests at `threshold`; `neutral`: the score of no change (the downward stakes' prior,
    clipped to the range); empty `x`: the whole range."""
    x = np.asarray(x, float)
    if not lo < threshold < hi:
        raise ValueError(f"threshold {threshold} must lie strictly inside the scores' range [{lo}, {hi}]")
    if len(x) == 0:
        return Sequence(lo, hi, 0.0, 0.0, 0, 0)
    if np.isnan(x).any():
        raise ValueError(f"scores must be numbers in [{lo}, {hi}]; got NaN at sample {int(np.argmax(np.isnan(x))) + 1}")
    if x.min() < lo - 1e-9 or x.max() > hi + 1e-9:
        raise ValueError(f"scores must lie in [{lo}, {hi}]; got values from {x.min()} to {x.max()}")
    x = np.clip(x, lo, hi)
    plug_in = _plug_in(x, lo, hi, alpha)
    up, down = _stakes(x, lo, hi, threshold, neutral)
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
    wealth_up = _at_threshold(x, threshold, up, plug_in, threshold - lo, +1)
    wealth_down = _at_threshold(x, threshold, down, plug_in, hi - threshold, -1)
    up_at, down_at = _first(wealth_up >= level), _first(wealth_down >= level)
    return Sequence(low, high, float(wealth_up[-1]), float(wealth_down[-1]), up_at, down_at,
                    (x, lo, hi, threshold, neutral, alpha))


def samples_to_reach(value: float, lo: float, hi: float, threshold: float, e: float = 1 / ALPHA,
                     limit: int = 10_000) -> int:
    """How many samples all equal to `value` (below the threshold: no change, KL 0) the downward wealth at the
    threshold needs to reach `e` (1/α: the cell's own 'safe'); 0 if `limit` do not. The counts quoted in kvlab's
    texts come from here."""
    _, down = wealth_at(np.full(limit, float(value)), lo, hi, threshold, neutral=value)
    return _first(down >= math.log(e))


def ebh(e_values, alpha: float = ALPHA, log: bool = False) -> np.ndarray:
    """e-BH (Wang & Ramdas 2022): which of K hypotheses to reject so that the expected share of wrong rejections
    among the rejected stays at most α·K₀/K (K₀: the true nulls), whatever the dependence between the e-values: the
    k largest, for the largest k with e_(k) ≥ K / (α k). `log`: the values are log e-values (compared in logs)."""
    e = np.asarray(e_values, float)
    if len(e) == 0:
        return np.zeros(0, bool)
    if not log:
        with np.errstate(divide="ignore"):
            e = np.log(e)
    order = np.argsort(-e, kind="stable")
    k = np.arange(1, len(e) + 1)
    ok = e[order] >= np.log(len(e) / (alpha * k))
    keep = np.zeros(len(e), bool)
    if ok.any():
        keep[order[: int(k[ok].max())]] = True
    return keep
