"""The KV bytes one decode step reads: NSA and MoBA against full attention (article §6), and the context where the
KV reads exceed the weight reads (§8.3), computed by kvlab.kernels.reads; claims C13 and C14."""

import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule
from kvlab.report.html import table, verdict_list

TITLE = "KV bytes read per decode step (article §6 and §8.3, computed)"
QUERIES = ("cost_reads", "cost_crossover")
CLAIMS = [13, 14]


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return (
        "<p>Computed from the formula and each model's geometry, not measured: a decode step reads every cached "
        "key and value under full attention; NSA reads its compressed tokens, its selected blocks and its window "
        "(each branch with its own keys and values, counted separately as the NSA paper does); MoBA reads the "
        "current block and the best of the past ones, scored by one cached mean key per block. Sliding-window "
        "layers read their window under every method. Llama-3.1-70B has Llama-3-70B's shapes (the sparse rows "
        "price its cache as if it had been trained with NSA or MoBA).</p>"
        + verdict_list(verdicts(CLAIMS, q, rule))
        + table(q["cost_reads"])
        + "<h3>Where KV reads exceed weight reads</h3><p>A decode step of one sequence reads every weight once "
        "(parameters × bits / 8; 4-bit group scales not counted) and the whole KV cache (the cost table's bytes, "
        "int4 with its metadata and BF16 residual window); the shortest context at which the cache is the larger. "
        "With several sequences decoded together the KV bytes add up and the weights do not.</p>"
        + table(q["cost_crossover"])
    )
