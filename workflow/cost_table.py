"""Rule cost_table: the article's §8 table and every model's card priced → results/accounting/costs.parquet; the KV
bytes a decode step reads (NSA, MoBA vs full) → reads.parquet; where they exceed the weights' → crossover.parquet."""

from kvlab.steps.costs import cost_rows, crossover_rows, read_rows
from kvlab.util.io import atomic_path, log_to
from kvlab.models.card import read_card

log_to(snakemake.log[0])  # noqa: F821
cards = [read_card(d) for d in snakemake.input.model_dirs]  # noqa: F821
tables = {
    "costs": cost_rows(cards, snakemake.params.context_tokens),  # noqa: F821
    "reads": read_rows(cards, snakemake.params.sparse_reads),  # noqa: F821
    "crossover": crossover_rows(cards, snakemake.params.crossover),  # noqa: F821
}
for name, frame in tables.items():
    with atomic_path(snakemake.output[name]) as tmp:  # noqa: F821
        frame.to_parquet(tmp, index=False)
