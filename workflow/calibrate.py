"""Rule calibrate: one model → results/calibration/{model}/*.parquet (see kvlab.steps.calibrate)."""

from pathlib import Path

from kvlab.util.hardware import compute_dtype
from kvlab.util.io import log_to

log_to(snakemake.log[0])  # noqa: F821

from kvlab.steps.calibrate import run_job  # noqa: E402

run_job(
    model_dir=snakemake.input.model_dir,  # noqa: F821
    spec=snakemake.params.spec,  # noqa: F821
    run=dict(snakemake.params.run, threads=snakemake.threads, dtype=compute_dtype(snakemake.params.run["dtype"], snakemake.params.run["device"])),  # noqa: F821
    out_dir=Path(snakemake.output.tables[0]).parent,  # noqa: F821
)
