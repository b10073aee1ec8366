"""Greedy decoding and teacher forcing over a batch of caches; per-token divergence from the reference row."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.engine.batch import Batch, own_layout
from kvlab.engine.model import stop_ids


@torch.no_grad()
def greedy_decode(
    model, caches: list[DynamicCache], tail: list[int], start: int, max_new_tokens: int, stop: bool = True
) -> list[list[int]]:
    """Feed `tail` after each cache at original positions `start…`, then decode greedily, all rows as one
    batch, until every row has produced EOS or the cap. Each row's ids end at its first EOS (with `stop`
    false EOS is ignored: exactly `max_new_tokens` steps, for timing).

    Positions continue from the uncompressed prompt length, as in kvpress: evicted entries keep the
    RoPE rotation they were cached with. A re-rotated cache (KeyRerotationPress) continues at its kept length.
    """
    batch = Batch(model, caches)
    eos = stop_ids(model) if stop else set()
    x = torch.tensor([tail] * batch.size, device=model.device)
    pos = start
    out: list[list[int]] = [[] for _ in range(batch.size)]
    live = list(range(batch.size))  # batch row i decodes sequence live[i]
    for _ in range(max_new_tokens):
        nxt = batch.forward(x, pos)[:, -1].argmax(-1)
        pos += x.shape[1]
        going = []
        for row, token in enumerate(nxt.tolist()):
            out[live[row]].append(token)
            if token not in eos:
                going.append(row)
        if not going:
            break
        if len(going) < len(live):
            batch.keep(going)
            live = [live[r] for r in going]
        x = nxt[going, None]
    return out


def stepwise(cache: DynamicCache) -> bool:
    """Whether a cache must be fed one token at a time to be read as decoding reads it: quantized layers
    (tokens leave the residual window one by one) and those that evict while decoding (H2O, `own_layout`)."""
    return any(own_layout(layer) for layer in cache.layers)


@torch.no_grad()
def teacher_forced(
    model, caches: list[DynamicCache], tail: list[int], path: list[int], start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, len(path), V) each row assigns to every token of `path` when `tail` and
    `path` are fed after its cache, and each row's greedy choice (B, len(path)) at every position (the argmax of
    the raw logits, as decoding takes it). Dense caches take one forward pass for all tokens; quantized ones and those
    that evict while decoding (H2O, see `own_layout`) are fed the path one token at a time, as in decoding, so
    each token sees earlier ones as the cache stores them (quantized once they leave the residual window)."""
    if not tail:
        raise ValueError("teacher forcing needs at least one tail token after the cache (its logits predict path[0])")
    quantized = [stepwise(c) for c in caches]
    out = choice = None
    for group in ([i for i, q in enumerate(quantized) if not q], [i for i, q in enumerate(quantized) if q]):
        if not group:
            continue
        batch = Batch(model, [caches[i] for i in group])
        ids = torch.tensor([tail + path[:-1]] * batch.size, device=model.device)
        if not batch.stepwise:
            logits = batch.forward(ids, start, logits_to_keep=len(path))
        else:
            first = len(tail)  # the tail's last logits predict path[0]
            steps = [batch.forward(ids[:, :first], start)]
            steps += [batch.forward(ids[:, i : i + 1], start + i) for i in range(first, ids.shape[1])]
            logits = torch.cat(steps, dim=1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        if out is None:
            out = logp.new_empty(len(caches), *logp.shape[1:])
            choice = torch.empty(len(caches), len(path), dtype=torch.long, device=logp.device)
        out[group] = logp
        choice[group] = logits.argmax(-1)
    return out, choice


def first_divergence(choice: torch.Tensor, path: list[int]) -> list[int | None]:
    """Per row: the first position of `path` where the row's greedy choice is another token (None: it follows
    `path` throughout, so greedy decoding from its cache would produce exactly `path`)."""
    off = choice != torch.tensor(path, device=choice.device)
    return [int(row.nonzero()[0, 0]) if bool(row.any()) else None for row in off]


@dataclass
class Verified:
    """verified_decode's result: answers, log-probabilities along the reference's answer, first divergences,
    and the seconds spent decoding step by step and in the teacher-forced pass."""

    answers: list[list[int]]
    logp: torch.Tensor
    first: list[int | None]
    decode_s: float
    teacher_forced_s: float


@torch.no_grad()
def verified_decode(
    model, caches: list[DynamicCache], ref: int, tail: list[int], start: int, max_new_tokens: int
) -> Verified:
    """Greedy answers of every row, decoding step by step only the rows that leave the reference's answer.

    Greedy decoding is deterministic: a row whose greedy choice equals the reference row's answer at every
    position of it (EOS included) produces exactly that answer (tests/test_engine.py checks the answers against
    decoding every row). So the reference row (`ref`) is decoded alone;
    one teacher-forced pass along its answer (which the KL needs anyway) gives every row's choice at every
    position; only rows that diverge are decoded, dense ones from their first divergence (the shared prefix is
    fed in one pass), stepwise ones (quantized, H2O) from the tail, as they must be. Returns the answers, the
    teacher-forced log-probabilities (B, len(path), V) along the reference's answer, and each row's first
    divergence from it (`first_divergence`; the reference's own value compares its parallel pass with its
    step-by-step decoding: a near-tie that flips there is numerical noise, and is kept as a row column)."""
    t0 = time.perf_counter()
    (path,) = greedy_decode(model, [caches[ref]], tail, start, max_new_tokens)
    t1 = time.perf_counter()
    logp, choice = teacher_forced(model, caches, tail, path, start)
    first = first_divergence(choice, path)
    t2 = time.perf_counter()
    out = [list(path) for _ in caches]
    diverged = [i for i, d in enumerate(first) if d is not None and i != ref]
    steps = [i for i in diverged if stepwise(caches[i])]
    dense = [i for i in diverged if i not in steps]
    for group, shared in ((dense, min((first[i] for i in dense), default=0)), (steps, 0)):
        if group:
            prefix = path[:shared]
            rest = greedy_decode(model, [caches[i] for i in group], tail + prefix, start, max_new_tokens - shared)
            for i, answer in zip(group, rest):
                out[i] = prefix + answer
    return Verified(out, logp, first, t1 - t0 + time.perf_counter() - t2, t2 - t1)


def divergence(logp: torch.Tensor, path: list[int], ref: int) -> list[dict]:
    """Per row: mean and max per-token KL(row `ref` ‖ row) and mean NLL of `path` (nats)."""
    p_ref = logp[ref].exp()
    kl = (p_ref * (logp[ref] - logp)).sum(-1).clamp_min(0)  # (B, T)
    target = torch.tensor(path, device=logp.device)
    nll = -logp.gather(-1, target.expand(logp.shape[0], -1)[..., None])[..., 0]  # (B, T)
    return [
        {"kl_vs_full": float(kl[b].mean()), "kl_max": float(kl[b].max()), "nll": float(nll[b].mean()),
         "ppl": math.exp(float(nll[b].mean())), "tf_tokens": len(path)}
        for b in range(logp.shape[0])
    ]
