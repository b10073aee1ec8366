"""Quantized-cache methods: config entries → per-layer cache layouts (``kvlab.kernels.kvcache``).

Kinds:
  ``quant``         our caches, optionally composed with eviction (``press`` + ``kwargs``: evict first, then
                    quantize what is kept); ``scheme``:
      ``fp8``      FP8 E4M3, every token at once; static per-(layer, KV head) scales from calibration, or one
                   dynamic per-tensor scale per layer set at prefill;
      ``int8``     INT8 per token (asymmetric min–max over the head's channels), every token at once;
      ``kivi``     keys per channel in groups of G tokens, values per token in groups of G channels, asymmetric
                   min–max, the newest R tokens in full precision (axes configurable for the 2-bit ablation);
      ``kvquant``  pre-RoPE keys per channel (calibrated range) on the calibrated non-uniform grid, the top
                   outliers of each key vector in fp16, the first sink_tokens in full precision; values as KIVI's;
  ``hf_quantized``  transformers' QuantizedCache (quanto backend), the baseline users can reach today.
Only full-attention layers are quantized; sliding-window layers (Gemma 3) keep their own window untouched.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pandas as pd
import torch

from kvlab.io import read_parquet
from kvlab.kernels import kvcache, quant
from kvlab.kernels.accounting import TensorCodes

QUANT_KINDS = ("quant", "hf_quantized")

def residual(spec: dict) -> int:
    """R, the newest tokens kept in full precision: as configured, else 32 for kivi/kvquant and 0 for fp8/int8."""
    return spec.get("residual", 0 if spec["scheme"] in ("fp8", "int8") else 32)


def needs_calibration(spec: dict) -> bool:
    return spec["kind"] == "quant" and (spec["scheme"] == "kvquant" or (spec["scheme"] == "fp8" and spec["scales"] == "calibrated"))


@lru_cache(maxsize=8)
def _table(calibration_dir: str, name: str) -> pd.DataFrame:
    return read_parquet(Path(calibration_dir) / f"{name}.parquet")


def _fp8_scales(spec: dict, layer: int, tensor: str) -> torch.Tensor:
    t = _table(spec["calibration"], "fp8_scales")
    rows = t[(t["layer"] == layer) & (t["tensor"] == tensor)].sort_values("kv_head")
    # a head calibration saw all zero keeps |x| up to FP8_MIN_PEAK, not a 1e-12 scale that saturates everything
    return torch.tensor(rows["scale"].to_numpy(), dtype=torch.float32).clamp_min(quant.FP8_MIN_PEAK / quant.FP8_MAX)


def _kvquant_tables(spec: dict, layer: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grids = _table(spec["calibration"], "kvquant_grids")
    g = grids[(grids["layer"] == layer) & (grids["bits"] == spec["bits"])].sort_values("level")
    if len(g) != 2 ** spec["bits"]:
        raise ValueError(f"calibration has no {spec['bits']}-bit KVQuant grid for layer {layer}; calibrated bits: {sorted(grids['bits'].unique())}")
    r = _table(spec["calibration"], "kvquant_ranges")
    r = r[r["layer"] == layer].sort_values(["kv_head", "channel"])
    lo, hi = (torch.tensor(r[c].to_numpy(), dtype=torch.float32).view(heads, head_dim) for c in ("lo", "hi"))
    return torch.tensor(g["value"].to_numpy(), dtype=torch.float32), lo, hi


def layer_spec(spec: dict, layer: int, heads: int, head_dim: int) -> kvcache.LayerSpec:
    """The storage of one full-attention layer under a `quant` method."""
    scheme, bits, group, r = spec["scheme"], spec["bits"], spec["group"], residual(spec)
    if scheme == "fp8":
        scales = (lambda t: _fp8_scales(spec, layer, t)) if spec["scales"] == "calibrated" else (lambda t: None)
        return kvcache.LayerSpec(kvcache.FP8Codec(scales("key")), kvcache.FP8Codec(scales("value")), group=1, residual=r)
    if scheme == "int8":
        codec = kvcache.AffineCodec(8, head_dim, "token")
        return kvcache.LayerSpec(codec, codec, group=1, residual=r)
    if scheme == "kivi":
        return kvcache.LayerSpec(
            kvcache.AffineCodec(bits, group, spec["key_axis"]), kvcache.AffineCodec(bits, group, spec["value_axis"]),
            group=group, residual=r,
        )
    levels, lo, hi = _kvquant_tables(spec, layer, heads, head_dim)
    key = kvcache.GridKeyCodec(bits, levels, lo, hi, kvcache.outliers_per_vector(spec["outliers"], head_dim))
    return kvcache.LayerSpec(
        key, kvcache.AffineCodec(bits, group, "token"), group=group, residual=r, sink_tokens=spec["sink_tokens"], rope=True
    )


def layouts(spec: dict, head_dim: int) -> tuple[TensorCodes, TensorCodes]:
    """What the byte-accounting formula needs to know about each tensor's codes (kvlab.kernels.accounting)."""
    scheme, bits, group = spec["scheme"], spec["bits"], spec["group"]
    if scheme == "fp8":
        codes = TensorCodes(8, "static" if spec["scales"] == "calibrated" else "tensor")
        return codes, codes
    if scheme == "int8":
        codes = TensorCodes(8, "token", head_dim)
        return codes, codes
    if scheme == "kivi":
        return TensorCodes(bits, spec["key_axis"], group), TensorCodes(bits, spec["value_axis"], group)
    outliers = kvcache.outliers_per_vector(spec["outliers"], head_dim)
    return TensorCodes(bits, "static", outliers=outliers), TensorCodes(bits, "token", group)


def quantized_cache(model, spec: dict):
    """An empty cache for `model.generate(past_key_values=...)` storing every full-attention layer as `spec`
    (a `quant` method entry, e.g. ``{"kind": "quant", "scheme": "kivi", "bits": 4, "group": 32, "residual": 32,
    "key_axis": "channel", "value_axis": "token"}``); sliding-window layers stay transformers' own."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    config = model.config.get_text_config()
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=model.config)
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[idx] = kvcache.QuantizedKVLayer(layer_spec(spec, idx, heads, head_dim))
    return cache


def quantize_layers(cache, spec: dict, sliding: list[bool], captures) -> None:
    """Replace every full-attention layer of `cache` (a DynamicCache, after any eviction) by its quantized
    form. `captures` give the RoPE tables of the prefill positions (pre-RoPE key codecs)."""
    for idx, layer in enumerate(cache.layers):
        if sliding[idx]:
            continue
        keys, values = layer.keys, layer.values
        if spec["kind"] == "hf_quantized":
            cache.layers[idx] = kvcache.hf_quantized_layer(keys, values, spec["bits"], spec["group"], spec["residual"])
            continue
        ls = layer_spec(spec, idx, keys.shape[1], keys.shape[-1])
        cos = sin = None
        if ls.rope:
            cos, sin = captures[idx].cos, captures[idx].sin
            if cos.shape[1] != keys.shape[-2]:
                raise ValueError("pre-RoPE key quantization needs every prefill position; it cannot follow eviction")
        cache.layers[idx] = kvcache.layer_from_dense(keys, values, ls, cos, sin)
