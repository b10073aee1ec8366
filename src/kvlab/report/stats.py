"""Intervals and the three-outcome decision behind every verdict that compares numbers measured on samples.

- accuracy: a 95% Wilson interval over the answers (scipy.stats.binomtest; partial scores count as their sum).
- a method's accuracy minus the full cache's (the paired drop): a betting confidence sequence over samples
  (kvlab.anytime), valid at every n at once, so it keeps its level however the evaluation job stopped drawing
  prompts (kvlab.evaluate's rounds stop a cell once it is decided), and at a fixed n too. Its bets are tuned to the
  threshold it will be decided at. A sample is the unit: its rows (turns, question modes pooled into one cell)
  are averaged first, so rows of one sample never count as independent draws, and the samples enter in the order
  they were drawn (task, context length, draw), the order the stopping rule saw them.
- prose KL against a threshold (decisions and claims): the betting confidence sequence of the per-sample KL clipped
  to [0, cap], cap = `ratio` × the threshold (kl_bounds). Clipping only lowers a value, so the lower bound (behind
  'unsafe') holds for any KL. A mean of an unbounded variable has no distribution-free upper bound, so the upper
  bound (behind 'safe') assumes each sample's KL is at most the cap; the samples check it, and a cell with one above
  it keeps no upper bound (it can be unsafe or inconclusive, never safe). Both keep their level under early
  stopping, so prose jobs run in rounds too. Per-token KL is averaged within a sample first (its tokens are
  correlated): an eval row's kl_vs_full already is that mean.
- a shown mean without a threshold (KL in the tables, answer lengths): bootstrap over samples
  (scipy.stats.bootstrap) at a fixed n, descriptive (mean_bounds).
- decide: 'safe' when the one-sided 95% upper bound of the drop (or KL) is at most the threshold, 'unsafe' when
  the lower bound reaches it, else 'inconclusive'. The one-sided 95% bounds together form a two-sided 90% interval.
- power: the smallest mean n samples tell from 0 (z·sd/√n) and the samples a margin needs (⌈(z·sd/margin)²⌉),
  normal approximations from the per-sample spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from kvlab.anytime import sequence

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
    more: float | None = None  # drop_bounds: about how many more samples like these would decide it (kvlab.anytime)
    e_safe: float = float("nan")  # drop_bounds: the e-values of the tests at the threshold (safe, unsafe), at the
    e_unsafe: float = float("nan")  # last sample
    decided_at: int = 0  # drop_bounds: the sample (1-based, in draw order) at which the decision was reached, 0 if open
    over_cap: int = 0  # kl_bounds: samples whose KL exceeded the cap (then no upper bound)

    def decide(self, threshold: float) -> str:
        """'safe' (upper bound ≤ threshold), 'unsafe' (lower bound ≥ threshold) or 'inconclusive'."""
        if self.high <= threshold:
            return "safe"
        return "unsafe" if self.low >= threshold else "inconclusive"

    def n_to_decide(self, threshold: float) -> float:
        """Samples that would decide it in all if the observed ones went on alike: for a drop, n + the betting
        sequence's `more` (also for a KL); for a bootstrap mean the normal approximation n = (z·sd / |mean − threshold|)² (at least
        min_n); inf where the mean sits on the threshold, nan where one sample gives no spread."""
        if self.more is not None:
            return self.n + self.more
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
    its one-sided 95% bounds from the betting confidence sequence of the per-sample drops (kvlab.anytime), in the
    order given (the order the samples were drawn), its bets tuned to `threshold` (points), the value it is decided
    at. Scores lie in [0, 1], so a drop lies in [−1, share]; no sample decides anything on its own, and a cell that
    never loses an answer is decided safe at 5 points after 65 samples."""
    d = share * np.asarray(full, float) - np.asarray(method, float)
    if len(d) == 0:
        return Bounds(float("nan"), -100.0, 100 * share, 0, float("nan"), more=math.inf)
    s = sequence(d, -1.0, share, threshold / 100)
    decided = [at for at in (s.down_at, s.up_at) if at]
    return Bounds(float(100 * d.mean()), 100 * s.low, 100 * s.high, len(d),
                  float(100 * np.std(d, ddof=1)) if len(d) > 1 else float("nan"),
                  more=s.more, e_safe=s.e_down, e_unsafe=s.e_up, decided_at=min(decided, default=0))


def kl_bounds(values: np.ndarray, threshold: float, ratio: float = 5.0) -> Bounds:
    """Mean per-sample KL (nats) with its one-sided 95% bounds from the betting confidence sequence (kvlab.anytime)
    of the KL clipped to [0, ratio × threshold], in the order given (draw order), its bets tuned to `threshold`.
    The lower bound holds for any KL; the upper bound assumes every sample's KL is at most the cap, and is inf once
    a sample exceeds it. Valid at every n at once, so a job may stop on it. With ratio 5, a cell whose KL stays
    near 0 is decided safe after 15 samples; one at 0.74 × the threshold (4-bit KIVI on prose) after about 50."""
    x = np.asarray(values, float)
    cap = ratio * threshold
    if not (threshold > 0 and ratio > 1):
        raise ValueError(f"a KL threshold must be > 0 and its cap ratio > 1; got threshold {threshold}, ratio {ratio}")
    if np.isnan(x).any():
        raise ValueError(f"per-sample KL must be numbers; got NaN at sample {int(np.argmax(np.isnan(x))) + 1}")
    over = int((x > cap).sum())
    if len(x) == 0:
        return Bounds(float("nan"), 0.0, math.inf, 0, float("nan"), more=math.inf)
    s = sequence(np.clip(x, 0.0, cap), 0.0, cap, threshold)  # KL ≥ 0; rounding can leave −1e-7
    down_at = 0 if over else s.down_at
    return Bounds(float(x.mean()), s.low, math.inf if over else s.high, len(x),
                  float(np.std(x, ddof=1)) if len(x) > 1 else float("nan"),
                  more=math.inf if over and not s.up_at else s.more, e_safe=math.nan if over else s.e_down,
                  e_unsafe=s.e_up, decided_at=min([at for at in (down_at, s.up_at) if at], default=0), over_cap=over)


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
    """'mean unit [low, high], n=…' (bounds as 'too few samples to bound it' under min_n; a KL with samples above
    its cap shows its lower bound alone)."""
    if b.over_cap:
        bounds = f"[{b.low:{digits}}, no upper bound: {b.over_cap} samples above the cap]"
    else:
        bounds = f"[{b.low:{digits}}, {b.high:{digits}}]" if np.isfinite(b.high) else "(too few samples to bound it)"
    return f"{b.mean:{digits}}{unit} {bounds}, n={b.n}"
