"""Every claim of the study with its verdict (the claims table, kvlab.report.claims)."""

import pandas as pd

from kvlab.report.claims import claims_frame
from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Claims"
QUERIES = ()


VERDICTS = ("holds", "does not hold", "inconclusive", "not measured")


def tally(frame: pd.DataFrame) -> str:
    """'12 verdicts: 7 hold, 1 does not hold, 3 inconclusive, 1 not measured' (a claim may give one verdict per model
    or subject)."""
    counts = frame["verdict"].value_counts()
    return f"{len(frame)} verdicts: " + ", ".join(f"{counts.get(v, 0)} {'hold' if v == 'holds' else v}" for v in VERDICTS)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    frame = claims_frame(q, rule)
    return ("<p>Each claim of the study with its verdict on this run, the number behind it and the "
            "rule used; `query` names the SQL (shown under the sections below) whose rows decide it. A claim about "
            "sampled answers or KL holds or does not hold only when its one-sided 95% bounds say so (accuracy "
            "drops: the betting confidence sequence over paired samples, valid under early stopping; KL against a "
            "threshold: the same sequence over the per-sample KL clipped to a range, whose upper bound assumes no "
            "sample exceeds it, and a sample that does leaves no upper bound; the eviction claim on sinks, a difference "
            "of KLs: bootstrap over samples at a fixed n); otherwise it is inconclusive, with n and the bounds in its evidence.</p>"
            f"<p><b>{tally(frame)}.</b></p>" + table(frame))
