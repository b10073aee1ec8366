"""What the evaluation cost: rows per second per job, where the engine's time went, and how many answers were
verified instead of decoded."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table
from kvlab.stats.intervals import wilson

TITLE = "Evaluation cost"
QUERIES = ("eval_cost", "verification")


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    ver = q["verification"]
    if len(ver):
        low, high = zip(*(wilson(int(k), int(n)) for k, n in zip(ver["follow_full"], ver["rows"])))
        ver = ver.assign(share_low=low, share_high=high)
    return (
        "<p>Each evaluate job's rows, its wall time (Snakemake's benchmark of the job) and rows per second, "
        "and the engine's own seconds by phase, summed over the job. The full cache's answers are decoded for "
        "several samples at once; every row is then teacher-forced along that answer in one pass (quantized "
        "rows too, read as if token by token), and only the rows whose greedy choice leaves it somewhere are "
        "decoded step by step (<code>diverged_at</code>). noise_s: the full row's second pass, one token at a "
        "time, that measures the noise floor; dtype_noise_s: the measured full rows read again by the model loaded "
        "in the other compute dtype (config <code>dtype_floor</code>; loading it is in wall_s only), the dtype's "
        "noise floor (divergence section).</p>" + table(q["eval_cost"])
        + "<h3>Answers verified instead of decoded</h3><p>Rows of question tasks whose choice follows the full "
        "cache's answer at every position, with a 95% Wilson interval. On the full row itself, a "
        "divergence compares its one-pass choice with its own step-by-step decoding: a near-tie that "
        "rounding flips, the engine's numerical noise floor for answers.</p>" + table(ver)
    )
