"""Block-sparse reads in the engine: the whole cache is kept, and each decode step reads only the blocks chosen for
its query (`kvlab.kernels.block_sparse`: MoBA's mean-key gate or Quest's min/max bound).

Config: ``{kind: block_sparse, selector: moba, block: 64}``. The method runs at every budget; a budget is the share of
the context one decode step reads: ``top_k = max(1, round(budget × context / block))`` blocks, the current one
among them. Rows keep ``compression_vs_bf16`` at 1 (nothing is freed) and record what a step reads in
``kv_read_mean`` and ``kv_read_fraction``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.methods.base import MethodKind, MethodParams, Services
from kvlab.util.params import param


class BlockSparse(MethodKind):
    """Post-hoc block selection at decode time over a cache kept whole."""

    name = "block_sparse"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        selector: Literal["moba", "quest"] = param(doc="how a decode step scores past blocks: moba (query · mean key) or quest "
                                                   "(bound from min/max keys)")
        block: int = param(64, "tokens per block (MoBA's block, Quest's page)", minimum=1, maximum=65536)

    @property
    def evicts(self) -> bool:
        return True  # runs at every budget: the share read per step

    def formula_bytes(self, geom, dtype: str, budget: float, tokens: int, held: float, prefix: int = 0) -> int:
        return super().formula_bytes(geom, dtype, 1.0, tokens, held)  # every entry is kept; the budget is what a step reads

    def top_k(self, budget: float, context: int) -> int:
        return max(1, round(budget * context / self.params["block"]))

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Every full-attention layer of `cache` (a copy of the full prefill) becomes a block-sparse layer."""
        from kvlab.kernels.block_sparse import BlockSparseLayer

        block, selector = self.params["block"], self.params["selector"]
        for idx, layer in enumerate(cache.layers):
            if not sliding[idx]:
                top_k = self.top_k(variant.budget, layer.keys.shape[-2])
                cache.layers[idx] = BlockSparseLayer(layer.keys, layer.values, block, top_k, selector)
