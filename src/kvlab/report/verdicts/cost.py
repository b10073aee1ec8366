"""C9: each printed figure of the article's cost table against our accounting (cost_article). C13, C14: the
article's read figures (NSA's 64K reads, the KV-over-weights crossover) against the read accounting (cost_reads,
cost_crossover). All three are exact computations from the formula and the model geometry, not measurements."""

from __future__ import annotations

import re

import pandas as pd

from kvlab.kernels.accounting import LLAMA_31_70B

COMPUTED = "Computed from the formula and the model geometry, not measured."

UNITS = {"KB": (1024, 1000), "MB": (1024**2, 1e6), "GB": (1024**3, 1e9)}  # the article's units, binary or decimal


def matches(printed: str, exact: float) -> bool:
    """Whether `printed` (e.g. '12.5 GB + 40 MB', '≈3.1 GB', '320 KB/token') gives `exact` bytes' first term to
    its printed precision, reading the unit as binary or decimal ('≈' allows one unit in the last digit)."""
    m = re.search(r"([\d.]+)\s*(KB|MB|GB)", printed)
    if m is None:
        return False
    value, unit = m.group(1), m.group(2)
    decimals = len(value.split(".")[1]) if "." in value else 0
    slack = 10 ** -decimals if "≈" in printed else 0
    return any(abs(round(exact / base, decimals) - float(value)) <= slack + 1e-9 for base in UNITS[unit])


def c9(q: dict, t) -> list[tuple[str, str, str]]:
    """Every printed figure reproduced, in the article's own convention (the `article_view` total, per-token
    bytes)."""
    costs: pd.DataFrame = q["cost_article"]
    rows = costs[costs["article_printed"].notna()]
    if rows.empty:
        return [("", "not measured", "no article rows in the cost table")]
    off = []
    for r in rows.itertuples():
        if not matches(r.article_printed, r.article_view):
            off.append(f"{r.model} {r.scheme}: printed {r.article_printed}, computed {r.total_human} ({r.article_view / 1e9:.2f} GB decimal)")
        if isinstance(r.article_printed_per_token, str) and not matches(r.article_printed_per_token, r.bytes_per_token):
            off.append(f"{r.model} {r.scheme}: printed {r.article_printed_per_token}, computed {r.bytes_per_token:,} B/token")
    n = len(rows) + int(rows["article_printed_per_token"].notna().sum())
    evidence = f"{n - len(off)} of {n} printed figures reproduced to their printed precision"
    return [("", "holds" if not off else "does not hold", evidence + (": off — " + "; ".join(off) if off else "") + ".")]


def c13(q: dict, t) -> list[tuple[str, str, str]]:
    """NSA's fewer KV bytes read than full attention at the article's context, on Llama-3.1-70B's geometry, against
    the article's ratio; MoBA's beside it (the article prints no figure for MoBA alone)."""
    reads: pd.DataFrame = q["cost_reads"]
    at = reads[(reads["model"] == LLAMA_31_70B.name) & (reads["context_tokens"] == t.context)].set_index("method")
    if "nsa" not in at.index:
        return [("", "not measured", f"no NSA row at {t.context:,} tokens; add it to report.sparse_reads.context_tokens")]
    nsa = at.loc["nsa"]
    ok = abs(nsa["fewer_bytes_than_full"] - t.ratio) <= t.slack
    moba = (f"; MoBA reads {at.loc['moba', 'read_human']} ({at.loc['moba', 'read_per_layer_and_kv_head']}), "
            f"{at.loc['moba', 'fewer_bytes_than_full']:.2f}× fewer" if "moba" in at.index else "")
    return [("", "holds" if ok else "does not hold",
             f"at {t.context:,} tokens on {LLAMA_31_70B.name}'s geometry a decode step reads "
             f"{at.loc['full', 'read_human']} with full attention, {nsa['read_human']} with NSA "
             f"({nsa['read_per_layer_and_kv_head']} per layer and KV head): {nsa['fewer_bytes_than_full']:.2f}× fewer"
             f"{moba}. {COMPUTED}")]


def c14(q: dict, t) -> list[tuple[str, str, str]]:
    """The shortest context whose KV reads exceed the weights', on Llama-3-70B, for every weight × KV format: holds
    when one of them lies within the tolerance of the article's figure."""
    rows: pd.DataFrame = q["cost_crossover"]
    rows = rows[(rows["model"] == LLAMA_31_70B.name) & rows["crossover_tokens"].notna()]
    if rows.empty:
        return [("", "not measured", f"no {LLAMA_31_70B.name} rows in the crossover table")]
    listed = "; ".join(f"{r.weight_format} weights, {r.kv_scheme} KV: {int(r.crossover_tokens):,}" for r in rows.itertuples())
    near = rows.loc[(rows["crossover_tokens"] / t.context - 1).abs().idxmin()]
    ok = abs(near["crossover_tokens"] / t.context - 1) <= t.tolerance
    return [("", "holds" if ok else "does not hold",
             f"crossover context per sequence ({listed} tokens); the nearest, {near['weight_format']} weights with "
             f"{near['kv_scheme']} KV, is {near['crossover_tokens'] / t.context:.2f}× the article's {t.context:,}. "
             f"KV reads grow with the number of sequences decoded together and the weights are read once per step, "
             f"so that crossover falls to {t.context:,} at about {near['crossover_tokens'] / t.context:.1f} "
             f"sequences. {COMPUTED}")]
