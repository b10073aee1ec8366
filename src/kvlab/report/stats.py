"""Intervals and the three-outcome decision behind every verdict that compares numbers measured on samples.

- accuracy: a 95% Wilson interval over the answers (scipy.stats.binomtest; partial scores count as their sum).
- a method's accuracy minus the full cache's, and prose KL: bootstrap over samples (scipy.stats.bootstrap).
  A sample is the unit: its rows (turns, question modes pooled into one cell) are averaged first, so rows of
  one sample never count as independent draws, and a method and the full cache are resampled together
  (paired), as every method answers the same prompts. Per-token KL is averaged within a sample first for the
  same reason (its tokens are correlated): an eval row's kl_vs_full already is that mean.
- decide: 'safe' when the one-sided 95% upper bound of the drop (or KL) is at most the threshold, 'unsafe' when
  the lower bound exceeds it, else 'inconclusive'. The one-sided 95% bounds are the ends of the two-sided 90%
  bootstrap interval.
- power: the smallest mean n samples tell from 0 (z·sd/√n) and the samples a margin needs (⌈(z·sd/margin)²⌉),
  normal approximations from the per-sample spread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

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


def per_sample(rows: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """One row per sample: the mean of `columns` over its rows (turns, question modes)."""
    return rows.groupby("sample_id", sort=True)[columns].mean()


@dataclass(frozen=True)
class Bounds:
    """A mean over n samples with its one-sided 95% lower and upper bounds, and its per-sample spread."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    min_n: int = 0  # fewer samples than this decide nothing (mean_bounds)

    def decide(self, threshold: float) -> str:
        """'safe' (upper bound ≤ threshold), 'unsafe' (lower bound > threshold) or 'inconclusive'."""
        if self.high <= threshold:
            return "safe"
        return "unsafe" if self.low > threshold else "inconclusive"

    def n_to_decide(self, threshold: float) -> float:
        """Samples that would decide it if the observed mean and spread held: normal approximation,
        n = (z·sd / |mean − threshold|)² (at least min_n); inf where the mean sits on the threshold, nan where one
        sample gives no spread."""
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


def _bootstrap(data: tuple[np.ndarray, ...], statistic, paired: bool) -> tuple[float, float]:
    res = stats.bootstrap(data, statistic, paired=paired, vectorized=True, confidence_level=2 * LEVEL - 1,
                          n_resamples=RESAMPLES, method="percentile", rng=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def drop_bounds(full: np.ndarray, method: np.ndarray, share: float = 1.0) -> Bounds:
    """Mean per-sample accuracy drop (share × full − method, in points; share 1: the drop vs the full cache)
    with its paired bootstrap bounds.

    Scores lie in [0, 1], so a sample that showed no disagreement still leaves room for some: one pseudo-sample
    lost and one gained are added before resampling (the idea of Agresti & Min's adjustment for paired
    proportions). Without them n = 2 identical answers would give the interval [0, 0]; with them it is wide, and
    it narrows as 1/√n."""
    f = np.append(np.asarray(full, float), [1.0, 0.0])
    m = np.append(np.asarray(method, float), [0.0, 1.0])
    low, high = _bootstrap((f, m), lambda a, b, axis=-1: np.mean(share * a - b, axis=axis), paired=True)
    d = 100 * (share * np.asarray(full, float) - np.asarray(method, float))
    return Bounds(float(d.mean()), 100 * low, 100 * high, len(d), float(100 * np.std(share * f - m, ddof=1)))


def mean_bounds(values: np.ndarray, min_samples: int) -> Bounds:
    """A per-sample mean (e.g. KL in nats) with its bootstrap bounds. KL has no upper limit, so a few samples
    cannot bound its mean: under `min_samples` the bounds are (−inf, inf), i.e. undecided."""
    x = np.asarray(values, float)
    sd = float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")
    if len(x) < min_samples:
        return Bounds(float(x.mean()) if len(x) else float("nan"), -np.inf, np.inf, len(x), sd, min_samples)
    low, high = _bootstrap((x,), lambda a, axis=-1: np.mean(a, axis=axis), paired=False)
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
    """'mean unit [low, high], n=…' (bounds as 'too few samples to bound it' under min_n)."""
    bounds = f"[{b.low:{digits}}, {b.high:{digits}}]" if np.isfinite(b.high) else "(too few samples to bound it)"
    return f"{b.mean:{digits}}{unit} {bounds}, n={b.n}"
