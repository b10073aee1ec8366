"""Rule throughput: decode tokens/s per method and batch size → results/speed/throughput/{model}/{ctx}.parquet."""

from kvlab.util.io import log_to
from kvlab.state.jobs import run_settings

log_to(snakemake.log[0])  # noqa: F821

from kvlab.steps.benchmark import throughput  # noqa: E402

throughput(
    model_dir=snakemake.input.model_dir,  # noqa: F821
    context_tokens=int(snakemake.wildcards.ctx),  # noqa: F821
    new_tokens=snakemake.params.new_tokens,  # noqa: F821
    batches=tuple(snakemake.params.batches),  # noqa: F821
    run=run_settings(snakemake),  # noqa: F821
    out_path=snakemake.output.rows,  # noqa: F821
)
