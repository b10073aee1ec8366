"""Rule report: results/kvlab.duckdb → results/report.html (self-contained, offline)."""

from kvlab.io import log_to
from kvlab.report.build import build

log_to(snakemake.log[0])  # noqa: F821
build(snakemake.input.db, snakemake.output.html, snakemake.params.title)  # noqa: F821
