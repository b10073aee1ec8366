"""MiKV-style mixed precision (Yang et al. 2024, "No Token Left Behind"): the tokens an eviction press would keep
stay in the model's precision, and those it would evict stay in the cache as low-precision codes instead of being
dropped.

Config: ``{kind: mikv, scorer: SnapKVPress, kwargs: {...}, bits: 2, group: 32, residual: 32}``. A budget is the
share of the context kept in full precision (the scorer's top tokens per KV head, as kvpress counts them); the rest
of the context is stored as KIVI codes of `bits` (keys per channel, values per token, in groups of G). Every layer
becomes a ``kvlab.kernels.kvcache.QuantizedKVLayer`` whose full-precision "sinks" are the kept tokens and whose
codes are the others (both in prompt order), so the bytes rows carry are the stored tensors, measured. Keys are
stored after RoPE, so the order of tokens in the layer does not matter to attention. Decoded tokens stream as in
KIVI (the residual window, then codes).

Written here, not taken from a library: kvpress has no mixed-precision press, and MiKV's own code is not packaged.
MiKV's high tier may be INT8 as well; this kind keeps it in the model's dtype (bf16 or fp32), the upper end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.methods.base import MethodKind, MethodParams, Services
from kvlab.methods.press import PRESS_NAME
from kvlab.util.params import param
from kvlab.methods.schemes.kivi import KIVI


class MiKV(MethodKind):
    """Eviction's kept tokens in full precision, its evicted ones as KIVI codes."""

    name = "mikv"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        scorer: str = param(doc="a kvpress scorer press (e.g. SnapKVPress): the tokens it would keep at the budget stay in full "
                                "precision, the ones it would evict become codes", pattern=PRESS_NAME)
        kwargs: dict = param({}, "keyword arguments of the scorer press")
        bits: Literal[2, 4] = param(2, "code width of the evicted tokens (KIVI: keys per channel, values per token)")
        group: int = param(32, "G: tokens per key group and channels per value group", minimum=1, maximum=4096)
        residual: int = param(32, "R: newest tokens kept in full precision while decoding (KIVI's residual)", minimum=0, maximum=65536)

    def __init__(self, params: dict):
        super().__init__(params)
        self.low = KIVI({"key_axis": "channel", "value_axis": "token", **params})

    @property
    def evicts(self) -> bool:
        return True  # a budget: the share kept in full precision

    @property
    def quantized(self) -> bool:
        return True

    @property
    def storage(self) -> dict:
        return {**self.low.storage, "scheme": "mikv"}

    def layouts(self, head_dim: int):
        return self.low.layouts(head_dim)

    def problem(self):
        from kvlab.methods.press import press_problem

        problem = press_problem({"press": self.params["scorer"], "kwargs": self.params.get("kwargs", {})})
        if problem:
            key, message = problem
            return key.replace("press", "scorer", 1), message
        return self.low.problem()

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Every full-attention layer of `cache` (the full prefill) as kept tokens in full precision and the rest
        as codes: the scorer press scores each layer's tokens from the prefill's captures, and the top
        budget share per KV head is kept."""
        import dataclasses

        import torch

        from kvlab.models.structure import attention_layers, language_model
        from kvlab.kernels import kvcache
        from kvlab.methods.base import region_keep
        from kvlab.methods.press import make_press

        press = make_press({"press": self.params["scorer"], "kwargs": self.params.get("kwargs", {})}, variant.budget)
        press.post_init_from_model(model)
        rotary = language_model(model).rotary_emb
        positions = torch.arange(base.length, device=model.device)
        with torch.no_grad():
            for idx, module in enumerate(attention_layers(model)):
                if sliding[idx]:
                    continue
                module.rotary_emb = rotary  # as kvpress's hooks set it
                cap, layer = base.capture(idx), cache.layers[idx]
                kwargs = {"hidden_states": cap.hidden_states, "position_embeddings": (cap.cos, cap.sin),
                          "past_key_values": cache, "cache_position": positions}
                scores = press.score(module, cap.hidden_states, layer.keys, layer.values, cap.attentions, kwargs)
                t = layer.keys.shape[-2]
                kept = max(1, int(t * region_keep(variant.budget, t, base.prefix)))  # as kvpress counts kept tokens
                if base.prefix:  # a prompt's uncompressed prefix stays in full precision beside the budget's share
                    scores = scores.clone()
                    scores[..., : base.prefix] = float("inf")
                top = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
                top.scatter_(-1, scores.topk(kept, dim=-1).indices, True)
                # kept tokens first, then the others, each in prompt order (a stable sort on "not kept")
                order = torch.sort((~top).to(torch.int8), dim=-1, stable=True).indices
                index = order.unsqueeze(-1).expand(-1, -1, -1, layer.keys.shape[-1])
                keys, values = layer.keys.gather(2, index), layer.values.gather(2, index)
                spec = dataclasses.replace(self.low.layer_spec(idx, keys.shape[1], keys.shape[-1]), sink_tokens=kept)
                cache.layers[idx] = kvcache.layer_from_dense(keys, values, spec)
