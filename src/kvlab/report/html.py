"""The report's HTML pieces, shared by every section: escaping, table cells, tables, charts, sections."""

from __future__ import annotations

import html
import numbers

import altair as alt
import pandas as pd
import vl_convert

alt.data_transformers.disable_max_rows()  # charts are rendered here to static SVG, not shipped as data to a browser


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def cell(value) -> str:
    """One table cell: blank for missing, thousands separators for counts and large numbers."""
    if pd.api.types.is_scalar(value) and pd.isna(value):
        text = ""
    elif isinstance(value, numbers.Integral):
        text = f"{int(value):,}"
    elif isinstance(value, numbers.Real):
        text = f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:,.4g}"
    else:
        text = str(value)
    long = isinstance(value, str) and len(value) > 40
    return f"<td class='long'>{esc(text)}</td>" if long else f"<td>{esc(text)}</td>"


def table(frame: pd.DataFrame) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in frame.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def svg(chart: alt.TopLevelMixin) -> str:
    return vl_convert.vegalite_to_svg(chart.to_dict())


def verdict_list(verdicts: list[tuple[str, str, str]]) -> str:
    return "<ul>" + "".join(f"<li><b>{esc(c)}: {esc(v)}</b> — {esc(e)}</li>" for c, v, e in verdicts) + "</ul>"


def section(title: str, body: str, sql: str | None = None) -> str:
    query = f"<details><summary>query</summary><pre>{esc(sql)}</pre></details>" if sql else ""
    return f"<section><h2>{esc(title)}</h2>{body}{query}</section>"
