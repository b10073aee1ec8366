"""Compressing a copy of a prefilled cache per variant (press, own evictor, quantization) and what it then holds."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import torch
from torch.profiler import record_function
from transformers import DynamicCache
from transformers.cache_utils import QuantizedLayer

from kvlab.models.structure import attention_layers, is_sliding, language_model
from kvlab.engine.prefill import Prefilled, prefill, self_information, shallow_copy
from kvlab.kernels import kvcache, layouts
from kvlab.kernels.layer import KVLayer, Masked, hidden_entries
from kvlab.methods import Variant, layer_budgets
from kvlab.methods.base import region_keep


SERVICES = SimpleNamespace(prefill=prefill, self_information=self_information, shallow_copy=shallow_copy)  # lent to kinds

# kvpress scorers whose `score` never reads `compression_ratio`, so the scores one prefill gives a layer serve every
# budget of the same press: each is computed once and kept in the prefill's `shared` (kvpress computes them anew at
# every call, as a press that runs once per prefill would). tests/test_engine.py checks each: one score call per layer
# for three budgets, and every budget's cache bitwise what compressing a fresh prefill gives. StreamingLLMPress's
# score does read the ratio.
RATIO_FREE_SCORERS = ("SnapKVPress", "PyramidKVPress", "KnormPress", "TOVAPress", "ExpectedAttentionPress")


def share_scores(press, shared: dict) -> None:
    """Let `press`, and every press it wraps, whose class is in RATIO_FREE_SCORERS take a layer's scores from `shared`
    when the same press settings (the ratio aside) scored the same keys before, and keep them there otherwise. Each
    caller gets its own copy (AdaKVPress writes into the scores it is given)."""
    stack = [press]
    while stack:
        p = stack.pop()
        stack += [q for q in (getattr(p, "press", None), *getattr(p, "presses", ())) if q is not None]
        if type(p).__name__ not in RATIO_FREE_SCORERS:
            continue
        settings = (type(p).__name__, repr([(f.name, getattr(p, f.name)) for f in fields(p) if f.name != "compression_ratio"]))

        def score(module, hidden_states, keys, values, attentions, kwargs, own=p.score, settings=settings):
            key = ("scores", settings, module.layer_idx, keys.data_ptr(), tuple(keys.shape))
            if key not in shared:
                shared[key] = own(module, hidden_states, keys, values, attentions, kwargs)
            return shared[key].clone()

        p.score = score


def keep_prefix(press, prefix: int, ratio: dict) -> None:
    """Let every scorer in `press` (it, and every press it wraps, that has a `score`) score only the positions after
    the first `prefix` (their inputs cut there, at the compression ratio `ratio["region"]` of those positions, as kvpress
    scores the context it is given), and give the prefix +inf: whatever keeps the top scores keeps it whole. The caller
    raises the press's own ratio so that it keeps the prefix plus the region's share (`region_keep`)."""
    stack = [press]
    while stack:
        p = stack.pop()
        stack += [q for q in (getattr(p, "press", None), *getattr(p, "presses", ())) if q is not None]
        if not callable(getattr(p, "score", None)):
            continue

        def score(module, hidden_states, keys, values, attentions, kwargs, own=p.score, p=p):
            cos, sin = kwargs["position_embeddings"]
            cut = {**kwargs, "hidden_states": hidden_states[:, prefix:], "position_embeddings": (cos[:, prefix:], sin[:, prefix:]),
                   "cache_position": kwargs["cache_position"][prefix:]}
            whole, p.compression_ratio = p.compression_ratio, ratio["region"]
            try:
                scores = own(module, hidden_states[:, prefix:], keys[..., prefix:, :], values[..., prefix:, :],
                             None if attentions is None else attentions[..., prefix:, prefix:], cut)
            finally:
                p.compression_ratio = whole
            return torch.cat([scores.new_full((*scores.shape[:-1], prefix), float("inf")), scores], dim=-1)

        p.score = score


@torch.no_grad()
@record_function("kvlab.compress")
def compress(model, base: Prefilled, variant: Variant) -> DynamicCache:
    """A compressed copy of `base.cache` for `variant`: evicted by its press (if any), then changed as its kind
    does (`MethodKind.apply`: H2O's layers, which go on evicting while decoding; a quantized kind's codes).
    For full, a copy sharing the base's tensors. The base's first `prefix` positions are never evicted: a press scores
    the positions after them, at its ratio of those (`keep_prefix`)."""
    cache = shallow_copy(base.cache)
    press = variant.make_press()
    sliding = [is_sliding(model, i) for i in range(len(cache.layers))]
    if press is not None:
        press.post_init_from_model(model)
        share_scores(press, base.shared)
        ratio = {}  # the press's ratio of the positions after the prefix, for `keep_prefix`
        if base.prefix:
            keep_prefix(press, base.prefix, ratio)
        cache_position = torch.arange(base.length, device=model.device)
        rotary = language_model(model).rotary_emb
        weights = variant.params.get("layer_budgets")  # calibrated per-layer weights: one budget per layer
        per_layer = layer_budgets(variant.budget, weights, sliding) if weights is not None else None
        for idx, module in enumerate(attention_layers(model)):
            if sliding[idx]:
                continue
            if per_layer is not None:
                press.compression_ratio = 1.0 - per_layer[idx]
            if base.prefix:  # keep the prefix and the region's share of the rest: the press's ratio over every position
                ratio["region"] = press.compression_ratio
                press.compression_ratio = 1.0 - region_keep(1.0 - ratio["region"], base.length, base.prefix)
            module.rotary_emb = rotary  # as kvpress's hooks set it (KeyRerotationPress reads it)
            cap = base.capture(idx)
            layer = cache.layers[idx]
            kwargs = {
                "hidden_states": cap.hidden_states,
                "position_embeddings": (cap.cos, cap.sin),
                "past_key_values": cache,
                "cache_position": cache_position,
            }
            layer.keys, layer.values = press.compress(module, cap.hidden_states, layer.keys, layer.values, cap.attentions, kwargs)
            if getattr(module, "masked_key_indices", None) is not None:  # a press that masks keys, freeing nothing
                batch, head, seq = module.masked_key_indices
                module.masked_key_indices = None
                if variant.kind != "kvpress":
                    raise ValueError(f"method '{variant.method}': {variant.params['press']} masks keys instead of evicting them; "
                                     "it cannot be composed with a quantized cache, use an evicting press (e.g. SnapKVPress)")
                masked = torch.zeros(layer.keys.shape[:3], dtype=torch.bool, device=layer.keys.device)
                masked[batch, head, seq] = True  # (1, H_kv, T): hidden from attention, still stored
                cache.layers[idx] = Masked(layer.keys, layer.values, masked)
            if base.prefix:
                press.compression_ratio = ratio["region"]
        if variant.rerotates:
            rerotated(model, cache, variant, base.length)
    variant.impl.apply(model, cache, base, variant, sliding, SERVICES)
    return cache


def rerotated(model, cache: DynamicCache, variant: Variant, context: int) -> None:
    """Mark a cache whose kept keys were re-rotated to positions 0…n-1: its rows decode from position n (the
    batch shifts their position ids by n - context). One position per row, so every layer must keep n."""
    kept = {layer.keys.shape[-2] for layer in cache.layers}
    if any(is_sliding(model, i) for i in range(len(cache.layers))):
        raise ValueError(f"method '{variant.method}': KeyRerotationPress moves positions, which this model's uncompressed "
                         "sliding-window layers cannot follow; remove the wrapper for this model")
    if len(kept) != 1:
        raise ValueError(f"method '{variant.method}': KeyRerotationPress needs the same kept count in every layer "
                         f"(got {sorted(kept)}); per-layer budgets cannot share one decoding position")
    cache.position_shift = kept.pop() - context  # a KVCache, as every copy of a prefill is

def held_tokens(layer) -> int:
    """Tokens a cache layer holds now (a sliding-window layer's get_seq_length counts every token it saw)."""
    return layer.get_seq_length() if kvcache.is_quantized(layer) else layer.keys.shape[-2]


def _coded_bytes(layer, variant: Variant, heads: int, d: int, measured: int, clamped: dict) -> tuple[int, int, int, int]:
    """A quantized layer's bytes (`cache_stats`): by the accounting formula, as stored with its dense entries
    (residual, sinks) in bf16, and of its codes and metadata alone (of the `measured` bytes); and its coded keys plus
    values. Adds its clamped and coded entries to `clamped` (codecs that clamp only)."""
    for part, count in clamped.items():
        share = layer.saturated_share(part)
        if share is not None:
            count[0], count[1] = count[0] + share[0], count[1] + share[1]
    n = layer.counts()
    key, value = variant.impl.layouts(d)
    coded = n["quantized_keys"], n["quantized_values"]
    dense_tokens = n["sink_tokens"] + n["residual_keys"], n["sink_tokens"] + n["residual_values"]
    dense = layer.keys.numel() + layer.values.numel()
    codes = (measured - dense * layer.keys.element_size()
             - (0 if layer.sink_keys is None else 2 * layer.sink_keys.numel() * layer.sink_keys.element_size()))
    return (layouts.stored_layer_bytes(key, value, heads, d, coded, dense_tokens, layer.keys.element_size()),
            layouts.stored_layer_bytes(key, value, heads, d, coded, dense_tokens, 2), codes, sum(coded))


@record_function("kvlab.cache_stats")
def cache_stats(cache: DynamicCache, variant: Variant, context: int) -> dict:
    """What the cache really holds after compressing a `context`-token prefill: bytes of the stored tensors
    (not the requested ratio), the accounting formula's bytes for what is held, and the compression against
    the uncompressed context in bf16 (codes and metadata as stored; full-precision residual, sinks and dense
    entries counted at 2 bytes per element, so the ratio does not depend on the run's compute dtype)."""
    nbytes = formula = stored_bf16 = reference_bf16 = code_bytes = code_tokens_bf16 = 0
    tokens, kept, reads, context_heads = [], [], [], 0
    clamped = {"key": [0, 0], "value": [0, 0]}  # entries clamped, entries in codes (codecs that clamp only)
    for layer in cache.layers:
        held = held_tokens(layer)
        tokens.append(held)
        measured = kvcache.layer_nbytes(layer)
        nbytes += measured
        quantized = layer._quantized_keys if isinstance(layer, QuantizedLayer) else None
        heads, d = (quantized if quantized is not None else layer.keys).shape[1::2]
        masked = hidden_entries(layer)
        attended = [held - int(m) for m in masked[0].sum(-1)] if masked is not None else [held] * heads
        kept += attended
        read = layer.read_per_head() if isinstance(layer, KVLayer) else None
        reads += attended if read is None else [read] * heads
        context_heads += (held if layer.is_sliding else context) * heads
        token_bf16 = 2 * heads * d * 2
        reference_bf16 += (held if layer.is_sliding else context) * token_bf16
        dense = layer.keys.numel() + layer.values.numel()  # full-precision entries (the residual, for quantized layers)
        if isinstance(layer, kvcache.QuantizedKVLayer):
            by_formula, as_bf16, codes, coded = _coded_bytes(layer, variant, heads, d, measured, clamped)
            formula += by_formula
            stored_bf16 += as_bf16
            code_bytes += codes
            code_tokens_bf16 += coded * token_bf16 // 2  # half of a token's K and V per coded key or value
        elif quantized is not None:  # transformers' QuantizedCache layer: measured only
            formula = float("nan")
            stored_bf16 += measured - dense * layer.keys.element_size() + dense * 2
        else:
            formula += measured
            shared = isinstance(layer, KVLayer) and layer.shares is not None  # stores nothing: counted at its source
            stored_bf16 += 0 if shared else dense * 2
    stats = {
        "kv_bytes": int(nbytes), "kv_tokens_mean": float(sum(tokens) / len(tokens)), "kv_bytes_formula": formula,
        # tokens each (layer, KV head) attends to: below kv_tokens_mean only for presses that mask without freeing
        "kv_kept_heads": kept, "kv_kept_mean": float(sum(kept) / len(kept)), "kv_kept_min": int(min(kept)),
        # K/V vectors per (layer, KV head) one decode step reads, and their share of the uncompressed context's:
        # the kept tokens, except for block-sparse reads (block summaries counted), which keep everything
        "kv_read_mean": float(sum(reads) / len(reads)), "kv_read_fraction": sum(reads) / context_heads,
        "compression_vs_bf16": reference_bf16 / stored_bf16,
        # the quantized tokens alone: bf16 bytes / their codes and metadata (the steady-state ratio)
        "codes_vs_bf16": code_tokens_bf16 / code_bytes if code_bytes else float("nan"),
        # share of the context's coded key / value entries the format clamped (FP8: |x / scale| > 464, stored as
        # ±448); NaN for formats that clamp nothing
        **{f"kv_saturated_{part}s": c / n if n else float("nan") for part, (c, n) in clamped.items()},
    }
    variant.impl.check_cache(stats, variant.method)
    return stats
