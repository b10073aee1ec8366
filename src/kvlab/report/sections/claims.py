"""Every claim of the study with its verdict (the claims table, kvlab.report.claims)."""

import pandas as pd

from kvlab.report.claims import claims_frame
from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Claims"
QUERIES = ()


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return ("<p>Each claim of the study with its verdict on this run, the number behind it and the "
            "rule used; `query` names the SQL (shown under the sections below) whose rows decide it. A claim about "
            "sampled answers or KL holds or does not hold only when its one-sided 95% bounds say so (paired "
            "bootstrap over samples); otherwise it is inconclusive, with n and the bounds in its evidence.</p>"
            + table(claims_frame(q, rule)))
