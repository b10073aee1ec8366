"""H2O in the engine: a prefilled cache → one `kvlab.kernels.h2o.H2OLayer` per full-attention layer.

Config: ``{kind: h2o, recent: 0.5}`` — `recent` is the share of the kept tokens reserved for the newest
ones (the paper splits the budget evenly between heavy hitters and recent tokens); the budget comes from
`budgets`. Prefill scores are the attention each prompt token received from every later prompt token,
computed from the captured attention inputs; decoding adds each new query's attention and evicts per step
(an H2O layer changes length while decoding, so it sets `own_layout` and the engine batches it row by row).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.methods.base import MethodKind, MethodParams, Services
from kvlab.util.params import param


class H2O(MethodKind):
    """H2O as published: attention received, accumulated at every decoding step, evicts to the budget."""

    name = "h2o"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        recent: float = param(0.5, "share of the kept tokens reserved for the newest ones (H2O: half)", minimum=0, maximum=1)

    @property
    def evicts(self) -> bool:
        return True

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Replace every full-attention layer of `cache` (a copy of the full prefill `base`) by an H2O layer at
        the variant's budget."""
        import torch

        from kvlab.models.structure import attention_layers, queries
        from kvlab.kernels.h2o import H2OLayer, received_attention
        from kvlab.methods.base import region_keep

        modules, recent = attention_layers(model), self.params["recent"]
        with torch.no_grad():
            for idx, layer in enumerate(cache.layers):
                if sliding[idx]:
                    continue
                module, cap = modules[idx], base.capture(idx)
                t = layer.keys.shape[-2]
                # as kvpress counts kept tokens; a prompt's uncompressed prefix kept beside them, scored +inf
                capacity = max(1, int(t * region_keep(variant.budget, t, base.prefix)))
                scores = base.shared.get(("h2o_scores", idx))  # the prefill's scores: the same at every budget
                if scores is None:
                    q = queries(module, cap.hidden_states, cap.cos, cap.sin)
                    scores = base.shared[("h2o_scores", idx)] = received_attention(q, layer.keys, module.scaling)
                if base.prefix:
                    scores = scores.clone()
                    scores[..., : base.prefix] = float("inf")
                window = round(recent * (capacity - base.prefix))  # the recent share of what the budget keeps
                cache.layers[idx] = H2OLayer(layer.keys, layer.values, scores, capacity, window, module.scaling)
