"""Decode-time block-sparse attention over a cache kept whole: each one-token step reads only the blocks chosen for
its query (the article's §6; the counting of the trained designs is in ``kvlab.kernels.reads``).

The cache is cut into blocks of ``block`` tokens from position 0; the block holding the new token is the current
one. A step reads the current block (causally) and the ``top_k - 1`` complete past blocks that score highest for
the query, per KV head; every block is read when ``top_k`` covers them all. Two scores of a past block:

* ``moba`` (Lu et al. 2025, "MoBA"): the query against the block's mean key;
* ``quest`` (Tang et al. 2024, "Quest"): an upper bound of the query's dot product with any key of the page, from
  the element-wise min and max of its keys: Σ_d max(q_d · min_d, q_d · max_d).

Both are computed on the cached keys as they are (after RoPE, as the attention reads them). A GQA cache is read per
KV head, so the scores of the query heads sharing a KV head are summed and the group reads one set of blocks:
the layout a GQA kernel loads (the papers select per query head on multi-head models). MoBA's block means are a
summary of each complete block (half a token's K and V); Quest's min and max, a whole token's worth per page.

These are post-hoc selections on a model never trained for them: their rows measure how far they are from exact.
Written here because kvpress compresses the prompt once and has no per-step selection over a kept cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvlab.kernels.layer import KVLayer

SELECTORS = ("moba", "quest")


def _check(selector: str, block: int, top_k: int) -> None:
    if selector not in SELECTORS:
        raise ValueError(f"block-sparse selector {selector!r} is not one of {', '.join(SELECTORS)}")
    if block < 1 or top_k < 1:
        raise ValueError(f"block-sparse reads need block >= 1 and top_k >= 1, got block {block} and top_k {top_k}")


def block_scores(query: torch.Tensor, keys: torch.Tensor, block: int, selector: str) -> torch.Tensor:
    """Scores (B, H_kv, n, C) of the C complete blocks of `keys` (B, H_kv, T, D) for `query` (B, H_q, n, D), the
    query heads of each KV head summed; fp32."""
    b, hkv, t, d = keys.shape
    c = t // block
    blocks = keys[:, :, : c * block].float().view(b, hkv, c, block, d)
    q = query.float().view(b, hkv, query.shape[1] // hkv, query.shape[2], d)  # (B, H_kv, G, n, D)
    if selector == "moba":
        return torch.einsum("bhgnd,bhcd->bhnc", q, blocks.mean(3))
    low, high = blocks.amin(3), blocks.amax(3)  # (B, H_kv, C, D)
    bound = torch.maximum(q[:, :, :, :, None] * low[:, :, None, None], q[:, :, :, :, None] * high[:, :, None, None])
    return bound.sum(-1).sum(2)  # Σ_d, then over the group


def selected(query: torch.Tensor, keys: torch.Tensor, block: int, top_k: int, selector: str) -> torch.Tensor:
    """bool (B, H_kv, n, T): the keys each of the n queries reads. Query i sits at position T - n + i (the last n
    keys are the queries' own tokens): it reads its current block up to itself and the top_k - 1 best-scoring
    past blocks that are complete before its current block."""
    _check(selector, block, top_k)
    b, hkv, t, _ = keys.shape
    n = query.shape[2]
    pos = torch.arange(t - n, t, device=keys.device)  # each query's position
    j = torch.arange(t, device=keys.device)
    current = pos // block  # (n,)
    own = (j[None, :] >= current[:, None] * block) & (j[None, :] <= pos[:, None])  # (n, T): the current block, causal
    allowed = own[None, None].expand(b, hkv, n, t).clone()
    c = t // block
    if c == 0 or top_k == 1:
        return allowed
    scores = block_scores(query, keys, block, selector)  # (B, H_kv, n, C)
    past = torch.arange(c, device=keys.device)[None, :] < current[:, None]  # (n, C): complete before the current
    scores = scores.masked_fill(~past[None, None], float("-inf"))
    k = min(top_k - 1, c)
    best = scores.topk(k, dim=-1).indices  # (B, H_kv, n, k)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & past[None, None]
    return allowed | _spread(chosen, block, t)


def _spread(chosen: torch.Tensor, block: int, t: int) -> torch.Tensor:
    """Block choices (…, C) as token choices (…, T): each block's tokens, the tokens after the last block False."""
    tokens = chosen.repeat_interleave(block, dim=-1)
    return torch.nn.functional.pad(tokens, (0, t - tokens.shape[-1]))


def read_tokens(held: int, block: int, top_k: int, selector: str) -> float:
    """Key and value vectors per KV head one decode step reads when `held` tokens are cached and one more comes:
    the current block and the best top_k - 1 complete past blocks, plus the block summaries scored (MoBA: one mean
    key per complete block, half a token's K and V; Quest: a min and a max key per page, one token's)."""
    _check(selector, block, top_k)
    t = held + 1
    past = (t - 1) // block  # complete blocks before the current one
    current = t - past * block
    summaries = past * (0.5 if selector == "moba" else 1.0)
    if past <= top_k - 1:  # every block read: nothing to score
        return float(t)
    return current + (top_k - 1) * block + summaries


class BlockSparseLayer(KVLayer):
    """A dense cache layer (every entry kept, updates concatenate) whose one-token steps read only the selected
    blocks (`attends`), as does a streamed chunk (teacher forcing); other chunks (a prompt's tail) read
    everything, as a prefill does."""

    own_layout = True  # its selection is per row: a batch keeps its rows apart
    streams = True  # a streamed chunk's queries each select as their own step would (`selected`)

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, block: int, top_k: int, selector: str):
        super().__init__()
        _check(selector, block, top_k)
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.block, self.top_k, self.selector = block, top_k, selector

    def update(self, key_states, value_states, cache_kwargs=None):
        return DynamicLayer.update(self, key_states, value_states, cache_kwargs)

    def attends(self, query: torch.Tensor, stepwise: bool) -> torch.Tensor | None:
        """bool (B, H_kv, n, T) of the keys each query reads as its own decode step would; None when every query
        reads them all (every block within top_k, or a chunk read as a prefill)."""
        t = self.keys.shape[-2]
        if not stepwise or (t - 1) // self.block <= self.top_k - 1:
            return None
        return selected(query, self.keys, self.block, self.top_k, self.selector)

    def read_per_head(self) -> float:
        return read_tokens(self.keys.shape[-2], self.block, self.top_k, self.selector)
