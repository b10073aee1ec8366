"""Rule cost_table: the article's §8 table and every model's card priced → results/accounting/costs.parquet."""

from kvlab.costs import cost_rows
from kvlab.io import atomic_path, log_to
from kvlab.models.card import read_card

log_to(snakemake.log[0])  # noqa: F821
cards = [read_card(d) for d in snakemake.input.model_dirs]  # noqa: F821
with atomic_path(snakemake.output.costs) as tmp:  # noqa: F821
    cost_rows(cards, snakemake.params.context_tokens).to_parquet(tmp, index=False)  # noqa: F821
