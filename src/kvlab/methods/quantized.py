"""Quantized-cache kinds: config entries → per-layer cache layouts (``kvlab.kernels.kvcache``).

``quant``         our caches, by `scheme` (``kvlab.methods.schemes``: fp8, ggml, int8, kivi, kvquant, lmdeploy),
                  optionally composed with eviction (``press`` + ``kwargs``: evict first, then quantize what is
                  kept);
``hf_quantized``  transformers' QuantizedCache (quanto backend), the baseline users can reach today.
Only full-attention layers are quantized; sliding-window layers (Gemma 3) keep their own window untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.methods.base import KVPress, MethodKind, MethodParams, Services
from kvlab.methods.press import PRESS_NAME
from kvlab.methods.schemes import SCHEMES
from kvlab.util.params import param, shared


GGML_KEYS = ("cache_type_k", "cache_type_v", "attn_rot")  # scheme ggml's own keys


class Quant(MethodKind):
    """kvlab's quantized caches: packed codes inside generation, the storage of the entry's scheme."""

    name = "quant"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        scheme: str = param(doc="fp8 (E4M3) | ggml (llama.cpp's q8_0/q4_0 cache types) | int8 (per token) | kivi (per-channel keys, "
                                "per-token values) | kvquant (pre-RoPE non-uniform keys) | lmdeploy (LMDeploy/TurboMind: per head and token, "
                                "no residual)", enum=list(SCHEMES))
        bits: Literal[2, 4, 8] = param(4, "code width of kivi (2, 4, 8), kvquant (2, 4) and lmdeploy (4, 8)")
        group: int = param(32, "G: tokens per key group and channels per value group", minimum=1, maximum=4096)
        residual: int | None = param(None, "R: newest tokens kept in full precision (default 32 for kivi and kvquant, 0 for fp8, "
                                     "int8 and lmdeploy: every token quantized, as deployed caches do)", minimum=0, maximum=65536)
        key_axis: Literal["channel", "token"] = param("channel", "kivi keys: per channel over G tokens, or per token over G channels")
        value_axis: Literal["token", "channel"] = param("token", "kivi values: per token over G channels, or per channel over G tokens")
        policy: Literal["kivi", "together"] | None = param(
            None, "kivi: which recent tokens stay in full precision. kivi (default, KIVI's own cache): keys quantized R at a "
            "time once R are held, values one at a time beyond the newest R (R a multiple of G); together (kvlab's earlier "
            "policy): keys and values together in whole groups of G beyond the newest R")
        scales: Literal["calibrated", "dynamic"] = param("calibrated", "fp8: static per-head scales from calibration, or one "
                                                         "per-tensor scale set at prefill")
        max_saturated: float | None = param(
            None, "fp8: refuse (stop the job with one line) a cache whose context's key or value entries were clamped at ±448 × "
            "scale in a larger share (rows carry kv_saturated_keys / _values either way)", minimum=0, maximum=1)
        outliers: float = param(0.01, "kvquant: fraction of each key vector kept sparse in fp16 (at least one entry when > 0)",
                                minimum=0, maximum=0.5)
        sink_tokens: int = param(1, "kvquant: first tokens kept in full precision", minimum=0, maximum=1024)
        cache_type_k: Literal["f16", "q8_0", "q4_0"] | None = param(
            None, "ggml: llama.cpp's K cache type (--cache-type-k): q8_0 or q4_0 blocks of 32 channels with an fp16 scale, "
            "or f16 (the default)")
        cache_type_v: Literal["f16", "q8_0", "q4_0"] | None = param(None, "ggml: llama.cpp's V cache type (--cache-type-v), as cache_type_k")
        attn_rot: bool | None = param(
            None, "ggml: rotate K and V by llama.cpp's Hadamard matrix before quantizing, where it does (a quantized type, head dim "
            "a multiple of 64; the default); false: as LLAMA_ATTN_ROT_DISABLE=1")
        press: str | None = param(None, "optional kvpress press applied first (evict, then quantize what is kept), at every budget",
                                  pattern=PRESS_NAME)
        kwargs: dict = param({}, "keyword arguments of the press")
        wrapper: str | None = shared(KVPress.Params, "wrapper")
        wrapper_kwargs: dict | None = shared(KVPress.Params, "wrapper_kwargs")
        layer_budgets: Literal["calibrated"] | None = shared(KVPress.Params, "layer_budgets")

    def __init__(self, params: dict):
        super().__init__(params)
        self.scheme = SCHEMES[params["scheme"]](params)

    @property
    def quantized(self) -> bool:
        return True

    def problem(self):
        if "policy" in self.params and self.scheme.name != "kivi":
            return "policy", (f"policy applies to scheme kivi only; scheme {self.scheme.name} quantizes by its own "
                              "fixed rule: remove policy")
        if "max_saturated" in self.params and self.scheme.name != "fp8":
            return "max_saturated", (f"max_saturated applies to scheme fp8 only (scheme {self.scheme.name}'s min-max "
                                     "or grid range clamps nothing): remove it")
        if self.scheme.name != "ggml" and (key := next((k for k in GGML_KEYS if k in self.params), None)):
            return key, f"{key} applies to scheme ggml only (llama.cpp's cache types): remove it"
        return self.scheme.problem() or super().problem()

    def needs_calibration(self) -> bool:
        return self.scheme.needs_calibration()

    @property
    def storage(self) -> dict:
        return self.scheme.storage

    def layouts(self, head_dim: int):
        return self.scheme.layouts(head_dim)

    def check_cache(self, stats: dict, method: str) -> None:
        """`max_saturated` (fp8): refuse a cache whose context's key or value entries were clamped at ±448 × scale
        in a larger share (the cache would silently flatten its largest entries)."""
        limit = self.params.get("max_saturated")
        for part in ("keys", "values"):
            share = stats[f"kv_saturated_{part}"]
            if limit is not None and share > limit:
                raise ValueError(
                    f"method {method}: {share:.3%} of the context's quantized {part} saturated at ±448 × scale "
                    f"(max_saturated {limit:.3%}); calibrate the scales on this data, use scales: dynamic, or raise "
                    "max_saturated")

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Every full-attention layer of `cache` (after any eviction) in its quantized form; pre-RoPE key codecs
        take the RoPE tables of the prefill positions from its captures (`base.capture`)."""
        from kvlab.kernels import kvcache

        for idx, layer in enumerate(cache.layers):
            if sliding[idx]:
                continue
            keys, values = layer.keys, layer.values
            spec = self.scheme.layer_spec(idx, keys.shape[1], keys.shape[-1])
            cos = sin = None
            if spec.rope:
                cap = base.capture(idx)
                cos, sin = cap.cos, cap.sin
                if cos.shape[1] != keys.shape[-2]:
                    raise ValueError("pre-RoPE key quantization needs every prefill position; it cannot follow eviction")
            cache.layers[idx] = kvcache.layer_from_dense(keys, values, spec, cos, sin)

    def empty_cache(self, model):
        """An empty cache for `model.generate(past_key_values=...)` storing every full-attention layer in this
        scheme; sliding-window layers stay transformers' own."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicSlidingWindowLayer

        from kvlab.kernels import kvcache

        config = model.config.get_text_config()
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        cache = DynamicCache(config=model.config)
        for idx, layer in enumerate(cache.layers):
            if not isinstance(layer, DynamicSlidingWindowLayer):
                cache.layers[idx] = kvcache.QuantizedKVLayer(self.scheme.layer_spec(idx, heads, head_dim))
        return cache


class HFQuantized(MethodKind):
    """transformers' QuantizedCache layers (quanto backend: `bits`, `group`, `residual`); bytes measured only."""

    name = "hf_quantized"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        bits: Literal[2, 4] = param(4, "transformers' QuantizedCache, quanto backend")
        group: int = param(32, "q_group_size", minimum=1, maximum=4096)
        residual: int = param(32, "residual_length", minimum=0, maximum=65536)

    @property
    def quantized(self) -> bool:
        return True

    @property
    def storage(self) -> dict:
        return {"scheme": "hf_quanto", "bits": self.params["bits"], "key_axis": "token", "value_axis": "token", "policy": None}

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        from kvlab.kernels import kvcache

        p = self.params
        for idx, layer in enumerate(cache.layers):
            if not sliding[idx]:
                cache.layers[idx] = kvcache.hf_quantized_layer(layer.keys, layer.values, p["bits"], p["group"], p["residual"])
