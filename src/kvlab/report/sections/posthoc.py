"""Structures a model is trained for, applied post hoc (article §5–§6): MoBA's and Quest's block-sparse reads and
CLA's cross-layer sharing on a model trained with full attention and a K/V per layer, beside SnapKV; C15, C16."""

import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule, cells
from kvlab.report.html import table, verdict_list
from kvlab.report.verdicts.posthoc import KINDS, rows

TITLE = "Trained-for structures, applied post hoc (article §5–§6)"
QUERIES = ("posthoc_reads",)
CLAIMS = [15, 16]
SHOWN = ["model", "shape", "question_mode", "method", "budget", "read_share", "stored_share_bf16", "accuracy",
         "accuracy_low", "accuracy_high", "full_accuracy", "full_low", "full_high", "drop_low", "drop_high", "kl_mean_nats", "kl_low", "kl_high",
         "decision", "samples"]


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    share = q["posthoc_reads"]
    if not share["method_kind"].isin(KINDS).any():
        return "<p>No block_sparse or cross_layer method was configured in this run.</p>"
    c = cells(rows(q["answers"]), rule, by=["model", "shape", "question_mode"])
    per_budget = share.groupby(["model", "method", "budget"], as_index=False)[["read_share", "stored_share_bf16"]].mean()
    c = c.merge(per_budget, on=["model", "method", "budget"], how="left")
    return (
        "<p>NSA and MoBA read a few KV blocks per decode step, and CLA shares one K/V between adjacent layers; both "
        "are exact because the model was trained that way. Here they run on a model trained with full attention "
        "and a K/V projection per layer. <b>Block-sparse reads</b> keep the whole cache (stored share 1): each "
        "decode step reads the current block and the best-scoring past blocks per KV head (MoBA: the query "
        "against each block's mean key; Quest: a bound from each page's min and max keys), the budget's share of "
        "the context (read share, block summaries included); the prompt's tail is read in full, as a prefill. "
        "<b>Cross-layer sharing</b> (cla: every second layer reads the layer below's keys and values, for the "
        "prompt and each new token) halves the stored bytes. SnapKV at a budget keeps, and so reads, that share, "
        "chosen once from the prompt. Accuracy with its Wilson 95% interval, the drop against the full cache "
        "with its paired bounds in points, on prose the mean per-token KL with its bounds; samples: distinct "
        "prompts.</p>"
        + verdict_list(verdicts(CLAIMS, q, rule))
        + table(c[[col for col in SHOWN if col in c]])
    )
