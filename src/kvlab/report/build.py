"""results/report.html: one self-contained page from results/kvlab.duckdb.

Charts are Altair specs rendered to inline SVG with vl-convert, so the page needs no script and no
network. Every table and chart comes from a named query in queries.sql, shown under its section. The sections
(kvlab.report.sections) each write their part; this module runs the queries and assembles the page.
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

import duckdb
import pandas as pd

from kvlab.util.io import atomic_path
from kvlab.report.decision import Rule, annotate
from kvlab.report.html import esc, section
from kvlab.report.sections import SECTIONS, accuracy, quant, verdict_grid

CSS = """
body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
table{display:block;overflow-x:auto;border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}pre{background:#f7f7f7;padding:.6em;font-size:12px;overflow:auto}
details{margin:.3em 0 1em}td.long{text-align:left;min-width:28em;font-size:12px}section{margin-bottom:2em}.note{color:#555;font-size:13px}
.wide{overflow-x:auto;max-width:100%}
"""

# the key figures also written as files (for snakemake --report): name → its section's figure(q, rule)
FIGURES = {"decision_grid": verdict_grid.figure, "accuracy_vs_kv_bytes": accuracy.figure, "kl_vs_bits": quant.figure}


def load_queries() -> dict[str, str]:
    text = files("kvlab.report").joinpath("queries.sql").read_text()
    blocks = re.split(r"^-- name: (\w+)\n", text, flags=re.M)[1:]
    return {name: sql.strip() for name, sql in zip(blocks[::2], blocks[1::2])}


def run(con: duckdb.DuckDBPyConnection, name: str, sql: str, db_path) -> pd.DataFrame:
    """One named query's rows; a query the database cannot answer (e.g. one collected before a column existed)
    fails with one line naming the query."""
    try:
        return con.execute(sql).df()
    except duckdb.Error as error:
        raise RuntimeError(f"{db_path}: query '{name}' of queries.sql failed: {str(error).splitlines()[0]} (a "
                           f"database from an older kvlab? rerun the jobs that make it, e.g. --forcerun evaluate)") from None


def build(db_path: str | Path, out_path: str | Path, title: str, figures: dict[str, str | Path] | None = None,
          rule: Rule = Rule()) -> None:
    """Write the report page; with `figures` (name in FIGURES → path), also each key figure as an SVG file."""
    queries = load_queries()
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        q = {name: run(con, name, sql, db_path) for name, sql in queries.items()}
    finally:
        con.close()
    q["answers"] = annotate(q["answers"], rule)  # the table's e-BH, once over every job cell: each section prints it
    prov = dict(zip(q["provenance"]["key"], q["provenance"]["value"]))
    parts = [
        f"<h1>{esc(title)}</h1>",
        f"<p class='note'>Generated from results/kvlab.duckdb · config {esc(prov.get('config_hash'))} · "
        f"preset {esc(prov.get('preset'))} · commit {esc(prov.get('git_commit', '')[:12])}</p>",
    ]
    for s in SECTIONS:
        parts.append(section(s.TITLE, s.body(q, rule), "\n\n".join(queries[n] for n in s.QUERIES) or None))
    page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>{''.join(parts)}</body></html>"
    )
    for name, path in (figures or {}).items():
        with atomic_path(path) as tmp:
            tmp.write_text(FIGURES[name](q, rule), encoding="utf-8")
    with atomic_path(out_path) as tmp:
        tmp.write_text(page, encoding="utf-8")
