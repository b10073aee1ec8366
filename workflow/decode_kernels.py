"""Rule decode_kernels: decode-attention time and GB/s per storage format and path (CUDA) → results/speed/decode_kernels/{model}.parquet."""

from kvlab.util.io import log_to
from kvlab.state.jobs import run_settings

log_to(snakemake.log[0])  # noqa: F821

from kvlab.steps.kernel_bench import decode_kernels  # noqa: E402

decode_kernels(
    model_dir=snakemake.input.model_dir,  # noqa: F821
    spec=snakemake.params.spec,  # noqa: F821
    run=run_settings(snakemake),  # noqa: F821
    out_path=snakemake.output.rows,  # noqa: F821
)
