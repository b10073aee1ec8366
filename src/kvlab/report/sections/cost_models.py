"""The cost accounting for every evaluated model's card."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Cost table for the evaluated models"
QUERIES = ("cost_models",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return table(q["cost_models"])
