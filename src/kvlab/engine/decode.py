"""Greedy decoding and teacher forcing over a batch of caches; per-token divergence from the reference row."""

from __future__ import annotations

import math

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


@torch.no_grad()
def teacher_forced(model, caches: list[DynamicCache], tail: list[int], path: list[int], start: int) -> torch.Tensor:
    """Log-probabilities (B, len(path), V) each row assigns to every token of `path` when `tail` and
    `path` are fed after its cache. Dense caches take one forward pass for all tokens; quantized ones and those
    that evict while decoding (H2O, see `own_layout`) are fed the path one token at a time, as in decoding, so
    each token sees earlier ones as the cache stores them (quantized once they leave the residual window)."""
    if not tail:
        raise ValueError("teacher forcing needs at least one tail token after the cache (its logits predict path[0])")
    quantized = [any(own_layout(layer) for layer in c.layers) for c in caches]
    out = None
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
        out[group] = logp
    return out


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
