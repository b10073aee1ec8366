"""Rule engine_vs_pipeline: the same grid by kvlab's engine and by kvpress's pipeline (wall time, agreement)."""

from kvlab.util.io import log_to
from kvlab.state.jobs import run_settings

log_to(snakemake.log[0])  # noqa: F821

from kvlab.steps.benchmark import engine_vs_pipeline  # noqa: E402

bench = snakemake.params.bench  # noqa: F821
engine_vs_pipeline(
    model_dir=snakemake.input.model_dir,  # noqa: F821
    task=bench["task"],
    task_spec=snakemake.params.task,  # noqa: F821
    context_tokens=int(snakemake.wildcards.ctx),  # noqa: F821
    samples=bench["samples"],
    run=run_settings(snakemake),  # noqa: F821
    out_path=snakemake.output.rows,  # noqa: F821
)
