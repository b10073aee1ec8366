"""The measured noise floors (the `noise_floor` query): the full cache against itself under a change that should not
matter, per model, compute dtype and change: read one token at a time in a padded batch of other prompts' full
rows (on question tasks the steps of its own decoding), or read in one pass by the model in another compute dtype (config `dtype_floor`), each against
its one pass in the batch of every row, with the same intervals as any other KL and answer share
(kvlab.stats.intervals). Shown beside every KL claim and in the divergence section."""

from __future__ import annotations

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.stats.intervals import mean_bounds, per_sample, shown, wilson

KEYS = ["model", "dtype", "change"]


def _groups(noise: pd.DataFrame, rule: Rule):
    """(model, dtype, change, its rows, bounds of the mean per-token KL over samples) per floor; the batch floor
    first, then the other dtype's."""
    for (model, dtype, change), g in noise.groupby(KEYS, sort=False):
        yield model, dtype, change, g, mean_bounds(per_sample(g, ["noise_kl"])["noise_kl"], rule.kl_min_samples)


def _changed(g: pd.DataFrame) -> tuple[int, int, float, float]:
    """Scored answers, how many the change changes, and the 95% Wilson interval of that share."""
    scored = g[g["scored"]]
    k = int(scored["changed"].sum())
    return len(scored), k, *wilson(k, len(scored))


def floor(noise: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """Per (model, dtype, change): samples, the mean per-token KL with its bounds (bootstrap over samples, a sample's
    turns averaged first), the largest per-token KL, and how many scored answers the change changes, with a 95%
    Wilson interval."""
    columns = [*KEYS, "samples", "kl_mean_nats", "kl_low", "kl_high", "kl_max_nats", "answers", "answers_changed",
               "changed_low", "changed_high"]
    return pd.DataFrame([(model, dtype, change, b.n, b.mean, b.low, b.high, g["noise_kl_max"].max(), *_changed(g))
                         for model, dtype, change, g, b in _groups(noise, rule)], columns=columns)


def floor_text(q: dict, rule: Rule) -> str:
    """One sentence to follow a KL claim's evidence, per model, dtype and change; '' when the run measured none."""
    each = []
    for model, dtype, change, g, b in _groups(q["noise_floor"], rule):
        n, k, low, high = _changed(g)
        changed = f"{k}/{n} answers changed [{low:.0%}, {high:.0%}]" if n else "no scored answers"
        each.append(f"{model} ({dtype}), {change}: KL {shown(b, ' nat')}, max {g['noise_kl_max'].max():.3g}; {changed}")
    if not each:
        return ""
    return " Noise floor (the full cache against its own one pass): " + "; ".join(each) + "."
