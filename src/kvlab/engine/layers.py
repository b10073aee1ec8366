"""A batch's layers (kvlab.engine.batch): `PerRowLayer`, one layer over per-row layers of any kind (quantized, H2O), and
`Growing`, a dense layer that appends in place; the entries each row's press masked per head (`masked_entries`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.profiler import record_function
from transformers.cache_utils import DynamicLayer

from kvlab.engine.tuning import tuned
from kvlab.kernels import decode_attention, kvcache
from kvlab.kernels import stream as kvstream
from kvlab.kernels.layer import FusedRow, KVLayer, fork_layer, hidden_entries, own_layout, wants_query


def masked_entries(layers: list, width: int, sizes: list[int] | None = None) -> torch.Tensor | None:
    """(B, H_kv, width): the entries each row's press masked per KV head (AdaKV), left-aligned, False beyond
    what a row holds; None when no row masks anything. `sizes`: the sequences each layer holds (default 1)."""
    masks = [m for layer, n in zip(layers, sizes or [1] * len(layers)) for m in [hidden_entries(layer)] * n]
    if all(m is None for m in masks):
        return None
    ref = next(m for m in masks if m is not None)
    out = torch.zeros(len(masks), ref.shape[1], width, dtype=torch.bool, device=ref.device)
    for i, m in enumerate(masks):
        if m is not None:
            out[i, :, : m.shape[-1]] = m[0]
    return out


class PerRowLayer(KVLayer):
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
        self.rows = [stacked] if stacked is not None else [fork_layer(r) for r in rows]
        self.sizes = [len(rows)] if stacked is not None else [1] * len(rows)  # batch rows each layer holds
        self.is_initialized = True
        self.wants_query = any(wants_query(r) for r in rows)  # then `pending_query` is handed on to those rows
        self.streaming = False  # set by Batch.forward(stream=True): a chunk read as if fed one token at a time

    def slices(self):
        """(layer, its batch rows as a slice) for every layer."""
        start = 0
        for row, n in zip(self.rows, self.sizes):
            yield row, slice(start, start + n)
            start += n

    def held(self) -> list[int]:
        return [r.get_seq_length() for r, n in zip(self.rows, self.sizes) for _ in range(n)]

    @record_function("kvlab.masks")
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

    def streamable(self) -> bool:
        """Whether a chunk of tokens can be fed to every row in one pass as if one at a time: each row is its own
        layer (not stacked) and is quantized with complete sinks or says it streams (kernels/stream.py:
        block-sparse reads), or dense and self-contained (H2O rows, which score attention at every step, and
        transformers' quantized layers cannot)."""
        return all(n == 1 for n in self.sizes) and all(
            kvstream.streamable(r) or not own_layout(r) for r in self.rows)

    @record_function("kvlab.masks")
    def stream_mask(self, n: int, dtype: torch.dtype, device, query_heads: int) -> torch.Tensor:
        """Additive mask (B, 1, n, width) over the keys `update` returns while streaming: per row, the entries of
        ``stream.visibility`` (quantized rows: each token seen quantized or not as its single step would see it),
        padding hidden; a press's masked entries (AdaKV, dense rows) hidden per query head."""
        rows = [kvstream.visibility(r, n, device) for r in self.rows]
        width = max(v.shape[-1] for v in rows)
        allowed = torch.stack([torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in rows])[:, None]
        hidden = masked_entries(self.rows, width)
        if hidden is not None:
            allowed = allowed & ~hidden.repeat_interleave(query_heads // hidden.shape[1], dim=1)[:, :, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def fused(self, n: int, device) -> bool:
        """Whether feeding `n` tokens is a one-token step over rows that are all quantized in a format the
        decode kernel reads: attention then reads each row's codes (see sdpa_gqa) and needs no mask."""
        return n == 1 and decode_attention.fused_rows(self.rows, device)

    @record_function("kvlab.rows_update")
    def update(self, key_states, value_states, cache_kwargs=None):
        b, h, n, d = key_states.shape
        self.fused_step = None
        if self.fused(n, key_states.device):  # store the token; attention reads each row's codes (see sdpa_gqa)
            steps = []
            for row, rows in self.slices():
                k, v = key_states[rows], value_states[rows]
                before = fork_layer(row)
                row.append(k, v)
                # The new token's query sees the codes, and every other token in full precision: the row itself
                # when the append only grew its residual (no copy of it), else the row as it was, plus the token.
                steps.append(FusedRow(row, None, None) if row.coded == before.coded else FusedRow(before, k, v))
            self.fused_step = steps
            return key_states, value_states
        if self.streaming and n > 1:
            return self._stream(key_states, value_states, cache_kwargs)
        keys = key_states.new_zeros(b, h, max(self.held()) + n, d)
        values = torch.zeros_like(keys)
        for row, rows in self.slices():
            kw = _row_kwargs(cache_kwargs, rows)
            if wants_query(row):
                row.pending_query = self.pending_query[rows]
            k, v = row.update(key_states[rows], value_states[rows], kw)
            keys[rows, :, : k.shape[-2]], values[rows, :, : v.shape[-2]] = k, v
        self.pending_query = None
        return keys, values

    def attends(self, query: torch.Tensor, stepwise: bool) -> torch.Tensor | None:
        """The rows' own restrictions (`KVLayer.attends`), each row's keys left-aligned as `update` returns them;
        None when no row restricts. A streamed chunk is read stepwise whatever `stepwise` says."""
        stepwise = stepwise or self.streaming
        parts = [(rows, row.attends(query[rows], stepwise)) for row, rows in self.slices() if isinstance(row, KVLayer)]
        parts = [(rows, a) for rows, a in parts if a is not None]
        if not parts:
            return None
        ref, width = parts[0][1], max(a.shape[-1] for _, a in parts)  # sdpa_gqa pads to the keys' width
        out = torch.ones(query.shape[0], ref.shape[1], query.shape[2], width, dtype=torch.bool, device=ref.device)
        for rows, a in parts:
            out[rows, :, :, : a.shape[-1]] = a
        return out

    def _stream(self, key_states, value_states, cache_kwargs):
        """Feed a chunk to every row as if one token at a time (see `stream_mask`); keys right-padded."""
        parts = []
        for row, rows in self.slices():
            kw = _row_kwargs(cache_kwargs, rows)
            update = kvstream.stream_update if isinstance(row, kvcache.QuantizedKVLayer) else type(row).update
            parts.append(update(row, key_states[rows], value_states[rows], kw))
        width = max(k.shape[-2] for k, _ in parts)
        return torch.cat([pad_tokens(k, width) for k, _ in parts]), torch.cat([pad_tokens(v, width) for _, v in parts])

    def get_seq_length(self) -> int:
        return max(self.held())

    def single_rows(self) -> list:
        """Each batch row's own layer, as updated so far (a stacked layer's rows taken apart)."""
        return [part for layer, span in self.slices()
                for part in ([layer] if span.stop - span.start == 1 else
                             [kvcache.select_rows(layer, [i]) for i in range(span.stop - span.start)])]

    def keep(self, rows: list[int]) -> None:
        """Keep these batch rows (ascending), dropping the others."""
        kept, sizes = [], []
        for layer, span in self.slices():
            local = [r - span.start for r in rows if span.start <= r < span.stop]
            if local:
                kept.append(layer if len(local) == span.stop - span.start else kvcache.select_rows(layer, local))
                sizes.append(len(local))
        self.rows, self.sizes = kept, sizes



class Growing(DynamicLayer):
    """A batch's dense layer that appends in place: its rows are stacked once into storage with room for more
    tokens, and a step writes its token there. transformers' `DynamicLayer.update` concatenates, copying the whole
    cache per layer and step (at 16 rows of a 1K cache of Qwen2.5-0.5B in bf16, 200 MB per step: more time than
    the step's attention). `keys` and `values` are views of what is held; room grows by half when used up (at first `room` tokens)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys[0].dtype, keys[0].device, True
        self.length = keys[0].shape[-2]
        self.room = tuned(self.device).room  # tokens of room at first (kvlab.engine.tuning)
        self._keys = self._room(keys, self.room)
        self._values = self._room(values, self.room)
        self._view()

    def _room(self, rows: list[torch.Tensor], room: int) -> torch.Tensor:
        """The rows stacked on the batch axis into fresh storage with `room` more tokens after `length`."""
        b = sum(r.shape[0] for r in rows)
        out = rows[0].new_empty(b, rows[0].shape[1], self.length + room, rows[0].shape[-1])
        start = 0
        for r in rows:
            out[start : start + r.shape[0], :, : self.length] = r[:, :, : self.length]
            start += r.shape[0]
        return out

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def update(self, key_states, value_states, cache_kwargs=None):
        n = key_states.shape[-2]
        if self.length + n > self._keys.shape[-2]:
            room = max(self.room, n, self.length // 2)
            self._keys, self._values = self._room([self._keys], room), self._room([self._values], room)
        self._keys[:, :, self.length : self.length + n] = key_states
        self._values[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._view()
        return self.keys, self.values

    def keep(self, rows: list[int]) -> None:
        """Keep only these batch rows (their room too)."""
        index = torch.tensor(rows, device=self._keys.device)
        self._keys, self._values = self._keys.index_select(0, index), self._values.index_select(0, index)
        self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keep(indices.tolist())

    def crop(self, max_length: int) -> None:
        self.length = min(self.length, max_length if max_length >= 0 else self.length + max_length)
        self._view()



def _row_kwargs(cache_kwargs: dict | None, rows: slice) -> dict | None:
    """A layer update's keyword arguments for some batch rows: per-row tensors (B, n, D: RoPE tables) and the
    forward pass's new keys and values per layer (`step_kv`, see KVCache) sliced to those rows."""
    if not cache_kwargs:
        return cache_kwargs
    out = {k: v[rows] if torch.is_tensor(v) and v.dim() == 3 else v for k, v in cache_kwargs.items()}
    if "step_kv" in out:
        out["step_kv"] = RowsOf(out["step_kv"], rows)
    return out


class RowsOf(Mapping):
    """A forward pass's new keys and values per layer (`step_kv`) as some batch rows see them: an entry is sliced to
    the rows when read. A layer reads at most the one layer it shares (kernels/cross_layer.py), so slicing every
    earlier layer's at every row's update (two slices per layer: at the last of 24 layers ~60 us per row and layer)
    was wasted."""

    def __init__(self, step_kv: dict, rows: slice):
        self.step_kv, self.rows = step_kv, rows

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.step_kv[idx]
        return keys[self.rows], values[self.rows]

    def __contains__(self, idx) -> bool:
        return idx in self.step_kv

    def __iter__(self):
        return iter(self.step_kv)

    def __len__(self) -> int:
        return len(self.step_kv)


def pad_tokens(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` (B, H, n, D) right-padded with zeros to `width` tokens."""
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[-2]))

