"""Attention for batched decoding: SDPA with grouped-query heads sharing K/V under a mask, the Triton kernel
over quantized rows, and hooks that give each layer its own mask and hand queries to the caches that score them."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.profiler import record_function
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvlab.models.structure import attention_layers, queries
from kvlab.kernels import decode_attention
from kvlab.kernels.layer import KVLayer, wants_query


ATTENTION = "kvlab_sdpa_gqa"
_READING: ContextVar = ContextVar("kvlab_reading", default=None)  # the cache a forward pass reads (see `reading`)
_FOLDED: ContextVar = ContextVar("kvlab_folded", default=None)  # masks folded for grouped heads in this pass (`_grouped`)


@contextmanager
def reading(cache):
    """Let attention find the cache layer a forward pass reads, by the attention module's `layer_idx`: a layer
    whose update set `fused_step` is read from its codes (`sdpa_gqa`). Within the pass, a mask that several layers
    share (`Batch.same_mask_as`) is folded for grouped heads once (`_grouped`)."""
    token, folded = _READING.set(cache), _FOLDED.set({})
    try:
        yield
    finally:
        _FOLDED.reset(folded)
        _READING.reset(token)


def _layer(module) -> KVLayer | None:
    """The kvlab cache layer `module` attends to in the forward pass under `reading`, or None."""
    cache = _READING.get()
    layer = None if cache is None else cache.layers[module.layer_idx]
    return layer if isinstance(layer, KVLayer) else None


def fused_step(module):
    """The `fused_step` of the cache layer `module` attends to (see `reading`), or None."""
    layer = _layer(module)
    return None if layer is None else layer.fused_step


def restricted(module, query, key, mask):
    """`mask` with the keys the cache layer does not let each query read (`KVLayer.attends`: block-sparse reads)
    hidden: an additive (B, H_q, n, kv) mask; `mask` itself when the layer reads every key."""
    layer = _layer(module)
    allowed = None if layer is None else layer.attends(query, stepwise=query.shape[2] == 1)
    if allowed is None:
        return mask
    b, hq, n, kv = query.shape[0], query.shape[1], query.shape[2], key.shape[-2]
    allowed = torch.nn.functional.pad(allowed, (0, kv - allowed.shape[-1]), value=True)
    allowed = allowed.repeat_interleave(hq // allowed.shape[1], dim=1)
    base = torch.zeros(b, hq, n, kv, dtype=query.dtype, device=query.device) if mask is None else mask.expand(b, hq, n, kv)
    return base.masked_fill(~allowed, torch.finfo(query.dtype).min)


@record_function("kvlab.attention")
def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, but grouped-query heads share their K/V inside the kernel even when a
    mask is given. transformers' own `sdpa` copies every cached K/V head to each query head it serves
    whenever there is a mask (a full copy of the cache per layer and step: 7x for Qwen2.5-0.5B), which is
    what our batched decoding always passes. Same result (tested), several times faster on the CPU. On CUDA a
    masked call copies them after all (`repeats_kv`: there the kernels that take a mask do not take shared heads).

    A decode step over quantized rows (whose update set the layer's `fused_step`, see `reading`) attends to each
    row's codes with the Triton kernel instead (kvlab.kernels.decode_attention); each row then covers exactly its
    own entries, so the padding mask has nothing to add."""
    fused = fused_step(module)
    if fused is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        rows, start = [], 0
        for layer, k, v in fused:  # a layer per row, or one for rows stacked by PerRowLayer
            n = layer.keys.shape[0]
            rows.append(decode_attention.decode_attention(query[start : start + n, :, 0], layer, k, v, scale, fused=True))
            start += n
        out = rows[0] if len(rows) == 1 else torch.cat(rows)  # one layer for all rows when PerRowLayer stacked them
        return out.to(query.dtype)[:, None], None
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    given = attention_mask
    attention_mask = restricted(module, query, key, attention_mask)
    causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    if grouped_heads(query, key, causal):
        return _grouped(query, key, value, attention_mask, dropout, scaling, shared=attention_mask is given), None
    return _sdpa(query, key, value, attention_mask, dropout, scaling, causal).transpose(1, 2).contiguous(), None


def repeats_kv(device: torch.device, mask: torch.Tensor | None, query_heads: int, kv_heads: int) -> bool:
    """Whether attention copies each K/V head to the query heads it serves before SDPA (`_sdpa`): under a mask, on
    CUDA, for grouped heads. There SDPA's kernels that take a mask (memory-efficient, cuDNN) do not take grouped
    heads (`enable_gqa`), and the call falls back to the math kernel, which writes out every score (a 32K
    prefill's: n·kv per head); with the copy it takes the memory-efficient kernel. Without a mask the flash kernel
    takes grouped heads as they are; on the CPU the flash kernel takes both, and the copy would only cost memory."""
    return device.type == "cuda" and mask is not None and kv_heads != query_heads


def _sdpa(query, key, value, mask, dropout, scaling, causal, repeat: bool | None = None) -> torch.Tensor:
    """SDPA (B, Hq, n, D) with grouped-query heads: each K/V head copied to its query heads first where `repeat`
    (default `repeats_kv`: masked, on CUDA), else shared inside the kernel (`enable_gqa`). The same attention either
    way (tested on the CPU)."""
    groups = query.shape[1] // key.shape[1]
    if repeat is None:
        repeat = repeats_kv(query.device, mask, query.shape[1], key.shape[1])
    if repeat and groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )


def grouped_heads(query: torch.Tensor, key: torch.Tensor, causal: bool) -> bool:
    """Whether to fold each KV head's query heads into the query axis (`_grouped`): for 16-bit queries on the CPU,
    where torch's flash kernel for the CPU handles every query head apart (converting its K/V block to fp32 each
    time) and a one-token step took 10x longer in bf16 than in fp32: 17 ms against 1.8 ms folded, at 16 rows of
    a 1K cache of Qwen2.5-0.5B's layer on 2 threads (AVX512-BF16 EPYC). Not for a causal chunk without a mask
    (a prefill: folding would need the mask written out) nor in fp32, whose results stay as they were."""
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) and not causal
            and query.shape[1] != key.shape[1])


def _grouped(query, key, value, mask, dropout, scaling, shared: bool = False) -> torch.Tensor:
    """SDPA with the G query heads of each KV head as G·n query rows of that head: (B, Hq, n, D) is viewed as
    (B, Hkv, G·n, D) and the mask (B, 1 or Hq, n, kv) as (B, 1 or Hkv, G·n, kv). Every query row attends on its
    own, so this is the same attention, computed with the same kernel's fp32 arithmetic. Returns (B, n, Hq, D).
    `shared`: the mask is the one the pass handed the layer (no layer-own restriction, see `restricted`), alive for
    the whole pass: under `reading`, its folded copy is made once and reused by every layer handed the same mask
    (a teacher-forced pass's mask folded is G·n·kv per row, ~15 MB per layer at 16 rows of a 1K cache)."""
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    if mask is not None:
        memo = _FOLDED.get() if shared else None
        # the mask's storage lives through the pass (`shared`), so its address and layout name its contents
        name = None if memo is None else (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, g)
        folded = None if name is None else memo.get(name)
        if folded is None:
            folded = mask[:, :, None].expand(b, 1, g, n, mask.shape[-1]) if mask.shape[1] == 1 else mask
            folded = folded.reshape(b, hkv if mask.shape[1] == hq else 1, g * n, mask.shape[-1])
            if memo is not None:
                memo[name] = folded
        mask = folded
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, hkv, g * n, d), key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.view(b, hq, n, d).transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION, sdpa_gqa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
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
            if wants_query(layer):
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
