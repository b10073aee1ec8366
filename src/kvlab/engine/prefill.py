"""Prefill with the full cache, capturing what a press's compress() reads per layer; the shallow cache copy."""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from kvlab.models.structure import attention_layers


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


class KVCache(DynamicCache):
    """transformers' DynamicCache, plus what a batch of compressed caches reads: `position_shift`, set when a press
    re-rotated the kept keys to positions 0…n-1 (the rows then decode from n: positions shift by n - context); and
    `step_kv`, when a batch sets it to a dict: each layer's new keys and values of the current forward pass, by layer
    index, handed to every later layer's update (``cache_kwargs['step_kv']``) for layers that share another's K/V."""

    position_shift: int = 0
    step_kv: dict | None = None

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if self.step_kv is not None:
            self.step_kv[layer_idx] = (key_states, value_states)
            cache_kwargs = {**(cache_kwargs or {}), "step_kv": self.step_kv}
        return super().update(key_states, value_states, layer_idx, cache_kwargs)


@dataclass
class Prefilled:
    """A prefilled prompt prefix: its cache, per-layer captures (a continuation's: of its own tokens; read them with
    `capture`) and length, and `shared`: what methods derive
    from the prefill alone, computed once for every variant compressed from it (e.g. H2O's received attention,
    the same at every budget)."""

    cache: KVCache
    captures: list[LayerCapture]
    length: int
    shared: dict = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)  # every token fed (a continuation: the earlier ones first)
    span: tuple[int, int] | None = None  # positions prompt compression may drop (the user's text; see evaluate_samples)
    hidden: torch.Tensor | None = None  # (length, hidden): the last layer's output at every position, final norm applied
    parent: "Prefilled | None" = None  # the prefill this one continues (the context, for a question-aware prefill)
    prefix: int = 0  # leading positions no compression evicts (Prompt.prefix); budgets count the positions after them

    def capture(self, idx: int) -> LayerCapture:
        """Layer `idx`'s captured inputs at every position. A continuation holds only its own tokens' (`captures`)
        and joins them to its parent's at each read: one copy of a long context's captures is held, not two (issue 53:
        at 32K, 8.6 GB each for Llama-3.1-8B in bf16); the joined layer is freed once its reader lets go."""
        own = self.captures[idx]
        return own if self.parent is None else self.parent.capture(idx).extend(own)


@torch.no_grad()
@record_function("kvlab.prefill")
def prefill(model, ids: list[int], past: Prefilled | None = None) -> Prefilled:
    """Run `ids` through the model (continuing `past` if given) with the full cache, capturing inputs."""
    device = model.device
    cache = shallow_copy(past.cache) if past else KVCache(config=model.config)
    start = past.length if past else 0
    store: list[LayerCapture] = []
    x = torch.tensor([ids], device=device)
    positions = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
    with capture(model, store):
        hidden = model.model(input_ids=x, past_key_values=cache, position_ids=positions, use_cache=True).last_hidden_state[0]
    if past:  # a continuation keeps its own tokens' captures: `Prefilled.capture` joins them to its parent's per read
        hidden = torch.cat([past.hidden, hidden])
    return Prefilled(cache, store, start + len(ids), ids=(past.ids if past else []) + list(ids),
                     span=past.span if past else None, hidden=hidden, parent=past, prefix=past.prefix if past else 0)


@torch.no_grad()
@record_function("kvlab.self_information")
def self_information(model, base: Prefilled, start: int = 0, chunk: int = 256) -> list[float]:
    """−log p(ids[t] | ids[:t]) in nats under `model` for positions `start`… of the prefilled `base` (position 0,
    with nothing before it: +inf, never dropped), from the prefill's own last hidden states: only the LM head runs,
    its log-softmax over the vocabulary `chunk` positions at a time."""
    out = [math.inf] if start == 0 else []
    first = max(start, 1)
    target = torch.tensor(base.ids[first:], device=model.device)
    for s in range(first, base.length, chunk):
        logp = model.lm_head(base.hidden[s - 1 : min(s + chunk, base.length) - 1]).float().log_softmax(-1)
        out += (-logp.gather(-1, target[s - first : s - first + chunk, None])[:, 0]).tolist()
    return out

def shallow_copy(cache: DynamicCache) -> DynamicCache:
    """A cache whose layers can be reassigned without touching `cache`; the tensors are shared, which is
    safe because neither presses nor DynamicCache updates write into existing tensors (both build new ones)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out
