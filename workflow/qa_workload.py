"""Rule workload: a dataset task's recipe (qa_mix) → results/workloads/{task}.jsonl."""

from kvlab.io import log_to

log_to(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)

from kvlab.workload_recipe import qa_mix  # noqa: E402

qa_mix(snakemake.output.rows, **snakemake.params.recipe)  # noqa: F821
