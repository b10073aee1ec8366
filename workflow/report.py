"""Rule report: results/kvlab.duckdb → results/report.html (self-contained, offline) and the key figures as SVG."""

from kvlab.util.io import log_to
from kvlab.report.build import FIGURES, build
from kvlab.report.decision import Rule

log_to(snakemake.log[0])  # noqa: F821
figures = {name: getattr(snakemake.output, name) for name in FIGURES}  # noqa: F821
rule = Rule(**snakemake.params.decision)  # noqa: F821
build(snakemake.input.db, snakemake.output.html, snakemake.params.title, figures, rule)  # noqa: F821
