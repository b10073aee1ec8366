"""The typed interface between kvlab's cache layers and the engine that batches and decodes them.

transformers' `DynamicLayer` gives `update`, `keys`, `values` and `get_seq_length`. What the engine needs beyond
that is declared on :class:`KVLayer`, which every kvlab layer subclasses (quantized, H2O, masked, the engine's
batched `PerRowLayer`), and read through the functions below, so that a layer of transformers' own (dense, sliding
window, quantized) answers the same questions without carrying kvlab's attributes:

* :func:`wants_query` — the engine's query hooks hand the layer its attention's queries (`pending_query`,
  (B, H_q, n, D)) before every update: layers that score attention themselves (H2O);
* `KVLayer.streams` — a chunk of tokens can be fed in one pass and read as if fed one at a time (teacher forcing
  a known path in one pass; quantized layers decide this in ``kvlab.kernels.stream``);
* :func:`own_layout` — rows cannot be stacked with other rows' layers into one tensor (quantized storage, or a
  length that changes per row at every step): a batch keeps them apart, layer by layer;
* :func:`hidden_entries` — entries a press hid from attention per KV head without freeing them (AdaKV);
* `KVLayer.attends` — the keys each query may read, for layers that read only part of what they hold
  (block-sparse reads), and `read_per_head`, what a decode step then reads;
* `KVLayer.fused_step` — set by an update after which attention reads the stored codes itself (the decode
  kernel over quantized rows) instead of the keys and values the update returned;
* `KVLayer.shares` — the index of the layer whose keys and values this one holds instead of its own (cross-layer
  sharing): it stores no bytes of its own, and its update takes that layer's new keys and values;
* :func:`fork_layer` — an independent copy that can be updated without touching the original.
"""

from __future__ import annotations

import copy
from typing import ClassVar, NamedTuple

import torch
from transformers.cache_utils import DynamicLayer, QuantizedLayer


class FusedRow(NamedTuple):
    """One layer of quantized rows in a fused decode step: attention reads `layer`'s codes, plus `key` and `value`
    (the step's token) in full precision when they are not already in the layer's residual (None then)."""

    layer: DynamicLayer
    key: torch.Tensor | None
    value: torch.Tensor | None


class KVLayer(DynamicLayer):
    """A cache layer the engine knows: its traits are class attributes, its per-instance state defaults to none."""

    wants_query: ClassVar[bool] = False
    own_layout: ClassVar[bool] = False
    streams: ClassVar[bool] = False  # a chunk can be fed in one pass and read as if fed one token at a time
    masked: torch.Tensor | None = None  # (1, H_kv, T) bool: the first T entries hidden from attention, still stored
    pending_query: torch.Tensor | None = None  # set by the query hooks when `wants_query`, consumed by `update`
    fused_step: list[FusedRow] | None = None  # set by an update whose attention reads codes (see `PerRowLayer`)
    shares: int | None = None  # the layer whose keys and values it holds instead of its own (cross-layer sharing)

    def fork(self) -> "KVLayer":
        """An independent copy; subclasses whose updates write into shared tensors copy those too."""
        return copy.copy(self)

    def attends(self, query: torch.Tensor, stepwise: bool) -> torch.Tensor | None:
        """bool (B, H_kv, n, T): which of the T keys the last update returned each of the n queries (B, H_q, n, D)
        may read, beyond the batch's mask; None to read them all (block-sparse reads select here). `stepwise`:
        the n tokens are read as if fed one at a time (a one-token step, or a streamed chunk), not as a prefill."""
        return None

    def read_per_head(self) -> float | None:
        """Key and value vectors per KV head a one-token decode step reads now, where that is not all the layer
        holds (block-sparse reads); None when it reads everything it holds."""
        return None


class Masked(KVLayer):
    """A dense layer from which a press hid entries per KV head without freeing them (kvpress's AdaKV and other
    head-wise presses): it stores every entry, attention must not see those in `masked`. Updates concatenate, as
    transformers' DynamicLayer does; new entries are never hidden."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, masked: torch.Tensor):
        super().__init__()
        if masked.shape != keys.shape[:3] or masked.dtype != torch.bool:
            raise ValueError(f"Masked: the mask must be bool of the keys' (batch, heads, tokens) {tuple(keys.shape[:3])}, "
                             f"got {masked.dtype} {tuple(masked.shape)}")
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.masked = keys, values, masked


def wants_query(layer) -> bool:
    """Whether the engine must hand `layer` its attention's queries before each update."""
    return isinstance(layer, KVLayer) and layer.wants_query


def own_layout(layer) -> bool:
    """Whether a batch must keep `layer`'s rows apart: transformers' quantized layers, or a kvlab layer saying so."""
    return isinstance(layer, QuantizedLayer) or isinstance(layer, KVLayer) and layer.own_layout


def hidden_entries(layer) -> torch.Tensor | None:
    """(1, H_kv, T) bool: the entries a press hid from attention, or None when it hides none."""
    return layer.masked if isinstance(layer, KVLayer) else None


def fork_layer(layer):
    """A copy of a cache layer that can be updated without touching the original."""
    return layer.fork() if isinstance(layer, KVLayer) else copy.copy(layer)
