"""The task suite as generated for this run, with what each task kind asks."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table

TITLE = "Task suite"
QUERIES = ("tasks",)

TASK_NOTE = (
    "<p>Every sample is generated with a seed and fitted to its context length with the model's own tokenizer "
    "(chat template included). niah: needles in noise sentences or King James prose (multi-key: distractor "
    "needles; multi-value: every value of one key; multi-query: several keys; question first: the question "
    "before the document). recency: the needle in the last tokens. variable_tracking: chains of variable "
    "assignments (multi-hop). multi_turn: a second question about another needle on the cache compressed "
    "for the first (turn 2). common_words / frequent_words: aggregation over redundant input. arithmetic: "
    "short word problems, scored by the last number. continuation: true prose teacher-forced, KL only.</p>"
)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return TASK_NOTE + table(q["tasks"])
