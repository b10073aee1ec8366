"""Rule workload: a dataset task's recipe (qa_mix, chat_mix) → results/workloads/{task}.jsonl."""

from kvlab.util.io import log_to

log_to(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)

from kvlab.steps.workload_recipe import RECIPES  # noqa: E402

RECIPES[snakemake.params.recipe_name](snakemake.output.rows, **snakemake.params.recipe)  # noqa: F821
