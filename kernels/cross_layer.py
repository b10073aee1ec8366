"""Cross-layer KV sharing (CLA, Brandon et al. 2024, "Reducing Transformer Key-Value Cache Size with Cross-Layer
Attention"; YOCO shares one cache across the upper half), applied post hoc: a layer stores nothing and attends to
the keys and values of an earlier layer (its `source`), for the prompt and for every token fed after it.

A model trained with CLA computes one K/V per group of layers; a model trained without it has a K/V projection per
layer, so here the sharing layer's own K/V are dropped and its queries meet the source layer's: the rows measure
what sharing costs a model never trained for it. kvpress has no cross-layer kind, hence this module.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvlab.kernels.layer import KVLayer


class SharedLayer(KVLayer):
    """A layer that holds its source layer's keys and values (the same tensors at the prompt; the source's inputs,
    appended, after it): no bytes of its own. The engine's batch hands every layer's new keys and values of the
    current forward pass to the update (``cache_kwargs['step_kv']``, by layer index), so the source's are there."""

    own_layout = True  # its entries come from the source's inputs, row by row
    streams = True  # dense: a chunk is read as its single steps would read it

    def __init__(self, source: int, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.shares = keys, values, source

    def update(self, key_states, value_states, cache_kwargs=None):
        step_kv = (cache_kwargs or {}).get("step_kv")
        if step_kv is None or self.shares not in step_kv:
            raise RuntimeError(f"a layer sharing layer {self.shares}'s K/V needs that layer's new keys and values first "
                               "(cache_kwargs['step_kv'], set by engine.Batch); decode it through the engine's batch")
        return DynamicLayer.update(self, *step_kv[self.shares], cache_kwargs)
