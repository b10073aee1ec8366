"""Many single-row caches of one prompt as one batch: dense layers right-padded with per-layer masks (`Growing`),
layers of quantized or self-evicting rows as `PerRowLayer` (kvlab.engine.layers)."""

from __future__ import annotations

import torch
from torch.profiler import record_function
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import create_sliding_window_causal_mask

from kvlab.engine.attention import per_layer_masks, query_hooks, reading
from kvlab.engine.compress import held_tokens
from kvlab.engine.layers import Growing, PerRowLayer, masked_entries, pad_tokens
from kvlab.models.structure import is_sliding
from kvlab.engine.prefill import KVCache, shallow_copy
from kvlab.kernels import decode_attention, kvcache
from kvlab.kernels.layer import Masked, own_layout


def decode_path(cache: DynamicCache, device) -> str:
    """How decoding attends to this cache on `device`: 'triton codes' (the kernel reads the packed codes),
    'dequantize' (quantized layers rebuilt in full precision at every step) or 'dense'."""
    quantized = [layer for layer in cache.layers if kvcache.is_quantized(layer)]
    if not quantized:
        return "dense"
    return "triton codes" if decode_attention.fused_rows(quantized, device) else "dequantize"


def host_free_step(caches: list[DynamicCache], device) -> bool:
    """Whether a one-token step of these caches decoded as one batch waits for nothing on the host, so that a
    CUDA graph can capture it: every layer that `Batch` keeps per row (`PerRowLayer`) is read by the decode kernel;
    dense layers never wait. H2O, KVQuant's keys, transformers' quantized caches and the dequantizing path
    build per-row masks from host-side lengths."""
    return all(decode_attention.fused_rows(rows, device) for rows in zip(*(c.layers for c in caches))
               if any(own_layout(r) for r in rows))



class Batch:
    """Several single-row caches of the same prompt as one batched cache, each layer right-padded to its
    longest row; `lengths[layer][row]` is what that row really holds. Sliding layers are never compressed,
    so they are equal across rows and need no padding. Layers where some row is quantized become `PerRowLayer`."""

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
                self.cache.layers[idx] = PerRowLayer(rows)
            elif not isinstance(layer, DynamicSlidingWindowLayer):
                self.cache.layers[idx] = Growing([pad_tokens(r.keys, width) for r in rows], [pad_tokens(r.values, width) for r in rows])
            else:  # a sliding-window layer keeps its own update (it drops what leaves the window)
                layer.keys = torch.cat([pad_tokens(r.keys, width) for r in rows])
                layer.values = torch.cat([pad_tokens(r.values, width) for r in rows])
            self.lengths.append(torch.tensor(n, device=model.device))
            self.padded.append(width)
            self.padded_rows.append(min(n) < width)  # dropping rows (keep) never adds padding
            self.masked.append(None if own else masked_entries(rows, width))  # a PerRowLayer masks its own rows
        # position shift per row: re-rotated caches decode from their kept length, not the prompt's
        self.shift = torch.tensor([c.position_shift if isinstance(c, KVCache) else 0 for c in caches], device=model.device)
        self.fed = 0  # tail tokens appended since stacking
        self.rejected: torch.Tensor | None = None  # (B, fed) bool: tail entries of drafts a row did not accept (`reject`)
        self.stepwise = any(isinstance(layer, PerRowLayer) for layer in self.cache.layers)
        self._same_mask: list[int] | None = None  # see `same_mask_as`

    @property
    def size(self) -> int:
        return len(self.lengths[0])

    def splittable(self) -> bool:
        """Whether `split` can take the rows apart: no sliding-window layer (it keeps its own window)."""
        return all(isinstance(layer, (PerRowLayer, Growing)) for layer in self.cache.layers)

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
        if any(n < self.fed for n in fed) and any(isinstance(layer, PerRowLayer) for layer in self.cache.layers):
            raise ValueError("Batch.split: quantized or self-evicting rows (PerRowLayer) cannot keep fewer tokens than were fed")
        out = []
        for _ in rows:
            cache = shallow_copy(self.cache)
            if isinstance(cache, KVCache):
                cache.position_shift, cache.step_kv = 0, None
            out.append(cache)
        for idx, layer in enumerate(self.cache.layers):
            if isinstance(layer, PerRowLayer):
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
            if isinstance(layer, (PerRowLayer, Growing)):
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
        self._same_mask = None

    def can_reject(self) -> bool:
        """Whether rows can be fed draft tokens and drop the ones they reject (`reject`): every layer is a dense
        `Growing` one (rows of `PerRowLayer` cannot take back a token: quantized codes, H2O's evictions; a sliding window
        drops what leaves it)."""
        return all(isinstance(layer, Growing) for layer in self.cache.layers)

    def reject(self, counts: list[int]) -> None:
        """After a pass, row r takes back the last `counts[r]` tokens it was fed (drafts it did not accept): they stay
        in storage, hidden from every later query, and the row's later tokens take the positions they held (`shift`).
        Needs `can_reject`."""
        if not self.can_reject():
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

    def same_mask_as(self) -> list[int]:
        """Per layer, the first layer whose `full_mask` is the same: the same rows' lengths and width, and no entries
        masked per head (layers that compressed alike: every layer of most presses). A pass builds one mask per
        distinct layout instead of one per layer."""
        if self._same_mask is None:
            first = {}
            self._same_mask = [first.setdefault(idx if self.masked[idx] is not None else
                                                (self.padded[idx], tuple(self.lengths[idx].tolist())), idx)
                               for idx in range(len(self.padded))]
        return self._same_mask

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
        """Whether `forward(..., stream=True)` can feed these rows (see `PerRowLayer.streamable`)."""
        return all(layer.streamable() for layer in self.cache.layers if isinstance(layer, PerRowLayer))

    @torch.no_grad()
    @record_function("kvlab.forward")
    def forward(self, ids: torch.Tensor, start: int, logits_to_keep: int = 1, stream: bool = False) -> torch.Tensor:
        """Feed `ids` (B, n) at original positions start… (a re-rotated row: at its kept length, see `shift`);
        return the last `logits_to_keep` logits. With `stream`, the rows of a `PerRowLayer` read the chunk exactly as if
        it were fed one token at a time (teacher forcing a known path in one pass; needs `streamable`); without
        it, a chunk attends to itself in full precision, as a prefill does."""
        model, n = self.model, ids.shape[1]
        rows = [layer for layer in self.cache.layers if isinstance(layer, PerRowLayer)]
        if stream and not self.streamable():
            raise ValueError("stream=True: some row cannot be fed as if one token at a time (H2O, transformers' "
                             "quantized layers, stacked copies or incomplete sinks); feed it one token per call")
        pos = torch.arange(start, start + n, device=ids.device)[None, :] + self.shift[:, None]
        heads = model.config.get_text_config().num_attention_heads

        def rows_mask(layer):
            if stream and n > 1:
                return layer.stream_mask(n, model.dtype, ids.device, heads)
            return None if layer.fused(n, ids.device) else layer.mask(n, model.dtype, ids.device, heads)

        same, made = self.same_mask_as(), {}

        def dense_mask(idx):
            if same[idx] not in made:
                made[same[idx]] = self.full_mask(same[idx], n, model.dtype)
            return made[same[idx]]

        masks = {
            idx: rows_mask(layer) if isinstance(layer, PerRowLayer) else dense_mask(idx)
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

