"""Rule acquire_model: a configured model → resources/models/{model}/ (HF format + card.json)."""

from kvlab.util.io import log_to

log_to(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)

from kvlab.models.acquire import acquire  # noqa: E402

acquire(snakemake.wildcards.model, snakemake.params.spec, snakemake.output.model_dir)  # noqa: F821
