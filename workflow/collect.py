"""Rule collect: every Parquet file, model card and benchmark → results/kvlab.duckdb."""

from kvlab.steps.collect import build
from kvlab.util.io import log_to

log_to(snakemake.log[0])  # noqa: F821
build(
    db_path=snakemake.output.db,  # noqa: F821
    eval_files=snakemake.input.rows,  # noqa: F821
    speed_files=snakemake.input.speed,  # noqa: F821
    calibration_files=snakemake.input.calibration,  # noqa: F821
    model_dirs=snakemake.input.model_dirs,  # noqa: F821
    cost_files={name: snakemake.input[name] for name in ("costs", "reads", "crossover")},  # noqa: F821
    benchmark_files=snakemake.input.benchmarks,  # noqa: F821
    config=snakemake.params.config,  # noqa: F821
)
