"""Teacher forcing: every row of a batch of caches fed a known path (`teacher_forced`; dense rows in batches of
similar length, `length_buckets`; quantized rows in one pass read as if fed token by token), and what the engine keeps
of it: each row's KL and NLL against the reference row and its greedy choices (`forced_divergence`,
`first_divergence`)."""

from __future__ import annotations

import math

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from kvlab.engine.batch import Batch
from kvlab.engine.compress import held_tokens
from kvlab.engine.greedy import greedy
from kvlab.engine.tuning import tuned
from kvlab.kernels import stream as kvstream
from kvlab.kernels.layer import own_layout


def stepwise(cache: DynamicCache) -> bool:
    """Whether a cache must be fed one token at a time to be read as decoding reads it: quantized layers
    (tokens leave the residual window one by one) and those that evict while decoding (H2O, `own_layout`)."""
    return any(own_layout(layer) for layer in cache.layers)


def streams(cache: DynamicCache) -> bool:
    """Whether a stepwise cache can still be teacher-forced in one pass, read as if fed token by token: every
    layer that must be fed one token at a time is a kvlab quantized layer (kernels/stream.py)."""
    return all(kvstream.streamable(layer) for layer in cache.layers if own_layout(layer))


@torch.no_grad()
@record_function("kvlab.teacher_forced")
def teacher_forced(
    model, caches: list[DynamicCache], tail: list[int], path: list[int], start: int, stream: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, len(path), V) each row assigns to every token of `path` when `tail` and
    `path` are fed after its cache, and each row's greedy choice (B, len(path)) at every position (the argmax of
    the raw logits, as decoding takes it). Dense caches take one forward pass for all tokens. Quantized caches
    must see each token as decoding would (earlier tokens quantized once they leave the residual window): they
    take the tail, then the path in one pass that reads it as if fed one token at a time (`stream`; tested equal
    to feeding it so). Caches that evict while decoding (H2O, see `own_layout`) and transformers' quantized
    caches, or every stepwise cache with `stream` false, are fed the path one token at a time. The engine itself
    needs only the KL and NLL of each row, and the reference row's log-probabilities: `forced_divergence`, which
    keeps no (B, len(path), V) block. This whole block is what the tests hold the engine to: `forced_divergence`
    bitwise (tests/test_engine.py), and a streamed pass against `stream=False` (test_stream, test_block_sparse,
    test_cross_layer)."""
    out = choice = None
    for group, pieces, _ in _forced_logits(model, caches, tail, path, start, stream):
        if out is None:
            out = torch.empty(len(caches), len(path), pieces[0].shape[-1], dtype=torch.float32, device=pieces[0].device)
            choice = torch.empty(len(caches), len(path), dtype=torch.long, device=pieces[0].device)
        for j, row in enumerate(group):
            _log_softmax_into(out[row], [piece[j] for piece in pieces])
        choice[group] = _greedy_along(pieces)
    return out, choice


@torch.no_grad()
@record_function("kvlab.teacher_forced")
def forced_divergence(
    model, caches: list[DynamicCache], tail: list[int], path: list[int], start: int, ref: int, stream: bool = True,
    resume: list | None = None,
) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """Per row: mean and max per-token KL(row `ref` ‖ row) and mean NLL of `path` (nats) along `teacher_forced`'s
    pass, bitwise what that pass's (B, len(path), V) log-probabilities give (tests/test_engine.py), with the reference row's log-probabilities
    (len(path), V) and every row's greedy choice (B, len(path)), without the (B, len(path), V) float32 block: each
    row's logits are normalized in one reused (len(path), V) scratch block and reduced to its KL and NLL there (at 25
    rows × 128 tokens of Qwen's 152K vocabulary the block is 1.9 GB, and writing a fresh one took 1.8 s per prose
    sample, most of it the kernel handing out new pages; the same work in a reused block takes 0.1 s). `resume`: a list,
    to which each pass of dense rows (`length_buckets`) is appended as (their indices, their batch), its caches then
    holding `tail` + `path[:-1]` (`verify` resumes the rows that leave `path` from there)."""
    kl, nll = [None] * len(caches), [None] * len(caches)
    logp_ref = p_ref = choice = None
    for group, pieces, batch in _forced_logits(model, caches, tail, path, start, stream, first=ref):  # ref's group first
        if resume is not None and not stepwise(caches[group[0]]):
            resume.append((group, batch))
        with record_function("kvlab.divergence"):
            if logp_ref is None:
                device = pieces[0].device
                logp_ref = torch.empty(len(path), pieces[0].shape[-1], dtype=torch.float32, device=device)
                _log_softmax_into(logp_ref, [piece[group.index(ref)] for piece in pieces])
                p_ref = logp_ref.exp()
                row, scratch = torch.empty_like(logp_ref), torch.empty_like(logp_ref)
                target = torch.tensor(path, device=device)[:, None]
                choice = torch.empty(len(caches), len(path), dtype=torch.long, device=device)
            for j, i in enumerate(group):
                _log_softmax_into(row, [piece[j] for piece in pieces])
                kl[i], nll[i] = _kl_terms(logp_ref, p_ref, row, scratch), -row.gather(-1, target)[:, 0]
            choice[group] = _greedy_along(pieces)
        del pieces, batch
    return _divergence_rows(torch.stack(kl).clamp_min(0), torch.stack(nll), path), logp_ref, choice


def _forced_logits(model, caches: list[DynamicCache], tail: list[int], path: list[int], start: int, stream: bool,
                   first: int | None = None):
    """Per kind of feeding (see `teacher_forced`): the rows fed that way, their logits along `path` as the passes
    gave them (pieces (rows, n, V) whose n add up to len(path), in order: not joined into one block, which for a
    prose_kl sample's quantized rows was a 0.47 GB copy held beside its pieces), and their batch after the pass. Dense rows are fed in
    batches of similar length (`length_buckets`). The batch holding row `first` comes first."""
    if not tail:
        raise ValueError("teacher forcing needs at least one tail token after the cache (its logits predict path[0])")
    how = ["dense" if not stepwise(c) else "stream" if stream and streams(c) else "steps" for c in caches]
    fed, tuning = len(tail) + len(path) - 1, tuned(model.device)
    groups = []
    for kind in ("dense", "stream", "steps"):
        group = [i for i, h in enumerate(how) if h == kind]
        if group and kind == "dense":
            held = [sum(held_tokens(layer) for layer in caches[i].layers) / len(caches[i].layers) for i in group]
            groups += [(kind, [group[j] for j in bucket])
                       for bucket in length_buckets(held, fed, tuning.pass_pairs, tuning.bucket_tokens)]
        elif group:
            groups.append((kind, group))
    if first is not None:
        groups.sort(key=lambda g: first not in g[1])
    for kind, group in groups:
        batch = Batch(model, [caches[i] for i in group])
        ids = torch.tensor([tail + path[:-1]] * batch.size, device=model.device)
        first_path = len(tail)  # the tail's last logits predict path[0]
        if kind == "dense":
            pieces = [batch.forward(ids, start, logits_to_keep=len(path))]
        else:  # the tail as a prefill chunk (as decoding feeds it), then the path in one streamed pass or token by token
            pieces = [batch.forward(ids[:, :first_path], start)]
            if kind == "stream" and ids.shape[1] > first_path:
                pieces.append(batch.forward(ids[:, first_path:], start + first_path, logits_to_keep=ids.shape[1] - first_path,
                                            stream=True))
            elif kind == "steps":
                pieces += [batch.forward(ids[:, i : i + 1], start + i) for i in range(first_path, ids.shape[1])]
        yield group, pieces, batch
        pieces = batch = None  # freed before the next batch's pass, once the caller lets go of its own


def length_buckets(held: list[float], fed: int, pass_pairs: int, min_tokens: int) -> list[list[int]]:
    """Rows holding `held` tokens (per layer, on average), each then fed `fed` tokens in one pass, as batches (indices
    into `held`, longest rows first): the split into runs of similar length that least costs the padded attention
    (rows × fed × (longest held + fed) query-key pairs per batch) plus `pass_pairs` per batch, every batch feeding at
    least `min_tokens` tokens (else all rows in one)."""
    order = sorted(range(len(held)), key=lambda i: -held[i])
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            if (j - i) * fed < min_tokens and not (i == 0 and j == len(order)):
                continue
            cost = best[i] + (j - i) * fed * (held[order[i]] + fed) + pass_pairs
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], len(order)
    while j:
        out.append(order[cut[j] : j])
        j = cut[j]
    return out[::-1]


def _log_softmax_into(out: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """`out` (T, V) = log_softmax of one row's logits, given as consecutive pieces (n, V) along T, in float32: the
    pieces cast into `out` and normalized there in place (no float temporary, no joined copy of the logits; bitwise
    what log_softmax of the float copy of the joined logits gives). One row at a time: a (rows, T, vocabulary)
    float32 temporary would hold several GB at 50 rows of Qwen's 152K vocabulary."""
    at = 0
    for piece in pieces:
        out[at : at + piece.shape[0]].copy_(piece)
        at += piece.shape[0]
    torch.log_softmax(out, dim=-1, out=out)


def _greedy_along(pieces: list[torch.Tensor]) -> torch.Tensor:
    """`greedy` of logits given as consecutive pieces (rows, n, V) along the path: (rows, sum of n)."""
    return torch.cat([greedy(piece) for piece in pieces], dim=1)


def first_divergence(choice: torch.Tensor, path: list[int]) -> list[int | None]:
    """Per row: the first position of `path` where the row's greedy choice is another token (None: it follows
    `path` throughout, so greedy decoding from its cache would produce exactly `path`)."""
    off = choice != torch.tensor(path, device=choice.device)
    return [int(row.nonzero()[0, 0]) if bool(row.any()) else None for row in off]



def _kl_terms(logp_ref: torch.Tensor, p_ref: torch.Tensor, logp: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per-token KL(ref ‖ row), p_ref · (logp_ref − logp) summed over the vocabulary, computed in `scratch` (bitwise
    as written out; half the time of a new product per row)."""
    torch.sub(logp_ref, logp, out=scratch)
    return scratch.mul_(p_ref).sum(-1)


def _divergence_rows(kl: torch.Tensor, nll: torch.Tensor, path: list[int]) -> list[dict]:
    """`forced_divergence`'s columns from per-token KL and NLL (B, T)."""
    return [
        {"kl_vs_full": float(kl[b].mean()), "kl_max": float(kl[b].max()), "nll": float(nll[b].mean()),
         "ppl": math.exp(float(nll[b].mean())), "tf_tokens": len(path)}
        for b in range(kl.shape[0])
    ]
