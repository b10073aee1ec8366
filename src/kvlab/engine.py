"""The evaluation engine: prefill a sample once with the full cache, compress a copy of that cache per
variant, then decode every variant together as one batch.

kvpress presses normally compress inside forward hooks during prefill. A press's ``compress`` only
needs the layer's input hidden states, its keys/values and the RoPE tables, none of which compression
changes within the same forward pass (each layer's attention output is computed before its hook runs).
So we capture those per layer during one uncompressed prefill and call ``press.compress`` afterwards, per
variant, on a copy — the same tensors kvpress's hook would see (tests/test_engine.py checks equality).

Batching caches of different lengths: each layer's rows are right-padded to the longest row of that
layer and every full-attention layer gets its own additive mask (a forward pre-hook swaps it in), which
hides the padding and keeps the tail causal. Masked entries get exactly zero weight, so a row decodes
as it would alone (tests/test_engine.py checks the predictions against one-variant-at-a-time runs).
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, create_sliding_window_causal_mask, sdpa_mask

from kvlab.kernels import accounting, decode_attention, kvcache
from kvlab.methods import EVICTORS, Variant, layer_budgets
from kvlab.methods.quantized import layouts, quantize_layers
from kvlab.tasks.base import Sample
from kvlab.tasks.scoring import score


ATTENTION = "kvlab_sdpa_gqa"


def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, but grouped-query heads share their K/V inside the kernel even when a
    mask is given. transformers' own `sdpa` copies every cached K/V head to each query head it serves
    whenever there is a mask (a full copy of the cache per layer and step: 7x for Qwen2.5-0.5B), which is
    what our batched decoding always passes. Same result (tested), several times faster on the CPU.

    A decode step over quantized rows (`Rows.update` tags the key with `fused`) attends to each row's codes
    with the Triton kernel instead (kvlab.kernels.decode_attention); each row then covers exactly its own
    entries, so the padding mask has nothing to add."""
    fused = getattr(key, "fused", None)
    if fused is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        rows, start = [], 0
        for layer, k, v in fused:  # a layer per row, or one for rows stacked by Rows
            n = layer.keys.shape[0]
            rows.append(decode_attention.decode_attention(query[start : start + n, :, 0], layer, k, v, scale, fused=True))
            start += n
        out = rows[0] if len(rows) == 1 else torch.cat(rows)  # one layer for all rows when Rows stacked them
        return out.to(query.dtype)[:, None], None
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, sdpa_gqa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def language_model(model) -> torch.nn.Module:
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def decoder_layers(model) -> torch.nn.ModuleList:
    return language_model(model).layers


def attention_layers(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in decoder_layers(model)]


def is_sliding(model, layer_idx: int) -> bool:
    """Sliding-window layers keep their own window; compression leaves them alone (and the report says so)."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    return bool(types) and types[layer_idx] == "sliding_attention"


@dataclass
class LayerCapture:
    """What a press's compress() reads for one layer: the attention input and RoPE tables."""

    hidden_states: torch.Tensor  # (B, T, hidden)
    cos: torch.Tensor  # (B, T, head_dim)
    sin: torch.Tensor  # (B, T, head_dim)
    attentions: torch.Tensor | None  # (B, H, T, T), only under eager attention

    def extend(self, other: "LayerCapture") -> "LayerCapture":
        """Concatenate a later chunk of the same sequence (attention maps are not concatenable)."""
        return LayerCapture(
            torch.cat([self.hidden_states, other.hidden_states], dim=1),
            torch.cat([self.cos, other.cos], dim=1),
            torch.cat([self.sin, other.sin], dim=1),
            None,
        )


@contextmanager
def capture(model, store: list):
    """Record each attention layer's inputs during a forward pass into `store` (one entry per layer)."""
    handles = []

    def hook(module, args, kwargs, output):
        cos, sin = kwargs["position_embeddings"]
        store.append(LayerCapture(kwargs["hidden_states"].detach(), cos.detach(), sin.detach(), output[1]))

    try:
        for layer in attention_layers(model):
            handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        yield store
    finally:
        for h in handles:
            h.remove()


@dataclass
class Prefilled:
    """A prefilled prompt prefix: its cache, per-layer captures and length."""

    cache: DynamicCache
    captures: list[LayerCapture]
    length: int


@torch.no_grad()
def prefill(model, ids: list[int], past: Prefilled | None = None) -> Prefilled:
    """Run `ids` through the model (continuing `past` if given) with the full cache, capturing inputs."""
    device = model.device
    cache = shallow_copy(past.cache) if past else DynamicCache(config=model.config)
    start = past.length if past else 0
    store: list[LayerCapture] = []
    x = torch.tensor([ids], device=device)
    positions = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
    with capture(model, store):
        model.model(input_ids=x, past_key_values=cache, position_ids=positions, use_cache=True)
    if past:
        store = [a.extend(b) for a, b in zip(past.captures, store)]
    return Prefilled(cache, store, start + len(ids))


@torch.no_grad()
def compress(model, base: Prefilled, variant: Variant) -> DynamicCache:
    """A compressed copy of `base.cache` for `variant`: evicted by its press (if any) or by its own evictor
    (`EVICTORS`: H2O's layers, which go on evicting while decoding), then quantized (if a quantized method).
    For full, a copy sharing the base's tensors."""
    cache = shallow_copy(base.cache)
    press = variant.make_press()
    sliding = [is_sliding(model, i) for i in range(len(cache.layers))]
    if press is not None:
        press.post_init_from_model(model)
        cache_position = torch.arange(base.length, device=model.device)
        rotary = language_model(model).rotary_emb
        weights = variant.params.get("layer_budgets")  # calibrated per-layer weights: one budget per layer
        per_layer = layer_budgets(variant.budget, weights, sliding) if weights is not None else None
        for idx, module in enumerate(attention_layers(model)):
            if sliding[idx]:
                continue
            if per_layer is not None:
                press.compression_ratio = 1.0 - per_layer[idx]
            module.rotary_emb = rotary  # as kvpress's hooks set it (KeyRerotationPress reads it)
            cap = base.captures[idx]
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
                layer.masked = torch.zeros(layer.keys.shape[:3], dtype=torch.bool, device=layer.keys.device)
                layer.masked[batch, head, seq] = True  # (1, H_kv, T): hidden from attention, still stored
        if variant.rerotates:
            rerotated(model, cache, variant, base.length)
    if variant.kind in EVICTORS:
        importlib.import_module(EVICTORS[variant.kind]).evict(model, cache, base, variant, sliding)
    if variant.quantized:
        quantize_layers(cache, {"kind": variant.kind, **variant.params}, sliding, base.captures)
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
    cache.position_shift = kept.pop() - context


def shallow_copy(cache: DynamicCache) -> DynamicCache:
    """A cache whose layers can be reassigned without touching `cache`; the tensors are shared, which is
    safe because neither presses nor DynamicCache updates write into existing tensors (both build new ones)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def held_tokens(layer) -> int:
    """Tokens a cache layer holds now (a sliding-window layer's get_seq_length counts every token it saw)."""
    return layer.get_seq_length() if kvcache.is_quantized(layer) else layer.keys.shape[-2]


def cache_stats(cache: DynamicCache, variant: Variant, context: int) -> dict:
    """What the cache really holds after compressing a `context`-token prefill: bytes of the stored tensors
    (not the requested ratio), the accounting formula's bytes for what is held, and the compression against
    the uncompressed context in bf16 (codes and metadata as stored; full-precision residual, sinks and dense
    entries counted at 2 bytes per element, so the ratio does not depend on the run's compute dtype)."""
    nbytes = formula = stored_bf16 = reference_bf16 = code_bytes = code_tokens_bf16 = 0
    tokens, kept = [], []
    for layer in cache.layers:
        held = held_tokens(layer)
        tokens.append(held)
        measured = kvcache.layer_nbytes(layer)
        nbytes += measured
        quantized = getattr(layer, "_quantized_keys", None)
        heads, d = (quantized if quantized is not None else layer.keys).shape[1::2]
        masked = getattr(layer, "masked", None)
        kept += [held - int(m) for m in masked[0].sum(-1)] if masked is not None else [held] * heads
        token_bf16 = 2 * heads * d * 2
        reference_bf16 += (held if getattr(layer, "is_sliding", False) else context) * token_bf16
        dense = layer.keys.numel() + layer.values.numel()  # full-precision entries (the residual, for quantized layers)
        if isinstance(layer, kvcache.QuantizedKVLayer):
            n = layer.counts()
            key, value = layouts({"kind": variant.kind, **variant.params}, d)
            dense_tokens = n["sink_tokens"] + n["residual_tokens"]
            formula += accounting.stored_layer_bytes(key, value, heads, d, n["quantized_tokens"], dense_tokens, layer.keys.element_size())
            stored_bf16 += accounting.stored_layer_bytes(key, value, heads, d, n["quantized_tokens"], dense_tokens, 2)
            code_bytes += measured - dense * layer.keys.element_size() - (0 if layer.sink_keys is None else 2 * layer.sink_keys.numel() * layer.sink_keys.element_size())
            code_tokens_bf16 += n["quantized_tokens"] * token_bf16
        elif quantized is not None:  # transformers' QuantizedCache layer: measured only
            formula = float("nan")
            stored_bf16 += measured - dense * layer.keys.element_size() + dense * 2
        else:
            formula += measured
            stored_bf16 += dense * 2
    return {
        "kv_bytes": int(nbytes), "kv_tokens_mean": float(sum(tokens) / len(tokens)), "kv_bytes_formula": formula,
        # tokens each (layer, KV head) attends to: below kv_tokens_mean only for presses that mask without freeing
        "kv_kept_heads": kept, "kv_kept_mean": float(sum(kept) / len(kept)), "kv_kept_min": int(min(kept)),
        "compression_vs_bf16": reference_bf16 / stored_bf16,
        # the quantized tokens alone: bf16 bytes / their codes and metadata (the steady-state ratio)
        "codes_vs_bf16": code_tokens_bf16 / code_bytes if code_bytes else float("nan"),
    }


def masked_entries(layers: list, width: int, sizes: list[int] | None = None) -> torch.Tensor | None:
    """(B, H_kv, width): the entries each row's press masked per KV head (AdaKV), left-aligned, False beyond
    what a row holds; None when no row masks anything. `sizes`: the sequences each layer holds (default 1)."""
    masks = [m for layer, n in zip(layers, sizes or [1] * len(layers)) for m in [getattr(layer, "masked", None)] * n]
    if all(m is None for m in masks):
        return None
    ref = next(m for m in masks if m is not None)
    out = torch.zeros(len(masks), ref.shape[1], width, dtype=torch.bool, device=ref.device)
    for i, m in enumerate(masks):
        if m is not None:
            out[i, :, : m.shape[-1]] = m[0]
    return out


def decode_path(cache: DynamicCache, device) -> str:
    """How decoding attends to this cache on `device`: 'triton codes' (the kernel reads the packed codes),
    'dequantize' (quantized layers rebuilt in full precision at every step) or 'dense'."""
    quantized = [layer for layer in cache.layers if kvcache.is_quantized(layer)]
    if not quantized:
        return "dense"
    return "triton codes" if decode_attention.fused_rows(quantized, device) else "dequantize"


def own_layout(layer) -> bool:
    """Layers that cannot be stacked with others: quantized storage, or per-step eviction (H2O: `own_layout`)."""
    return kvcache.is_quantized(layer) or getattr(layer, "own_layout", False)


def host_free_step(caches: list[DynamicCache], device) -> bool:
    """Whether a one-token step of these caches decoded as one batch waits for nothing on the host, so that a
    CUDA graph can capture it: every layer that `Batch` keeps per row (`Rows`) is read by the decode kernel;
    dense layers never wait. H2O, KVQuant's keys, transformers' quantized caches and the dequantizing path
    build per-row masks from host-side lengths."""
    return all(decode_attention.fused_rows(rows, device) for rows in zip(*(c.layers for c in caches))
               if any(own_layout(r) for r in rows))


class Rows(DynamicLayer):
    """One batched cache layer over per-row layers of any kind (quantized or H2O layers cannot be
    concatenated, and an H2O row changes length at every step): each row's own layer is updated with its
    slice of the new tokens; its entries are laid out left-aligned, padding at the end, and `mask` hides the
    padding and keeps the new tokens causal. Rows are forked first; the original caches are never touched.
    Quantized rows that can share one layer (one spec object, the same counts: copies of one compressed cache,
    as the throughput benchmark decodes; see ``kvcache.stack_layers``) are stacked into one layer of that many
    rows, updated and attended to at once."""

    def __init__(self, rows: list):
        super().__init__()
        stacked = kvcache.stack_layers(rows)
        self.rows = [stacked] if stacked is not None else [kvcache.fork_layer(r) for r in rows]
        self.sizes = [len(rows)] if stacked is not None else [1] * len(rows)  # batch rows each layer holds
        self.is_initialized = True
        self.wants_query = any(getattr(r, "wants_query", False) for r in rows)
        self.pending_query: torch.Tensor | None = None  # (B, Hq, n, D), handed to the rows that score attention

    def slices(self):
        """(layer, its batch rows as a slice) for every layer."""
        start = 0
        for row, n in zip(self.rows, self.sizes):
            yield row, slice(start, start + n)
            start += n

    def held(self) -> list[int]:
        return [r.get_seq_length() for r, n in zip(self.rows, self.sizes) for _ in range(n)]

    def mask(self, n: int, dtype: torch.dtype, device, query_heads: int) -> torch.Tensor:
        """Additive mask (B, 1, n, kv) for feeding `n` more tokens: row r's query q sees its first held + q + 1.
        Where a row's press masked entries per KV head (AdaKV), the mask is per query head (B, H_q, n, kv) and
        hides them too (a dense row's entries sit at positions 0…held-1, so its mask applies as it is)."""
        held = torch.tensor(self.held(), device=device)
        j = torch.arange(int(held.max()) + n, device=device)
        allowed = (j[None, None, :] <= held[:, None, None] + torch.arange(n, device=device)[None, :, None])[:, None]
        hidden = masked_entries(self.rows, j.numel(), self.sizes)
        if hidden is not None:
            allowed = allowed & ~hidden.repeat_interleave(query_heads // hidden.shape[1], dim=1)[:, :, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def fused(self, n: int, device) -> bool:
        """Whether feeding `n` tokens is a one-token step over rows that are all quantized in a format the
        decode kernel reads: attention then reads each row's codes (see sdpa_gqa) and needs no mask."""
        return n == 1 and decode_attention.fused_rows(self.rows, device)

    def update(self, key_states, value_states, cache_kwargs=None):
        b, h, n, d = key_states.shape
        if self.fused(n, key_states.device):  # store the token; attention reads each row's codes (see sdpa_gqa)
            steps = []
            for row, rows in self.slices():
                k, v = key_states[rows], value_states[rows]
                before = kvcache.fork_layer(row)
                row.append(k, v)
                # The new token's query sees the codes, and every other token in full precision: the row itself
                # when the append only grew its residual (no copy of it), else the row as it was, plus the token.
                steps.append((row, None, None) if row.quantized == before.quantized else (before, k, v))
            key_states = key_states.view_as(key_states)
            key_states.fused = steps
            return key_states, value_states
        keys = key_states.new_zeros(b, h, max(self.held()) + n, d)
        values = torch.zeros_like(keys)
        for row, rows in self.slices():
            kw = cache_kwargs and {k: v[rows] if torch.is_tensor(v) and v.dim() == 3 else v for k, v in cache_kwargs.items()}
            if getattr(row, "wants_query", False):
                row.pending_query = self.pending_query[rows]
            k, v = row.update(key_states[rows], value_states[rows], kw)
            keys[rows, :, : k.shape[-2]], values[rows, :, : v.shape[-2]] = k, v
        self.pending_query = None
        return keys, values

    def get_seq_length(self) -> int:
        return max(self.held())

    def keep(self, rows: list[int]) -> None:
        """Keep these batch rows (ascending), dropping the others."""
        kept, sizes = [], []
        for layer, span in self.slices():
            local = [r - span.start for r in rows if span.start <= r < span.stop]
            if local:
                kept.append(layer if len(local) == span.stop - span.start else kvcache.select_rows(layer, local))
                sizes.append(len(local))
        self.rows, self.sizes = kept, sizes


class Batch:
    """Several single-row caches of the same prompt as one batched cache, each layer right-padded to its
    longest row; `lengths[layer][row]` is what that row really holds. Sliding layers are never compressed,
    so they are equal across rows and need no padding. Layers where some row is quantized become `Rows`."""

    def __init__(self, model, caches: list[DynamicCache]):
        self.model = model
        self.cache = shallow_copy(caches[0])
        self.lengths: list[torch.Tensor] = []
        self.padded: list[int] = []
        self.masked: list[torch.Tensor | None] = []  # (B, H_kv, width): entries a masking press hides, per layer
        self.padded_rows: list[bool] = []  # whether some row of a layer holds fewer entries than its width
        for idx, layer in enumerate(self.cache.layers):
            rows = [c.layers[idx] for c in caches]
            n = [held_tokens(r) for r in rows]
            width = max(n)
            own = any(own_layout(r) for r in rows)
            if own:
                self.cache.layers[idx] = Rows(rows)
            else:
                layer.keys = torch.cat([_pad(r.keys, width) for r in rows])
                layer.values = torch.cat([_pad(r.values, width) for r in rows])
            self.lengths.append(torch.tensor(n, device=model.device))
            self.padded.append(width)
            self.padded_rows.append(min(n) < width)  # dropping rows (keep) never adds padding
            self.masked.append(None if own else masked_entries(rows, width))  # Rows mask their own rows
        # position shift per row: re-rotated caches decode from their kept length, not the prompt's
        self.shift = torch.tensor([getattr(c, "position_shift", 0) for c in caches], device=model.device)
        self.fed = 0  # tail tokens appended since stacking
        self.stepwise = any(isinstance(layer, Rows) for layer in self.cache.layers)

    @property
    def size(self) -> int:
        return len(self.lengths[0])

    def keep(self, rows: list[int]) -> None:
        """Drop every other row (finished sequences stop costing compute)."""
        index = torch.tensor(rows, device=self.lengths[0].device)
        for idx, layer in enumerate(self.cache.layers):
            if isinstance(layer, Rows):
                layer.keep(rows)
            else:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
            self.lengths[idx] = self.lengths[idx].index_select(0, index)
            if self.masked[idx] is not None:
                self.masked[idx] = self.masked[idx].index_select(0, index)
        self.shift = self.shift.index_select(0, index)

    def full_mask(self, idx: int, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask (B, 1, n, kv) for layer `idx` when feeding `n` more tokens: each row sees its own
        stored entries and the tail causally, never the padding. Where a press masked entries per KV head,
        the mask is per query head (B, H_q, n, kv) and hides them too. None for a one-token step where it would
        hide nothing (no padding, no masked entries): attention then runs without one, as a dense cache's decode
        does in any server (with a mask SDPA cannot take its flash kernel, and building it is several launches
        per layer and step)."""
        if n == 1 and not self.padded_rows[idx] and self.masked[idx] is None:
            return None
        width, device = self.padded[idx], self.lengths[idx].device
        kv = width + self.fed + n
        j = torch.arange(kv, device=device)
        stored = (j[None, :] < self.lengths[idx][:, None])[:, None, :]  # (B, 1, kv)
        if self.masked[idx] is not None:
            hidden = torch.nn.functional.pad(self.masked[idx], (0, kv - width))  # (B, H_kv, kv)
            groups = self.model.config.get_text_config().num_attention_heads // hidden.shape[1]
            stored = (stored & ~hidden).repeat_interleave(groups, dim=1)  # (B, H_q, kv)
        tail_pos = j - width  # position of key j within the tail
        query = self.fed + torch.arange(n, device=device)  # position of each query within the tail
        causal = (tail_pos[None, :] >= 0) & (tail_pos[None, :] <= query[:, None])  # (n, kv)
        allowed = stored[:, :, None, :] | causal[None, None, :, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int, logits_to_keep: int = 1) -> torch.Tensor:
        """Feed `ids` (B, n) at original positions start… (a re-rotated row: at its kept length, see `shift`);
        return the last `logits_to_keep` logits."""
        model, n = self.model, ids.shape[1]
        pos = torch.arange(start, start + n, device=ids.device)[None, :] + self.shift[:, None]
        heads = model.config.get_text_config().num_attention_heads
        masks = {
            idx: (None if layer.fused(n, ids.device) else layer.mask(n, model.dtype, ids.device, heads))
            if isinstance(layer, Rows) else self.full_mask(idx, n, model.dtype)
            for idx, layer in enumerate(self.cache.layers) if not is_sliding(model, idx)
        }
        layer_masks = {"full_attention": None}
        if len(masks) < len(self.padded):
            config = model.config.get_text_config()
            embeds = torch.empty(ids.shape[0], n, config.hidden_size, dtype=model.dtype, device=ids.device)
            layer_masks["sliding_attention"] = create_sliding_window_causal_mask(
                config=config, inputs_embeds=embeds, attention_mask=None, cache_position=pos[0],
                past_key_values=self.cache, position_ids=None,
            )
        with per_layer_masks(model, masks), query_hooks(model, self.cache):
            out = model(
                input_ids=ids, attention_mask=layer_masks, past_key_values=self.cache, position_ids=pos,
                use_cache=True, logits_to_keep=logits_to_keep,
            )
        self.fed += n
        return out.logits


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[-2]))


def project(module, hidden: torch.Tensor, which: str) -> torch.Tensor:
    """Pre-RoPE queries or keys (B, H, T, d) of one attention layer from its input hidden states."""
    proj = getattr(module, f"{which}_proj")
    x = proj(hidden).view(hidden.shape[0], hidden.shape[1], -1, module.head_dim).transpose(1, 2)
    norm = getattr(module, f"{which}_norm", None)  # Gemma 3 normalizes q and k before RoPE
    return norm(x) if norm is not None else x


def queries(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention's post-RoPE queries (B, Hq, T, d), recomputed from its input (for attention scores)."""
    return kvcache.rotate(project(module, hidden, "q"), cos[:, None], sin[:, None])


@contextmanager
def query_hooks(model, cache):
    """Hand each attention layer's queries to its cache layer before the update, where the layer scores
    attention itself (H2O), so the model keeps its fast attention that returns no weights."""
    handles = []

    def hook_for(layer):
        def hook(module, args, kwargs):
            cos, sin = kwargs["position_embeddings"]
            layer.pending_query = queries(module, kwargs["hidden_states"], cos, sin)
        return hook

    try:
        for idx, module in enumerate(attention_layers(model)):
            layer = cache.layers[idx]
            if getattr(layer, "wants_query", False):
                handles.append(module.register_forward_pre_hook(hook_for(layer), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def per_layer_masks(model, masks: dict[int, torch.Tensor]):
    """Give attention layer i the mask masks[i] (transformers builds one mask per layer *type*)."""
    handles = []

    def hook_for(mask):
        def hook(module, args, kwargs):
            kwargs["attention_mask"] = mask
            return args, kwargs

        return hook

    try:
        for idx, layer in enumerate(attention_layers(model)):
            if idx in masks:
                handles.append(layer.register_forward_pre_hook(hook_for(masks[idx]), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def stop_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


@torch.no_grad()
def greedy_decode(
    model, caches: list[DynamicCache], tail: list[int], start: int, max_new_tokens: int, stop: bool = True
) -> list[list[int]]:
    """Feed `tail` after each cache at original positions `start…`, then decode greedily, all rows as one
    batch, until every row has produced EOS or the cap. Each row's ids end at its first EOS (with `stop`
    false EOS is ignored: exactly `max_new_tokens` steps, for timing).

    Positions continue from the uncompressed prompt length, as in kvpress: evicted entries keep the
    RoPE rotation they were cached with. A re-rotated cache (KeyRerotationPress) continues at its kept length.
    """
    batch = Batch(model, caches)
    eos = stop_ids(model) if stop else set()
    x = torch.tensor([tail] * batch.size, device=model.device)
    pos = start
    out: list[list[int]] = [[] for _ in range(batch.size)]
    live = list(range(batch.size))  # batch row i decodes sequence live[i]
    for _ in range(max_new_tokens):
        nxt = batch.forward(x, pos)[:, -1].argmax(-1)
        pos += x.shape[1]
        going = []
        for row, token in enumerate(nxt.tolist()):
            out[live[row]].append(token)
            if token not in eos:
                going.append(row)
        if not going:
            break
        if len(going) < len(live):
            batch.keep(going)
            live = [live[r] for r in going]
        x = nxt[going, None]
    return out


@torch.no_grad()
def teacher_forced(model, caches: list[DynamicCache], tail: list[int], path: list[int], start: int) -> torch.Tensor:
    """Log-probabilities (B, len(path), V) each row assigns to every token of `path` when `tail` and
    `path` are fed after its cache. Dense caches take one forward pass for all tokens; quantized ones and those
    that evict while decoding (H2O, see `own_layout`) are fed the path one token at a time, as in decoding, so
    each token sees earlier ones as the cache stores them (quantized once they leave the residual window)."""
    if not tail:
        raise ValueError("teacher forcing needs at least one tail token after the cache (its logits predict path[0])")
    quantized = [any(own_layout(layer) for layer in c.layers) for c in caches]
    out = None
    for group in ([i for i, q in enumerate(quantized) if not q], [i for i, q in enumerate(quantized) if q]):
        if not group:
            continue
        batch = Batch(model, [caches[i] for i in group])
        ids = torch.tensor([tail + path[:-1]] * batch.size, device=model.device)
        if not batch.stepwise:
            logits = batch.forward(ids, start, logits_to_keep=len(path))
        else:
            first = len(tail)  # the tail's last logits predict path[0]
            steps = [batch.forward(ids[:, :first], start)]
            steps += [batch.forward(ids[:, i : i + 1], start + i) for i in range(first, ids.shape[1])]
            logits = torch.cat(steps, dim=1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        if out is None:
            out = logp.new_empty(len(caches), *logp.shape[1:])
        out[group] = logp
    return out


def divergence(logp: torch.Tensor, path: list[int], ref: int) -> list[dict]:
    """Per row: mean and max per-token KL(row `ref` ‖ row) and mean NLL of `path` (nats)."""
    p_ref = logp[ref].exp()
    kl = (p_ref * (logp[ref] - logp)).sum(-1).clamp_min(0)  # (B, T)
    target = torch.tensor(path, device=logp.device)
    nll = -logp.gather(-1, target.expand(logp.shape[0], -1)[..., None])[..., 0]  # (B, T)
    return [
        {"kl_vs_full": float(kl[b].mean()), "kl_max": float(kl[b].max()), "nll": float(nll[b].mean()),
         "ppl": math.exp(float(nll[b].mean())), "tf_tokens": len(path)}
        for b in range(logp.shape[0])
    ]


QUESTION_MODES = {  # mode -> (what the cache was compressed with, which turns it labels)
    "agnostic": ("agnostic", lambda turn: True),  # the context alone: no question ever seen
    "aware": ("aware", lambda turn: turn == 1),  # the question asked is inside the compressed prompt
    "multi_turn": ("aware", lambda turn: turn > 1),  # compressed for the first question, asked a later one
}


def evaluate_sample(
    model, tokenizer, sample: Sample, variants: list[Variant], modes: list[str], max_new_tokens: int, kl: bool = True
):
    """Rows for one sample: every variant × question mode × turn, from one shared prefill per compression.

    Question modes (`QUESTION_MODES`): `agnostic` compresses the context before any question (every turn is
    asked on it); `aware` compresses context and question together and answers that question; `multi_turn`
    reuses the aware cache for the sample's later turns (a different question about another needle), so it
    only has rows on samples with follow-up turns. A sample whose question sits inside the context (asked
    before the document) is compressed once for both agnostic and aware.

    Per compression, each variant compresses its own copy of the prefilled cache; all variants then decode
    as one batch. With `kl`, KL and NLL are teacher-forced along one path per sample and turn: the sample's
    reference text if it has one, else the full cache's own answer (so KL measures how far each method
    drifts from full).
    """
    if sum(v.kind == "full" for v in variants) != 1:
        raise ValueError("the engine needs exactly one 'full' variant as the reference for KL")
    ref = next(i for i, v in enumerate(variants) if v.kind == "full")
    p = sample.prompt
    t0 = time.perf_counter()
    context = prefill(model, p.context)
    prefill_s = {"agnostic": time.perf_counter() - t0}
    bases = {"agnostic": (context, p.question + p.suffix)}
    if any(QUESTION_MODES[m][0] == "aware" for m in modes) and p.question:
        t0 = time.perf_counter()
        bases["aware"] = (prefill(model, p.question, past=context), p.suffix)
        prefill_s["aware"] = prefill_s["agnostic"] + time.perf_counter() - t0
    turns_of = {}  # compression -> {turn number: modes whose rows it gives}
    for mode in modes:
        key = QUESTION_MODES[mode][0] if QUESTION_MODES[mode][0] in bases else "agnostic"
        for number in range(1, len(p.followups) + 2):
            if QUESTION_MODES[mode][1](number):
                turns_of.setdefault(key, {}).setdefault(number, []).append(mode)
    rows = []
    for key, labelled in turns_of.items():
        base, tail = bases[key]
        caches, compress_s, stats = [], [], []
        for variant in variants:
            t0 = time.perf_counter()
            caches.append(compress(model, base, variant))
            compress_s.append(time.perf_counter() - t0)
            stats.append(cache_stats(caches[-1], variant, base.length))
        turns = [(tail, sample.gold)]
        for turn in p.followups:
            turns.append((turns[-1][0] + turn.ids, turn.gold))
        for number, (turn_tail, gold) in enumerate(turns, start=1):
            if number not in labelled:
                continue
            t0 = time.perf_counter()
            decoded = greedy_decode(model, caches, turn_tail, base.length, max_new_tokens) if sample.metric != "none" else [[] for _ in variants]
            decode_s = time.perf_counter() - t0
            path = p.reference if (p.reference and number == 1) else decoded[ref]
            t0 = time.perf_counter()
            div = [{} for _ in variants]
            if kl and path:
                div = divergence(teacher_forced(model, caches, turn_tail, path, base.length), path, ref)
            tf_s = time.perf_counter() - t0
            for i, variant in enumerate(variants):
                prediction = tokenizer.decode(decoded[i], skip_special_tokens=True)
                row = {
                    **sample.row(),
                    "method": variant.method,
                    "method_kind": variant.kind,
                    "press": variant.params.get("press"),
                    "wrapper": variant.params.get("wrapper"),
                    "press_kwargs": json.dumps(variant.params["kwargs"], sort_keys=True) if "press" in variant.params else None,
                    "layer_budgets": "layer_budgets" in variant.params,  # per-layer budgets from calibration
                    **variant.storage,
                    "budget": variant.budget,
                    "turn": number,
                    "gold": list(gold),
                    "compressed_tokens": base.length,
                    "prediction": prediction,
                    "score": score(sample.metric, prediction, gold),
                    **stats[i],
                    **div[i],
                    "prefill_s": prefill_s[key],
                    "compress_s": compress_s[i],
                    "decode_s": decode_s,
                    "decode_batch": len(variants),
                    "teacher_forced_s": tf_s,
                    "new_tokens": len(decoded[i]),
                }
                rows += [{**row, "question_mode": mode} for mode in labelled[number]]
    return rows
