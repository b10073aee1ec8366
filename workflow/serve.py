"""Rule serve: one model × task × context length through a serving engine's KV caches → results/eval/{model}@{engine}/..."""

from kvlab.util.io import log_to
from kvlab.state.jobs import run_settings

log_to(snakemake.log[0])  # noqa: F821

from kvlab.steps.serve import run_serving_job  # noqa: E402

run_serving_job(
    engine=snakemake.wildcards.engine,  # noqa: F821
    model_dir=snakemake.input.model_dir,  # noqa: F821
    gguf=snakemake.input.get("gguf"),  # noqa: F821
    task=snakemake.wildcards.task,  # noqa: F821
    task_spec=snakemake.params.task,  # noqa: F821
    context_tokens=int(snakemake.wildcards.ctx),  # noqa: F821
    run=run_settings(snakemake),  # noqa: F821
    out_path=snakemake.output.rows,  # noqa: F821
)
