"""Many single-row caches of one prompt as one batch: dense layers right-padded with per-layer masks, layers of
quantized or self-evicting rows as `Rows`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.profiler import record_function
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import create_sliding_window_causal_mask

from kvlab.engine.attention import per_layer_masks, query_hooks, reading
from kvlab.engine.compress import held_tokens
from kvlab.models.structure import is_sliding
from kvlab.engine.prefill import KVCache, shallow_copy
from kvlab.kernels import decode_attention, kvcache
from kvlab.kernels import stream as kvstream
from kvlab.kernels.layer import FusedRow, KVLayer, Masked, fork_layer, hidden_entries, own_layout, wants_query


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

def decode_path(cache: DynamicCache, device) -> str:
    """How decoding attends to this cache on `device`: 'triton codes' (the kernel reads the packed codes),
    'dequantize' (quantized layers rebuilt in full precision at every step) or 'dense'."""
    quantized = [layer for layer in cache.layers if kvcache.is_quantized(layer)]
    if not quantized:
        return "dense"
    return "triton codes" if decode_attention.fused_rows(quantized, device) else "dequantize"


def host_free_step(caches: list[DynamicCache], device) -> bool:
    """Whether a one-token step of these caches decoded as one batch waits for nothing on the host, so that a
    CUDA graph can capture it: every layer that `Batch` keeps per row (`Rows`) is read by the decode kernel;
    dense layers never wait. H2O, KVQuant's keys, transformers' quantized caches and the dequantizing path
    build per-row masks from host-side lengths."""
    return all(decode_attention.fused_rows(rows, device) for rows in zip(*(c.layers for c in caches))
               if any(own_layout(r) for r in rows))


class Rows(KVLayer):
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
        return torch.cat([_pad(k, width) for k, _ in parts]), torch.cat([_pad(v, width) for _, v in parts])

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
    the step's attention). `keys` and `values` are views of what is held; room grows by half when used up."""

    ROOM = 64  # tokens of room at first: a decoded answer or a teacher-forced path fits without growing

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys[0].dtype, keys[0].device, True
        self.length = keys[0].shape[-2]
        self._keys = self._room(keys, self.ROOM)
        self._values = self._room(values, self.ROOM)
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
            room = max(self.ROOM, n, self.length // 2)
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


class Batch:
    """Several single-row caches of the same prompt as one batched cache, each layer right-padded to its
    longest row; `lengths[layer][row]` is what that row really holds. Sliding layers are never compressed,
    so they are equal across rows and need no padding. Layers where some row is quantized become `Rows`."""

    def __init__(self, model, caches: list[DynamicCache]):
        self.model = model
        self.cache = shallow_copy(caches[0])
        if isinstance(self.cache, KVCache):
            self.cache.step_kv = {}  # each layer's new K/V per forward pass, for rows whose layers share (KVCache)
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
            elif not isinstance(layer, DynamicSlidingWindowLayer):
                self.cache.layers[idx] = Growing([_pad(r.keys, width) for r in rows], [_pad(r.values, width) for r in rows])
            else:  # a sliding-window layer keeps its own update (it drops what leaves the window)
                layer.keys = torch.cat([_pad(r.keys, width) for r in rows])
                layer.values = torch.cat([_pad(r.values, width) for r in rows])
            self.lengths.append(torch.tensor(n, device=model.device))
            self.padded.append(width)
            self.padded_rows.append(min(n) < width)  # dropping rows (keep) never adds padding
            self.masked.append(None if own else masked_entries(rows, width))  # Rows mask their own rows
        # position shift per row: re-rotated caches decode from their kept length, not the prompt's
        self.shift = torch.tensor([c.position_shift if isinstance(c, KVCache) else 0 for c in caches], device=model.device)
        self.fed = 0  # tail tokens appended since stacking
        self.rejected: torch.Tensor | None = None  # (B, fed) bool: tail entries of drafts a row did not accept (`reject`)
        self.stepwise = any(isinstance(layer, Rows) for layer in self.cache.layers)
        self._alike: list[int] | None = None  # see `alike`

    @property
    def size(self) -> int:
        return len(self.lengths[0])

    def splittable(self) -> bool:
        """Whether `split` can take the rows apart: no sliding-window layer (it keeps its own window)."""
        return all(isinstance(layer, (Rows, Growing)) for layer in self.cache.layers)

    def split(self, rows: list[int] | None = None, fed: list[int] | None = None) -> list[DynamicCache]:
        """Each row as a cache of its own: what it held, then the tokens fed since stacking, without padding (a dense
        layer whose press hid entries per head keeps hiding them: `Masked`), at position shift 0. A new Batch over
        such caches reads them as this one does, so rows fed in different batches (other prompts, other tails) can
        decode as one batch, each at its own positions (set `shift`). Needs `splittable`. `rows`: only these batch
        rows (default all); `fed`: for each of them, how many of the fed tokens it keeps (the first ones; default
        all), e.g. a teacher-forced row resumed where its choice left the path (dense layers only: a quantized
        row's codes cannot be cut back)."""
        if not self.splittable():
            raise ValueError("Batch.split: a sliding-window layer keeps its own window and cannot be split into rows")
        if self.rejected is not None:
            raise ValueError("Batch.split: rows holding rejected draft tokens (`reject`) cannot be split")
        rows = list(range(self.size)) if rows is None else rows
        fed = [self.fed] * len(rows) if fed is None else fed
        if any(not 0 <= n <= self.fed for n in fed):
            raise ValueError(f"Batch.split: a row keeps 0 to {self.fed} of the tokens fed since stacking, not {fed}")
        if any(n < self.fed for n in fed) and any(isinstance(layer, Rows) for layer in self.cache.layers):
            raise ValueError("Batch.split: quantized or self-evicting rows (Rows) cannot keep fewer tokens than were fed")
        out = []
        for _ in rows:
            cache = shallow_copy(self.cache)
            if isinstance(cache, KVCache):
                cache.position_shift, cache.step_kv = 0, None
            out.append(cache)
        for idx, layer in enumerate(self.cache.layers):
            if isinstance(layer, Rows):
                every = layer.single_rows()
                parts = [every[r] for r in rows]
            else:
                parts = [self._dense_row(idx, r, n) for r, n in zip(rows, fed)]
            for cache, part in zip(out, parts):
                cache.layers[idx] = part
        return out

    def _dense_row(self, idx: int, row: int, fed: int) -> DynamicLayer:
        """Row `row` of the dense layer `idx`: its own entries, then the first `fed` tokens of the tail, as a layer of
        its own."""
        layer, held, width = self.cache.layers[idx], int(self.lengths[idx][row]), self.padded[idx]
        keys = torch.cat([layer.keys[row : row + 1, :, :held], layer.keys[row : row + 1, :, width : width + fed]], dim=-2)
        values = torch.cat([layer.values[row : row + 1, :, :held], layer.values[row : row + 1, :, width : width + fed]], dim=-2)
        hidden = self.masked[idx]
        if hidden is not None and bool(hidden[row].any()):
            tail = hidden.new_zeros(1, hidden.shape[1], keys.shape[-2] - held)
            return Masked(keys, values, torch.cat([hidden[row : row + 1, :, :held], tail], dim=-1))
        out = DynamicLayer()
        out.lazy_initialization(keys, values)
        out.keys, out.values = keys, values
        return out

    def keep(self, rows: list[int]) -> None:
        """Drop every other row (finished sequences stop costing compute)."""
        index = torch.tensor(rows, device=self.lengths[0].device)
        for idx, layer in enumerate(self.cache.layers):
            if isinstance(layer, (Rows, Growing)):
                layer.keep(rows)
            else:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
            self.lengths[idx] = self.lengths[idx].index_select(0, index)
            if self.masked[idx] is not None:
                self.masked[idx] = self.masked[idx].index_select(0, index)
        self.shift = self.shift.index_select(0, index)
        if self.rejected is not None:
            self.rejected = self.rejected.index_select(0, index)
        self._alike = None

    def speculable(self) -> bool:
        """Whether rows can be fed draft tokens and drop the ones they reject (`reject`): every layer is a dense
        `Growing` one (rows of `Rows` cannot take back a token: quantized codes, H2O's evictions; a sliding window
        drops what leaves it)."""
        return all(isinstance(layer, Growing) for layer in self.cache.layers)

    def reject(self, counts: list[int]) -> None:
        """After a pass, row r takes back the last `counts[r]` tokens it was fed (drafts it did not accept): they stay
        in storage, hidden from every later query, and the row's later tokens take the positions they held (`shift`).
        Needs `speculable`."""
        if not self.speculable():
            raise ValueError("Batch.reject: only dense rows (no quantized, self-evicting or sliding-window layer) take back tokens")
        if len(counts) != self.size or any(not 0 <= c <= self.fed for c in counts):
            raise ValueError(f"Batch.reject: one count per row ({self.size}), each 0 to {self.fed} tokens fed, not {counts}")
        if not any(counts):
            return
        device = self.shift.device
        back = torch.tensor(counts, device=device)
        j = torch.arange(self.fed, device=device)
        dropped = j[None, :] >= self.fed - back[:, None]
        if self.rejected is not None:
            dropped |= torch.nn.functional.pad(self.rejected, (0, self.fed - self.rejected.shape[1]))
        self.rejected = dropped
        self.shift = self.shift - back

    def alike(self) -> list[int]:
        """Per layer, the first layer whose `full_mask` is the same: the same rows' lengths and width, and no entries
        masked per head (layers that compressed alike: every layer of most presses). A pass builds one mask per
        distinct layout instead of one per layer."""
        if self._alike is None:
            first = {}
            self._alike = [first.setdefault(idx if self.masked[idx] is not None else
                                            (self.padded[idx], tuple(self.lengths[idx].tolist())), idx)
                           for idx in range(len(self.padded))]
        return self._alike

    @record_function("kvlab.masks")
    def full_mask(self, idx: int, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask (B, 1, n, kv) for layer `idx` when feeding `n` more tokens: each row sees its own
        stored entries and the tail causally, never the padding. Where a press masked entries per KV head,
        the mask is per query head (B, H_q, n, kv) and hides them too. None for a one-token step where it would
        hide nothing (no padding, no masked entries): attention then runs without one, as a dense cache's decode
        does in any server (with a mask SDPA cannot take its flash kernel, and building it is several launches
        per layer and step)."""
        if n == 1 and not self.padded_rows[idx] and self.masked[idx] is None and self.rejected is None:
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
        if self.rejected is not None:  # drafts a row did not accept (`reject`)
            dropped = torch.nn.functional.pad(self.rejected, (width, kv - width - self.rejected.shape[1]))
            allowed = allowed & ~dropped[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

    def streamable(self) -> bool:
        """Whether `forward(..., stream=True)` can feed these rows (see `Rows.streamable`)."""
        return all(layer.streamable() for layer in self.cache.layers if isinstance(layer, Rows))

    @torch.no_grad()
    @record_function("kvlab.forward")
    def forward(self, ids: torch.Tensor, start: int, logits_to_keep: int = 1, stream: bool = False) -> torch.Tensor:
        """Feed `ids` (B, n) at original positions start… (a re-rotated row: at its kept length, see `shift`);
        return the last `logits_to_keep` logits. With `stream`, rows of `Rows` layers read the chunk exactly as if
        it were fed one token at a time (teacher forcing a known path in one pass; needs `streamable`); without
        it, a chunk attends to itself in full precision, as a prefill does."""
        model, n = self.model, ids.shape[1]
        rows = [layer for layer in self.cache.layers if isinstance(layer, Rows)]
        if stream and not self.streamable():
            raise ValueError("stream=True: some row cannot be fed as if one token at a time (H2O, transformers' "
                             "quantized layers, stacked copies or incomplete sinks); feed it one token per call")
        pos = torch.arange(start, start + n, device=ids.device)[None, :] + self.shift[:, None]
        heads = model.config.get_text_config().num_attention_heads

        def rows_mask(layer):
            if stream and n > 1:
                return layer.stream_mask(n, model.dtype, ids.device, heads)
            return None if layer.fused(n, ids.device) else layer.mask(n, model.dtype, ids.device, heads)

        alike, made = self.alike(), {}

        def dense_mask(idx):
            if alike[idx] not in made:
                made[alike[idx]] = self.full_mask(alike[idx], n, model.dtype)
            return made[alike[idx]]

        masks = {
            idx: rows_mask(layer) if isinstance(layer, Rows) else dense_mask(idx)
            for idx, layer in enumerate(self.cache.layers) if not is_sliding(model, idx)
        }
        for layer in rows:
            layer.streaming = stream
        layer_masks = {"full_attention": None}
        if len(masks) < len(self.padded):
            config = model.config.get_text_config()
            embeds = torch.empty(ids.shape[0], n, config.hidden_size, dtype=model.dtype, device=ids.device)
            layer_masks["sliding_attention"] = create_sliding_window_causal_mask(
                config=config, inputs_embeds=embeds, attention_mask=None, cache_position=pos[0],
                past_key_values=self.cache, position_ids=None,
            )
        try:
            with per_layer_masks(model, masks), query_hooks(model, self.cache), reading(self.cache):
                out = model(
                    input_ids=ids, attention_mask=layer_masks, past_key_values=self.cache, position_ids=pos,
                    use_cache=True, logits_to_keep=logits_to_keep,
                )
        finally:
            for layer in rows:
                layer.streaming = False
        self.fed += n
        return out.logits


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


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[-2]))
