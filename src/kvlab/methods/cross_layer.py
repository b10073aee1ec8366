"""Cross-layer KV sharing in the engine, post hoc (CLA): in each group of `every` consecutive layers, the first
stores its keys and values and the others read them instead of their own (`kvlab.kernels.cross_layer`).

Config: ``{kind: cross_layer, every: 2}`` — CLA-2: layer 2i+1 attends to layer 2i's K/V, half the bytes. Runs once
(budget 1). A full-attention layer shares only with a full-attention source (a sliding-window layer holds other
tokens), so on models with sliding-window layers fewer layers share than 1 - 1/every; the byte formula assumes all
share and such rows show it beside the measured bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.methods.base import MethodKind, MethodParams, Services
from kvlab.util.params import param


class CrossLayer(MethodKind):
    """Layers read an earlier layer's keys and values, on a model trained with its own per layer."""

    name = "cross_layer"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        every: int = param(2, "layers per sharing group: the first stores K/V, the rest read it (CLA-2: 2; 1 shares nothing)",
                           minimum=1, maximum=64)

    def formula_bytes(self, geom, dtype: str, budget: float, tokens: int, held: float, prefix: int = 0) -> int:
        """The full cache's bytes times the share of layers that store: the first of each group of `every`
        (exact when every layer is full-attention; sliding-window layers are not placed by the geometry)."""
        storing = -(-geom.layers // self.params["every"])
        return super().formula_bytes(geom, dtype, 1.0, tokens, held) * storing // geom.layers

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Every full-attention layer that is not the first of its group becomes a layer sharing that first
        layer's keys and values, when that one is full-attention too."""
        from kvlab.kernels.cross_layer import SharedLayer

        every = self.params["every"]
        for idx in range(len(cache.layers)):
            source = idx - idx % every
            if source != idx and not sliding[idx] and not sliding[source]:
                cache.layers[idx] = SharedLayer(source, cache.layers[source].keys, cache.layers[source].values)
