"""Per-token KL to the full cache and the change in perplexity, along a teacher-forced path."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Divergence from the full cache"
QUERIES = ("divergence",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        "<p>Per-token KL(full ‖ method) in nats, averaged over the teacher-forced path, and the change in "
        "perplexity on it. On prose the path is the text's true continuation; on question tasks it is the "
        "full cache's own answer, so the KL says how far a method's next-token distribution drifts where "
        "the uncompressed model was going.</p>" + table(q["divergence"])
    )
