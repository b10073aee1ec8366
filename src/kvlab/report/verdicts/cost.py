"""C9: each printed figure of the article's cost table against our accounting (cost_article)."""

from __future__ import annotations

import re

import pandas as pd

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
