"""Per-token KL to the full cache and the change in perplexity, along a teacher-forced path."""

import numpy as np
import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table
from kvlab.report.noise import floor
from kvlab.stats.intervals import mean_bounds, per_sample

TITLE = "Divergence from the full cache"
QUERIES = ("divergence", "noise_floor")


def with_bounds(div: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """The rows with the bounds of each mean KL over samples (a sample's turns averaged first), blank where too
    few samples bound it; the per-answer lists dropped."""
    low, high = [], []
    for kl, ids in zip(div["kl_each"], div["sample_each"]):
        each = pd.DataFrame({"kl_vs_full": list(kl), "sample_id": list(ids)})
        b = mean_bounds(per_sample(each, ["kl_vs_full"])["kl_vs_full"], rule.kl_min_samples)
        low.append(b.low if np.isfinite(b.high) else np.nan)
        high.append(b.high if np.isfinite(b.high) else np.nan)
    return div.drop(columns=["kl_each", "sample_each"]).assign(kl_low=low, kl_high=high)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        "<p>Per-token KL(full ‖ method) in nats, averaged over the teacher-forced path, and the change in "
        "perplexity on it. On prose the path is the text's true continuation; on question tasks it is the "
        "full cache's own answer, so the KL says how far a method's next-token distribution drifts where "
        "the uncompressed model was going. kl_low, kl_high: one-sided 95% bounds of the mean KL (bootstrap over "
        f"samples; blank under {rule.kl_min_samples} samples).</p>" + table(with_bounds(q["divergence"], rule))
        + "<h3>Noise floor</h3><p>The full cache against itself, against its one pass in the batch of every row of "
        "its own prompt, under two changes that should not matter (change): each full row read one token at a time "
        "as decoding feeds it, along the same path, in a padded batch with other prompts' full rows (on question "
        "tasks the steps its own answer was decoded with, so an answer changes where the one pass's choice leaves "
        "them; on prose a second, stepped pass along the text); and the first samples' full rows (config "
        "<code>dtype_floor</code>) read in one pass by the model loaded in another compute dtype (float32 beside a "
        "bfloat16 run). Their KL and the answers their greedy choice would change are what rounding alone does: a "
        "method's KL or answer change no larger than this is no evidence. Bounds as above; answers_changed with a "
        "95% Wilson interval.</p>" + table(floor(q["noise_floor"], rule))
    )
