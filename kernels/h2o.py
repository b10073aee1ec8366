"""H2O (Heavy-Hitter Oracle) as published: every cached token's score is the attention it has received,
accumulated over the prefill's queries *and every decoding step*; whenever the cache holds more than its
capacity, each KV head evicts its lowest-scored token outside the protected recent window.

Own code, not a kvpress press: kvpress scores once, after prefill, and its ObservedAttentionPress (the
prefill-only relative) needs eager attention. Here the attention weights are computed from the queries and
the cached keys directly, so the model keeps its fast attention. Scores of a KV head sum over the query
heads that share it (grouped-query attention).
"""

from __future__ import annotations

import torch

from kvlab.kernels.layer import KVLayer


def received_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float, offset: int = 0,
                       chunk: int = 256) -> torch.Tensor:
    """Attention each key receives from `queries` (B, Hq, n, D), summed over queries and over the query
    heads of each KV group: (B, Hkv, T) for `keys` (B, Hkv, T, D). Query i sits at key position offset + i
    and sees keys 0 … offset + i (causal); computed in chunks of queries."""
    b, hq, n, _ = queries.shape
    hkv, t = keys.shape[1], keys.shape[-2]
    k = keys.float().repeat_interleave(hq // hkv, dim=1)
    total = torch.zeros(b, hq, t, dtype=torch.float32, device=keys.device)
    j = torch.arange(t, device=keys.device)
    for lo in range(0, n, chunk):
        q = queries[:, :, lo : lo + chunk].float()
        pos = offset + lo + torch.arange(q.shape[2], device=keys.device)
        seen = offset + lo + q.shape[2]  # keys after the chunk's last query get no attention: skip them (causal)
        logits = (q @ k[:, :, :seen].transpose(-1, -2)) * scaling
        logits = logits.masked_fill(j[None, :seen] > pos[:, None], float("-inf"))
        total[..., :seen] += torch.softmax(logits, dim=-1).sum(2)
    return total.view(b, hkv, hq // hkv, t).sum(2)


def keep_heavy_and_recent(scores: torch.Tensor, capacity: int, recent: int) -> torch.Tensor:
    """Indices (B, Hkv, capacity), in order, of the `recent` newest tokens plus the highest-scored others."""
    t = scores.shape[-1]
    if capacity >= t:
        return torch.arange(t, device=scores.device).expand(*scores.shape[:2], t)
    recent = min(recent, capacity)
    older = scores[..., : t - recent]
    heavy = older.topk(capacity - recent, dim=-1).indices
    window = torch.arange(t - recent, t, device=scores.device).expand(*scores.shape[:2], recent)
    return torch.cat([heavy, window], dim=-1).sort(dim=-1).values


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(2, index[..., None].expand(*index.shape, x.shape[-1]))


class H2OLayer(KVLayer):
    """A cache layer that keeps at most `capacity` tokens per KV head: `recent` newest ones always, the rest
    by accumulated attention. Before each update the attention module's queries are handed over through
    `pending_query` (kvlab.engine.attention.query_hooks); the new tokens' attention is added to the scores, the layer
    returns the keys and values the attention reads, then evicts down to its capacity for the next step."""

    wants_query = True
    own_layout = True  # rows change length at every step: the engine batches them row by row

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, capacity: int, recent: int,
                 scaling: float):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.capacity, self.recent, self.scaling = capacity, recent, scaling
        index = keep_heavy_and_recent(scores, capacity, recent)
        self.keys, self.values, self.scores = _gather(keys, index), _gather(values, index), scores.gather(2, index)

    def update(self, key_states, value_states, cache_kwargs=None):
        if self.pending_query is None:
            raise RuntimeError("H2O needs the attention's queries before each update (kvlab.engine.attention.query_hooks)")
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        held = self.keys.shape[-2]
        received = received_attention(self.pending_query, keys, self.scaling, offset=held)
        self.pending_query = None
        scores = torch.nn.functional.pad(self.scores, (0, key_states.shape[-2])) + received
        index = keep_heavy_and_recent(scores, self.capacity, self.recent)
        self.keys, self.values, self.scores = _gather(keys, index), _gather(values, index), scores.gather(2, index)
        return keys, values
