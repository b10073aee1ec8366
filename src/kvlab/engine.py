"""The evaluation engine: prefill a sample once with the full cache, then for every variant compress a
copy of that cache and decode greedily from it.

kvpress presses normally compress inside forward hooks during prefill. A press's ``compress`` only
needs the layer's input hidden states, its keys/values and the RoPE tables, none of which compression
changes within the same forward pass (each layer's attention output is computed before its hook runs).
So we capture those per layer during one uncompressed prefill and call ``press.compress`` afterwards, per
variant, on a copy — the same tensors kvpress's hook would see (tests/test_engine.py checks equality).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from kvlab.methods import Variant
from kvlab.tasks.base import Sample
from kvlab.tasks.scoring import score


def attention_layers(model) -> list[torch.nn.Module]:
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


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
    cache = copy.deepcopy(past.cache) if past else DynamicCache(config=model.config)
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
    """A compressed copy of `base.cache` for `variant` (the copy itself for full)."""
    cache = copy.deepcopy(base.cache)
    press = variant.make_press()
    if press is None:
        return cache
    press.post_init_from_model(model)
    cache_position = torch.arange(base.length, device=model.device)
    for idx, module in enumerate(attention_layers(model)):
        if is_sliding(model, idx):
            continue
        cap = base.captures[idx]
        layer = cache.layers[idx]
        kwargs = {
            "hidden_states": cap.hidden_states,
            "position_embeddings": (cap.cos, cap.sin),
            "past_key_values": cache,
            "cache_position": cache_position,
        }
        layer.keys, layer.values = press.compress(module, cap.hidden_states, layer.keys, layer.values, cap.attentions, kwargs)
    return cache


def cache_stats(cache: DynamicCache) -> dict:
    """Bytes and tokens actually held by the cache's stored tensors (not the requested ratio)."""
    nbytes = 0
    tokens = []
    for layer in cache.layers:
        nbytes += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        tokens.append(layer.keys.shape[-2])
    return {"kv_bytes": int(nbytes), "kv_tokens_mean": float(sum(tokens) / len(tokens))}


def tail_masks(model, cache: DynamicCache, x: torch.Tensor, start: int) -> dict:
    """Causal masks for feeding `x` (original positions start…) after a possibly compressed cache.

    transformers derives the mask from the first layer's length; with sliding layers (never compressed)
    first, compressed full layers would then let the tail see later tail tokens. So each layer type gets
    its own mask: full layers counted from their stored length, sliding layers from the original positions.
    """
    config = model.config.get_text_config()
    n = x.shape[1]
    embeds = torch.empty(1, n, config.hidden_size, dtype=model.dtype, device=x.device)
    sliding = [is_sliding(model, i) for i in range(len(cache.layers))]
    full_lengths = {cache.layers[i].get_seq_length() for i, s in enumerate(sliding) if not s}
    if len(full_lengths) > 1:
        raise NotImplementedError(f"full-attention layers hold different lengths {sorted(full_lengths)}; one mask cannot serve them")
    held = full_lengths.pop() if full_lengths else start
    args = dict(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=cache, position_ids=None)
    masks = {"full_attention": create_causal_mask(cache_position=torch.arange(held, held + n, device=x.device), **args)}
    if any(sliding):
        positions = torch.arange(start, start + n, device=x.device)
        masks["sliding_attention"] = create_sliding_window_causal_mask(cache_position=positions, **args)
    return masks


@torch.no_grad()
def greedy_decode(model, tokenizer, cache: DynamicCache, tail: list[int], start: int, max_new_tokens: int) -> list[int]:
    """Feed `tail` at original positions `start…`, then decode greedily until EOS or the cap.

    Positions continue from the uncompressed prompt length, as in kvpress: evicted entries keep the
    RoPE rotation they were cached with.
    """
    device = model.device
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    x = torch.tensor([tail], device=device)
    pos = torch.arange(start, start + len(tail), device=device).unsqueeze(0)
    out = []
    for _ in range(max_new_tokens):
        masks = tail_masks(model, cache, x, int(pos[0, 0]))
        logits = model(
            input_ids=x, attention_mask=masks, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1
        ).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in eos:
            break
        x = torch.tensor([[nxt]], device=device)
        pos = pos[:, -1:] + 1
    return out


def evaluate_sample(model, tokenizer, sample: Sample, variants: list[Variant], modes: list[str], max_new_tokens: int):
    """Rows for one sample: every variant × question mode, from one shared prefill per mode."""
    p = sample.prompt
    t0 = time.perf_counter()
    context = prefill(model, p.context)
    prefill_s = {"agnostic": time.perf_counter() - t0}
    bases = {"agnostic": (context, p.question + p.suffix)}
    if "aware" in modes:
        t0 = time.perf_counter()
        bases["aware"] = (prefill(model, p.question, past=context), p.suffix)
        prefill_s["aware"] = prefill_s["agnostic"] + time.perf_counter() - t0
    rows = []
    decoded: dict[str, tuple] = {}  # full is the same computation in both modes: decode it once
    for variant in variants:
        for mode in modes:
            base, tail = bases[mode]
            t0 = time.perf_counter()
            cache = compress(model, base, variant)
            compress_s = time.perf_counter() - t0
            stats = cache_stats(cache)
            if variant.kind == "full" and variant.method in decoded:
                ids, decode_s = decoded[variant.method]
            else:
                t0 = time.perf_counter()
                ids = greedy_decode(model, tokenizer, cache, tail, base.length, max_new_tokens)
                decode_s = time.perf_counter() - t0
                decoded[variant.method] = (ids, decode_s)
            prediction = tokenizer.decode(ids, skip_special_tokens=True)
            rows.append(
                {
                    **sample.row(),
                    "method": variant.method,
                    "method_kind": variant.kind,
                    "press": variant.params.get("press"),
                    "budget": variant.budget,
                    "question_mode": mode,
                    "compressed_tokens": base.length,
                    "prediction": prediction,
                    "score": score(sample.metric, prediction, sample.gold),
                    **stats,
                    "prefill_s": prefill_s[mode],
                    "compress_s": compress_s,
                    "decode_s": decode_s,
                    "new_tokens": len(ids),
                }
            )
    return rows
