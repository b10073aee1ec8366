"""Bytes held by this run's real caches beside the accounting formula."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Measured cache bytes vs the formula"
QUERIES = ("bytes_measured",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        "<p>Bytes summed from the stored key/value tensors after compression, beside "
        "kvlab.kernels.accounting for the same token count and dtype.</p>" + table(q["bytes_measured"])
    )
