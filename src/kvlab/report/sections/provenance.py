"""What produced this report, and the wall time per rule and job."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Provenance"
QUERIES = ("provenance", "rule_times", "timings")


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        table(q["provenance"]) + "<h3>Wall time per rule</h3>" + table(q["rule_times"])
        + "<h3>Wall time per job</h3>" + table(q["timings"])
    )
