"""The article's §8 cost table recomputed by kvlab.kernels.accounting, its printed figures beside ours."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Cost table (article §8, recomputed)"
QUERIES = ("cost_article",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        "<p>Bytes per token = 2 × layers × KV heads × head_dim × bytes per element, plus group metadata "
        "for integer schemes; the article's printed figure beside ours.</p>" + table(q["cost_article"])
    )
