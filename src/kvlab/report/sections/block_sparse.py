"""Block-sparse reads post hoc (article §6): MoBA's and Quest's block selection on a model never trained for it,
beside SnapKV evicting to the same share; claim C15."""

import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule, cells
from kvlab.report.html import table, verdict_list
from kvlab.report.verdicts.sparse import reads

TITLE = "Block-sparse reads, post hoc (article §6)"
QUERIES = ("block_reads",)
CLAIMS = [15]
SHOWN = ["model", "shape", "question_mode", "method", "budget", "read_share", "stored_share_bf16", "accuracy",
         "accuracy_low", "accuracy_high", "full_accuracy", "drop_low", "drop_high", "kl_mean_nats", "kl_low", "kl_high",
         "decision", "samples"]


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    share = q["block_reads"]
    if not (share["method_kind"] == "block_sparse").any():
        return "<p>No block_sparse method was configured in this run.</p>"
    c = cells(reads(q["answers"]), rule, by=["model", "shape", "question_mode"])
    per_budget = share.groupby(["model", "method", "budget"], as_index=False)[["read_share", "stored_share_bf16"]].mean()
    c = c.merge(per_budget, on=["model", "method", "budget"], how="left")
    return (
        "<p>NSA and MoBA read a few KV blocks per decode step and are exact because the model was trained to "
        "attend that way. Here the same selection runs on a model trained with full attention: the whole cache "
        "is kept (stored share 1) and each decode step reads the current block and the best-scoring past blocks, "
        "per KV head (MoBA: the query against each block's mean key; Quest: a bound from each page's min and max "
        "keys), so that the step reads the budget's share of the context (read share, block summaries "
        "included). The prompt's tail is read in full, as a prefill. SnapKV at the same budget keeps, and "
        "so reads, the same share, chosen once from the prompt. Accuracy with its Wilson 95% interval, the drop "
        "against the full cache with its paired bounds in points, and on prose the mean per-token KL with its "
        "bounds; n is the number of distinct samples.</p>"
        + verdict_list(verdicts(CLAIMS, q, rule))
        + table(c[[col for col in SHOWN if col in c]])
    )
