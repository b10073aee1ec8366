"""Intervals and the three-outcome decision behind every verdict that compares numbers measured on samples.

- accuracy: a 95% Wilson interval over the answers (scipy.stats.binomtest; partial scores count as their sum).
- a method's accuracy minus the full cache's (the paired drop): a betting confidence sequence over samples
  (kvlab.stats.anytime), valid at every n at once, so it keeps its level however the evaluation job stopped drawing
  prompts (kvlab.steps.evaluate's rounds stop a cell once it is decided), and at a fixed n too. Its bets are tuned to the
  threshold it will be decided at. A sample is the unit: its rows (turns, question modes pooled into one cell)
  are averaged first, so rows of one sample never count as independent draws, and the samples enter in the order
  they were drawn (task, context length, draw), the order the stopping rule saw them.
- prose KL against a threshold θ (decisions and claims), kl_bounds. A mean of an unbounded variable has no
  distribution-free upper bound: one document in a hundred with a KL of 1 nat moves the mean by 0.01 nat and is
  missed by most runs of 60 samples. So the verdict is about two bounded quantities, each with its own betting
  confidence sequence: the **capped mean**, the mean of each sample's KL capped at cap = `ratio` × θ, and the
  **tail share**, the share of samples whose KL exceeds the cap. 'safe' means: capped mean ≤ θ and tail share ≤
  `tail_share` (both upper bounds, one-sided 95%; an intersection of two tests needs no split of α); 'unsafe' means
  the capped mean's lower bound reaches θ, which also bounds the plain mean (capping only lowers a value). Both
  keep their level under early stopping, so prose jobs run in rounds too. Per-token KL is averaged within a sample
  first (its tokens are correlated): an eval row's kl_vs_full already is that mean.
- a shown mean without a threshold (KL in the tables, answer lengths): bootstrap over samples
  (scipy.stats.bootstrap) at a fixed n, descriptive (mean_bounds).
- decide: 'safe' when the one-sided 95% upper bound of the drop (or KL) is at most the threshold, 'unsafe' when
  the lower bound reaches it, else 'inconclusive'. The one-sided 95% bounds together form a two-sided 90% interval.
- power: the smallest mean n samples tell from 0 (z·sd/√n) and the samples a margin needs (⌈(z·sd/margin)²⌉),
  normal approximations from the per-sample spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats

from kvlab.stats.anytime import e_value, samples_to_reach, sequence

LEVEL = 0.95  # every interval's confidence (two-sided for accuracy; one-sided for each bound of a decision)
Z = stats.norm.ppf(LEVEL)  # one-sided z of the decision bounds (1.645)
RESAMPLES = 2000
SEED = 0  # bootstrap draws are seeded: the same rows give the same report


def wilson(correct: float, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Two-sided Wilson interval of a proportion; (nan, nan) without answers."""
    if n == 0:
        return float("nan"), float("nan")
    ci = stats.binomtest(int(round(correct)), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


ORDER = ["task", "context_tokens", "draw"]  # the order samples were drawn in (rows before `draw` existed: sample_id)


def per_sample(rows: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """One row per sample: the mean of `columns` over its rows (turns, question modes), in the order the samples
    were drawn (task, context length, draw index) where the rows say it, else by sample_id."""
    means = rows.groupby("sample_id", sort=True)[columns].mean()
    if all(c in rows for c in ORDER) and rows["draw"].notna().all():
        first = rows.drop_duplicates("sample_id").sort_values([*ORDER, "sample_id"])
        means = means.loc[first["sample_id"]]
    return means


@dataclass(frozen=True)
class Bounds:
    """A mean over n samples with its one-sided 95% lower and upper bounds, and its per-sample spread."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    min_n: int = 0  # fewer samples than this decide nothing (mean_bounds)
    more_of: Callable[[], float] | None = field(default=None, repr=False, compare=False)  # drop_bounds, kl_bounds:
    # about how many more samples like these would decide it (kvlab.stats.anytime), computed when asked
    log_e_safe: float = float("nan")  # drop_bounds, kl_bounds: the logs of the e-values of the tests at the threshold
    log_e_unsafe: float = float("nan")  # (safe, unsafe) at the last sample
    decided_at: int = 0  # drop_bounds: the sample (1-based, in draw order) at which the decision was reached, 0 if open
    over_cap: int = 0  # kl_bounds: samples whose KL exceeded the cap
    tail_high: float = 0.0  # kl_bounds: the upper bound of the share of samples above the cap
    tail_limit: float = 1.0  # kl_bounds: the largest tail share a safe cell may have

    @property
    def e_safe(self) -> float:
        return e_value(self.log_e_safe)

    @property
    def e_unsafe(self) -> float:
        return e_value(self.log_e_unsafe)

    def decide(self, threshold: float) -> str:
        """'safe' (upper bound ≤ threshold, and the tail share's within its limit), 'unsafe' (lower bound ≥
        threshold) or 'inconclusive'."""
        if self.high <= threshold and self.tail_high <= self.tail_limit:
            return "safe"
        return "unsafe" if self.low >= threshold else "inconclusive"

    def n_to_decide(self, threshold: float) -> float:
        """Samples that would decide it in all if the observed ones went on alike: for a drop, n + the betting
        sequence's `more` (also for a KL); for a bootstrap mean the normal approximation n = (z·sd / |mean − threshold|)² (at least
        min_n); inf where the mean sits on the threshold, nan where one sample gives no spread."""
        if self.more_of is not None:
            return self.n + self.more_of()
        gap = abs(self.mean - threshold)
        if not np.isfinite(self.sd):
            return float("nan")
        return max(samples_for(self.sd, gap), self.min_n) if gap > 0 else float("inf")


def detectable(sd: float, n: int) -> float:
    """The smallest mean (e.g. an accuracy drop in points) that n samples of per-sample spread sd tell from 0 at
    one-sided 95%: z·sd/√n, the normal approximation for a paired mean difference — the observed mean at which
    the lower bound reaches 0 (a true effect of that size is detected half the time)."""
    return float(Z * sd / np.sqrt(n))


def samples_for(sd: float, margin: float) -> float:
    """Samples whose one-sided 95% bound lies within `margin` of their mean at per-sample spread sd:
    ⌈(z·sd/margin)²⌉ (normal approximation)."""
    return float(np.ceil((Z * sd / margin) ** 2))


def _bootstrap(data: tuple[np.ndarray, ...], statistic) -> tuple[float, float]:
    res = stats.bootstrap(data, statistic, vectorized=True, confidence_level=2 * LEVEL - 1,
                          n_resamples=RESAMPLES, method="percentile", rng=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def drop_bounds(full: np.ndarray, method: np.ndarray, threshold: float, share: float = 1.0) -> Bounds:
    """Mean per-sample accuracy drop (share × full − method, in points; share 1: the drop vs the full cache) with
    its one-sided 95% bounds from the betting confidence sequence of the per-sample drops (kvlab.stats.anytime), in the
    order given (the order the samples were drawn), its bets tuned to `threshold` (points), the value it is decided
    at. Scores lie in [0, 1], so a drop lies in [−1, share]; no sample decides anything on its own, and a cell that
    never loses an answer is decided safe at 5 points after 66 samples (tests/test_anytime.py)."""
    d = share * np.asarray(full, float) - np.asarray(method, float)
    if len(d) == 0:
        return Bounds(float("nan"), -100.0, 100 * share, 0, float("nan"), more_of=lambda: math.inf)
    s = sequence(d, -1.0, share, threshold / 100)
    decided = [at for at in (s.down_at, s.up_at) if at]
    return Bounds(float(100 * d.mean()), 100 * s.low, 100 * s.high, len(d),
                  float(100 * np.std(d, ddof=1)) if len(d) > 1 else float("nan"),
                  more_of=lambda: s.more, log_e_safe=s.log_e_down, log_e_unsafe=s.log_e_up, decided_at=min(decided, default=0))


TAIL_SHARE = 0.03  # config decision.kl_tail_share's default: the largest share of prose samples above the cap a safe cell
# may have (0.1 before issue 62 let one document in twenty come out ruined: kvlab.tools.kl_tail, docs/statistics.md)


def kl_bounds(values: np.ndarray, threshold: float, ratio: float = 5.0, tail_share: float = TAIL_SHARE) -> Bounds:
    """Per-sample KL (nats) against `threshold` θ, in the order given (draw order): `mean` the plain mean; `low`,
    `high` the one-sided 95% betting bounds (kvlab.stats.anytime) of the capped mean (each sample's KL capped at
    ratio × θ); `tail_high` the upper bound of the share of samples above the cap, `over_cap` their count. Safe
    when high ≤ θ and tail_high ≤ tail_share; unsafe when low ≥ θ (which bounds the plain mean too). The safe test's
    e-value is the smaller of the two tests' (an e-value for either null), decided at the later of their crossings.
    Valid at every n at once, so a job may stop on it (tests/test_anytime.py counts what a cell needs)."""
    x = np.asarray(values, float)
    cap = ratio * threshold
    if not (threshold > 0 and ratio > 1 and 0 < tail_share < 1):
        raise ValueError(f"a KL threshold must be > 0, its cap ratio > 1 and its tail share in (0, 1); got threshold "
                         f"{threshold}, ratio {ratio}, tail share {tail_share}")
    if np.isnan(x).any():
        raise ValueError(f"per-sample KL must be numbers; got NaN at sample {int(np.argmax(np.isnan(x))) + 1}")
    if len(x) == 0:
        return Bounds(float("nan"), 0.0, cap, 0, float("nan"), more_of=lambda: math.inf, tail_high=1.0,
                      tail_limit=tail_share)
    over = x > cap
    s = sequence(np.clip(x, 0.0, cap), 0.0, cap, threshold)  # KL ≥ 0; rounding can leave −1e-7
    t = sequence(over.astype(float), 0.0, 1.0, tail_share)
    safe_at = max(s.down_at, t.down_at) if s.down_at and t.down_at else 0

    def more() -> float:
        return s.more if t.down_at or s.up_at else max(s.more, t.more)

    return Bounds(float(x.mean()), s.low, s.high, len(x), float(np.std(x, ddof=1)) if len(x) > 1 else float("nan"),
                  more_of=more, log_e_safe=min(s.log_e_down, t.log_e_down), log_e_unsafe=s.log_e_up,
                  decided_at=min([at for at in (safe_at, s.up_at) if at], default=0), over_cap=int(over.sum()),
                  tail_high=t.high, tail_limit=tail_share)


def lossless_samples(tolerance_points: float, e: float = 20.0) -> int:
    """Samples a cell that loses no answer needs before its drop's e-value reaches `e` (20 = 1/α: decided safe)."""
    return samples_to_reach(0.0, -1.0, 1.0, tolerance_points / 100, e)


def quiet_kl_samples(threshold: float, ratio: float = 5.0, tail_share: float = TAIL_SHARE, e: float = 20.0) -> int:
    """Samples a prose cell whose KL stays 0 needs before both of its safe tests' e-values reach `e`."""
    return max(samples_to_reach(0.0, 0.0, ratio * threshold, threshold, e), samples_to_reach(0.0, 0.0, 1.0, tail_share, e))


def mean_bounds(values: np.ndarray, min_samples: int) -> Bounds:
    """A per-sample mean (KL in nats in a table, an answer's length) with its bootstrap bounds, descriptive (a
    threshold's decision on KL: kl_bounds). KL has no upper limit, so a few samples
    cannot bound its mean: under `min_samples` the bounds are (−inf, inf), i.e. undecided."""
    x = np.asarray(values, float)
    sd = float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")
    if len(x) < min_samples:
        return Bounds(float(x.mean()) if len(x) else float("nan"), -np.inf, np.inf, len(x), sd, min_samples)
    low, high = _bootstrap((x,), lambda a, axis=-1: np.mean(a, axis=axis))
    return Bounds(float(x.mean()), low, high, len(x), sd, min_samples)


def at_most(b: Bounds, threshold: float) -> str:
    """A claim 'mean ≤ threshold': holds when the upper bound is, does not hold when the lower bound exceeds it."""
    return "holds" if b.high <= threshold else "does not hold" if b.low > threshold else "inconclusive"


def at_least(b: Bounds, threshold: float) -> str:
    """A claim 'mean ≥ threshold': holds when the lower bound is, does not hold when the upper bound is below."""
    return "holds" if b.low >= threshold else "does not hold" if b.high < threshold else "inconclusive"


def all_of(verdicts: list[str]) -> str:
    """Claims joined by 'and': one that does not hold decides; all must hold to hold; else inconclusive."""
    return "does not hold" if "does not hold" in verdicts else "holds" if all(v == "holds" for v in verdicts) else "inconclusive"


def shown(b: Bounds, unit: str, digits: str = ".3g") -> str:
    """'mean unit [low, high], n=…' (bounds as 'too few samples to bound it' under min_n; a KL's bounds are its
    capped mean's, followed by its samples above the cap and the tail share's upper bound)."""
    bounds = f"[{b.low:{digits}}, {b.high:{digits}}]" if np.isfinite(b.high) else "(too few samples to bound it)"
    if b.tail_limit < 1:
        bounds = (f"capped mean {bounds}; {b.over_cap} of {b.n} documents above the cap, share ≤ {b.tail_high:.1%} "
                  f"(limit {b.tail_limit:.1%})")
    return f"{b.mean:{digits}}{unit} {bounds}, n={b.n}"
