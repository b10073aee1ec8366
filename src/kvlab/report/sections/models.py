"""The evaluated and calibrated models' cards."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Models"
QUERIES = ("models",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return table(q["models"])
