"""Greedy decoding and teacher forcing over a batch of caches; per-token divergence from the reference row."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from kvlab.engine.batch import Batch
from kvlab.engine.compress import held_tokens
from kvlab.engine.drafts import Lookup
from kvlab.models.structure import is_sliding, stop_ids
from kvlab.kernels import stream as kvstream
from kvlab.kernels.layer import own_layout


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token at each position: the first maximum over the last axis, as `argmax` gives it (`max`'s indices
    are documented to be the first maximum too), in a quarter of argmax's time on bf16 CPU tensors (0.9 s against
    0.2 s for 25 rows × 128 positions of Qwen's 152K-token vocabulary)."""
    return logits.max(-1).indices


@torch.no_grad()
@record_function("kvlab.greedy_decode")
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
    return _greedy(batch, torch.tensor([tail] * batch.size, device=model.device), start, max_new_tokens,
                   stop_ids(model) if stop else set())


DRAFT_TOKENS = 8  # most draft tokens a row is fed in one pass (`_drafted`)
PASS_ROWS = 32  # most positions (rows × tokens) a pass with drafts feeds: a batch of more rows steps one token at a
# time. A pass's cost grows with its positions even where a step is bound by reading the weights (AMX Xeon, bf16, 2
# threads, 1K cache, console: 66 ms for 2 rows × 1 token, 70 for 2 × 4, 105 for 2 × 8, 77 for 8 × 1, 85 for 8 × 2,
# 132 for 8 × 8), and a batch decodes until its slowest row is done, so wide passes for many rows did not pay.


def _greedy(batch: Batch, x: torch.Tensor, pos: int, caps: int | list[int], eos: set[int],
            kept: dict[int, list] | None = None, seen: list[Lookup] | None = None) -> list[list[int]]:
    """Feed `x` (B, n) at position `pos`, then decode every row greedily until EOS or its cap (`caps`: one for
    every row, or each row's own). `kept`: sequence -> a list, to which each step appends the logits (V,) that row
    chose its token from. `seen`: each row's tokens so far (before `x`), from which drafts are looked up: a dense
    batch then decodes with drafts (`_drafted`), unless logits are kept (they are one-token steps' by definition)."""
    caps = [caps] * batch.size if isinstance(caps, int) else caps
    kept = kept or {}
    if seen is not None and not kept and batch.speculable():
        return _drafted(batch, x, pos, caps, eos, seen)
    out: list[list[int]] = [[] for _ in range(batch.size)]
    live = list(range(batch.size))  # batch row i decodes sequence live[i]
    for _ in range(max(caps, default=0)):
        logits = batch.forward(x, pos)[:, -1]
        nxt = greedy(logits)
        pos += x.shape[1]
        going = []
        for row, token in enumerate(nxt.tolist()):
            if live[row] in kept:
                kept[live[row]].append(logits[row].clone())
            out[live[row]].append(token)
            if token not in eos and len(out[live[row]]) < caps[live[row]]:
                going.append(row)
        if not going:
            break
        if len(going) < len(live):
            batch.keep(going)
            live = [live[r] for r in going]
        x = nxt[going, None]
    return out


def _drafted(batch: Batch, x: torch.Tensor, pos: int, caps: list[int], eos: set[int], seen: list[Lookup]) -> list[list[int]]:
    """`_greedy`'s answers, decoded with drafts (verified prompt lookup, see kvlab.engine.drafts): each pass feeds
    every row its next token and up to DRAFT_TOKENS tokens looked up in what it has seen, and a row keeps the leading
    drafts its own greedy choices confirm, then its choice after them: the tokens one-token steps would choose, up to
    the rounding of a pass of several tokens (the same reading the teacher-forced pass gives verified rows). The
    drafts it rejects are taken back (`Batch.reject`). Rows whose tokens never occurred before get no drafts."""
    out: list[list[int]] = [[] for _ in range(batch.size)]
    live = list(range(batch.size))
    for row, ids in zip(live, x.tolist()):
        seen[row].extend(ids)
    while True:
        room = min(DRAFT_TOKENS, PASS_ROWS // len(live) - x.shape[1])
        drafts = [seen[s].draft(min(room, caps[s] - len(out[s]) - 1)) for s in live]
        width = max(map(len, drafts))
        ids = x
        if width:  # rows with fewer drafts are padded with their last token; nothing past their drafts is kept
            filler = x[:, -1].tolist()
            padded = [d + [f] * (width - len(d)) for d, f in zip(drafts, filler)]
            ids = torch.cat([x, torch.tensor(padded, device=x.device)], dim=1)
        choice = greedy(batch.forward(ids, pos, logits_to_keep=width + 1)).tolist()
        pos += ids.shape[1]
        going, back, nxt = [], [], []
        for row, (s, draft, chose) in enumerate(zip(live, drafts, choice)):
            agreed = 0
            while agreed < len(draft) and draft[agreed] == chose[agreed]:
                agreed += 1
            new = []
            for token in chose[: agreed + 1]:
                new.append(token)
                if token in eos or len(out[s]) + len(new) >= caps[s]:
                    break
            out[s] += new
            seen[s].extend(new)
            back.append(width - (len(new) - 1))  # drafts fed beyond the ones kept: the row's next token follows those
            if new[-1] not in eos and len(out[s]) < caps[s]:
                going.append(row)
                nxt.append(new[-1])
        if not going:
            return out
        batch.reject(back)
        if len(going) < len(live):
            batch.keep(going)
            live = [live[r] for r in going]
        x = torch.tensor(nxt, device=x.device)[:, None]


@torch.no_grad()
@record_function("kvlab.decode_reference")
def decode_references(model, requests: list[tuple[DynamicCache, list[int], int]], max_new_tokens: int,
                      keep: set[int] = frozenset(), sources: list[list[int]] | None = None,
                      ) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Greedy answers of several dense caches of different prompts, each `(cache, tail, start)`: every tail is fed
    to its own cache, then all rows decode as one batch, each at its own positions (`decode_groups`). And for the
    requests in `keep` (indices), the logits (len(answer), V) each step chose its token from: the cache read one token
    at a time along its own answer, in a batch of other prompts (what `noise_floor` compares a one-pass reading
    with). `sources`: each cache's tokens (what it was prefilled with), from which the rows' drafts are looked up
    (`_drafted`); None: no drafts."""
    sources = sources or [None] * len(requests)
    answers, kept = _decode_groups(model, [Group([cache], tail, start, max_new_tokens, (), source)
                                           for (cache, tail, start), source in zip(requests, sources)], keep)
    return [answer for (answer,) in answers], kept


def joinable(model, caches: list[DynamicCache]) -> bool:
    """Whether rows of these caches can join rows of other prompts in one batch (`Batch.split`): the model has no
    sliding-window layer (such layers are equal across rows only within one prompt)."""
    return not any(is_sliding(model, i) for i in range(len(caches[0].layers))) if caches else True


class Group(NamedTuple):
    """Caches of one prompt decoded together (`decode_groups`): the tail fed to them in one pass at original positions
    start…, the most tokens each decodes, and `streamed`: tokens of a known answer fed after the tail in one pass read
    as if fed one token at a time (`Batch.forward(stream=True)`; one token per pass where the rows cannot stream),
    where a quantized row resumes decoding; they are not part of what the group returns nor of its cap. `source`:
    the tokens its caches hold before the tail, from which drafts are looked up (`_drafted`); None: no drafts."""

    caches: list[DynamicCache]
    tail: list[int]
    start: int
    cap: int
    streamed: tuple[int, ...] = ()
    source: list[int] | tuple[int, ...] | None = None

    def seen(self) -> Lookup | None:
        """What each of its rows has seen once its tail and streamed tokens are fed (None without a source)."""
        return None if self.source is None else Lookup([*self.source, *self.tail, *self.streamed])


@torch.no_grad()
def decode_groups(model, groups: list[Group | tuple]) -> list[list[list[int]]]:
    """Greedy answers of several groups of caches (`Group`, or `(caches, tail, start, cap)`), as `greedy_decode(model,
    caches, tail, start, cap)` gives them: each group's tail is fed to its caches in one pass, then every row of every
    group decodes in one batch, each at its own positions until EOS or its group's cap, so each step reads the weights
    once for all of them (a one-token step at a few rows is bound by those reads, not by its arithmetic). Groups that
    cannot join (`joinable`: models with sliding-window layers) decode one after another."""
    return _decode_groups(model, groups)[0]


def _decode_groups(model, groups: list[Group | tuple],
                   keep: set[int] = frozenset()) -> tuple[list[list[list[int]]], dict[int, torch.Tensor]]:
    """`decode_groups`' answers, and for the rows in `keep` (indices over every group's rows, in order) the logits
    (len(answer), V) each of their steps chose its token from."""
    groups = [Group(*g) for g in groups]
    kept = {i: [] for i in keep}
    eos = stop_ids(model)
    together = len(groups) > 1 and all(joinable(model, g.caches) for g in groups)
    out, offset = [], 0
    for part in [groups] if together else [[g] for g in groups]:
        rows = sum(len(g.caches) for g in part)
        batch, logits = _joined(model, part)
        seen = [g.seen() for g in part]
        seen = None if None in seen else [s.copy() for s, g in zip(seen, part) for _ in g.caches]
        out += _continued(batch, logits, [g.cap for g in part for _ in g.caches], eos,
                          {i - offset: k for i, k in kept.items() if offset <= i < offset + rows}, seen)
        offset += rows
    answers, start = [], 0
    for g in groups:
        answers.append(out[start : start + len(g.caches)])
        start += len(g.caches)
    return answers, {i: torch.stack(rows) for i, rows in kept.items()}


def _continued(batch: Batch, logits: torch.Tensor, caps: list[int], eos: set[int], kept: dict[int, list],
               seen: list[Lookup] | None = None) -> list[list[int]]:
    """Each row's answer from `logits` (rows, V), which predict its first new token, decoding on in `batch` until EOS
    or the row's cap; `kept` and `seen` as in `_greedy`."""
    first = greedy(logits)
    for i, rows in kept.items():
        rows.append(logits[i])
    out = [[t] if cap > 0 else [] for t, cap in zip(first.tolist(), caps)]
    going = [i for i, t in enumerate(first.tolist()) if t not in eos and caps[i] > 1]
    if going:
        if len(going) < batch.size:
            batch.keep(going)
        rest = _greedy(batch, first[going, None], 0, [caps[i] - 1 for i in going], eos,
                       {row: kept[i] for row, i in enumerate(going) if i in kept},
                       None if seen is None else [seen[i] for i in going])
        for i, more in zip(going, rest):
            out[i] += more
    return out


def _joined(model, groups: list[Group]) -> tuple[Batch, torch.Tensor]:
    """Each group's tail fed to its caches (and its `streamed` tokens after it), then every row in one right-padded
    batch whose positions continue per row (`Batch.shift`: feeding at position p puts a row at start + len(tail) +
    len(streamed) + p, plus its own shift if re-rotated); and each row's last logits (rows, V), which predict its
    first new token. Groups whose tails (and streamed tokens) are equally long are fed in one pass, each row at its
    own positions; across lengths, each length's rows are split into caches of their own (`Batch.split`) and joined
    into one batch after. Rows are in the groups' order."""
    lengths = {}
    for n, g in enumerate(groups):
        lengths.setdefault((len(g.tail), len(g.streamed)), []).append(n)
    fed, logits = {}, {}  # group -> its split caches and positions, and its rows' logits
    for (length, streamed), members in lengths.items():
        one = Batch(model, [c for n in members for c in groups[n].caches])
        sizes = torch.tensor([len(groups[n].caches) for n in members], device=model.device)
        one.shift = one.shift + torch.tensor([groups[n].start for n in members], device=model.device).repeat_interleave(sizes)
        rows = [n for n in members for _ in groups[n].caches]
        out = one.forward(torch.tensor([groups[n].tail for n in rows], device=model.device), 0)[:, -1]
        if streamed:
            ids = torch.tensor([groups[n].streamed for n in rows], device=model.device)
            if one.streamable():
                out = one.forward(ids, length, stream=True)[:, -1]
            else:
                for j in range(streamed):
                    out = one.forward(ids[:, j : j + 1], length + j)[:, -1]
        one.shift = one.shift + length + streamed
        if len(lengths) == 1:  # nothing to join: the batch goes on as it is (sliding-window layers cannot be split)
            return one, out
        caches, start = one.split(), 0
        for n, size in zip(members, sizes.tolist()):
            fed[n] = (caches[start : start + size], one.shift[start : start + size])
            logits[n] = out[start : start + size]
            start += size
    batch = Batch(model, [c for n in range(len(groups)) for c in fed[n][0]])
    batch.shift = torch.cat([fed[n][1] for n in range(len(groups))])
    return batch, torch.cat([logits[n] for n in range(len(groups))])


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
    keeps no (B, len(path), V) block."""
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
    """`divergence(teacher_forced(...)[0], path, ref)`, bitwise the same, with the reference row's log-probabilities
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
    fed = len(tail) + len(path) - 1
    groups = []
    for kind in ("dense", "stream", "steps"):
        group = [i for i, h in enumerate(how) if h == kind]
        if group and kind == "dense":
            held = [sum(held_tokens(layer) for layer in caches[i].layers) / len(caches[i].layers) for i in group]
            groups += [(kind, [group[j] for j in bucket]) for bucket in length_buckets(held, fed, PASS_PAIRS, BUCKET_TOKENS)]
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


# A dense teacher-forced batch is right-padded to its longest row, and SDPA computes the padding it masks: rows of a
# 1K cache at budgets 1.0 down to 0.1 in one batch spend most of their attention on padding. `length_buckets` splits
# them where that saves more than a pass costs. Units: query-key pairs of one row over every layer and head (Qwen2.5-
# 0.5B in bf16 on the 2-core EPYC: ~0.8 us each, torch's CPU flash kernel at ~110 GFLOP/s); a forward pass's own
# overhead (~24 layers of small operators and Python, ~20 ms) is about 25,000 of them. A batch feeds at least
# BUCKET_TOKENS tokens (rows × tokens fed), where the packed linear layers still run near their peak (M of 33-128
# rows ran at 375 GFLOP/s in a variable_tracking job, above 128 at 406).
PASS_PAIRS = 25_000
BUCKET_TOKENS = 128


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


@dataclass
class Diverged:
    """Rows of one verified turn that left the reference's answer and still decode: their indices, whether they are
    stepwise (quantized, H2O), the answer tokens they already have (`prefix`), and their `decode_groups` `Group`. A
    dense row resumes from the teacher-forced pass: its cache holds the tail and the reference's answer up to where the
    row left it, and it is fed the token it chose there (`prefix` ends with it); models whose batches cannot be split
    into rows feed every dense row the prefix of the reference's answer they all share instead. Stepwise rows are fed
    the tail from their compressed caches, then, where they stream (kvlab's quantized layers), the reference's answer
    up to where they left it in one streamed pass (`prefix`), and decode from there; rows that cannot stream (H2O)
    decode from the tail."""

    rows: list[int]
    stepwise: bool
    prefix: list[int]
    group: Group


@dataclass
class Verified:
    """verified_decode's result: answers, each row's KL and NLL along the reference's answer (`divergence`'s columns),
    the reference row's log-probabilities there (len(path), V), first divergences, and the seconds spent decoding
    step by step and in the teacher-forced pass. From `verify`, `diverged` lists the rows still to decode (until
    `settle`, their answers are the reference's, or a dense row's answer so far: up to the token it chose instead)."""

    answers: list[list[int]]
    divergence: list[dict]
    logp_ref: torch.Tensor
    first: list[int | None]
    decode_s: float
    teacher_forced_s: float
    diverged: list[Diverged] = field(default_factory=list)

    def settle(self, decoded: list[list[list[int]]], seconds: float) -> None:
        """Set the diverged rows' answers (`decode_groups` of `diverged`' groups, in order) and add their seconds."""
        for part, rest in zip(self.diverged, decoded, strict=True):
            for i, answer in zip(part.rows, rest, strict=True):
                self.answers[i] = part.prefix + answer
        self.diverged, self.decode_s = [], self.decode_s + seconds


@torch.no_grad()
def verify(
    model, caches: list[DynamicCache], ref: int, tail: list[int], start: int, max_new_tokens: int,
    path: list[int] | None = None, source: list[int] | None = None,
) -> Verified:
    """Every row's answer where it follows the reference's, and the rows that leave it, still to decode (`Verified`'s
    `diverged`; `verified_decode` decodes them at once, kvlab.engine.sample with other samples' diverged rows).

    Greedy decoding is deterministic: a row whose greedy choice equals the reference row's answer at every
    position of it (EOS included) produces exactly that answer (tests/test_engine.py checks the answers against
    decoding every row). So the reference row (`ref`) is decoded alone;
    one teacher-forced pass along its answer (which the KL needs anyway) gives every row's choice at every
    position; only rows that diverge are decoded. A dense row resumes where it left the answer: the pass already
    holds its cache after the tail and the answer's first d tokens, and its choice at d (`Batch.split` cuts each row
    there), so it is fed that one token and decodes on, with no tail fed again; it is done at once if that token
    ends its answer (EOS or the cap). Stepwise rows (quantized, H2O) cannot be cut back: they are fed the tail again,
    then quantized rows the answer up to where they left it in one pass read as if fed token by token (`Group`'s
    `streamed`), and decode from there, as one batch apart from dense rows (one quantized or H2O row would turn every
    layer of a batch into per-row updates, `Rows`). The result holds each row's KL and NLL along the reference's answer and the
    reference's log-probabilities there (`forced_divergence`: the teacher-forced pass), and each row's first
    divergence from it (`first_divergence`; the reference's own value compares its parallel pass with its
    step-by-step decoding: a near-tie that flips there is numerical noise, and is kept as a row column). `path`:
    the reference's answer when it was already decoded (`decode_references`, with other prompts' references).
    `source`: the prompt's tokens before the tail (its prefill's), from which dense rows' drafts are looked up
    (`_drafted`); None: no drafts."""
    t0 = time.perf_counter()
    if path is None:
        (path,), _ = decode_references(model, [(caches[ref], tail, start)], max_new_tokens, sources=[source])
    t1 = time.perf_counter()
    passes = []
    div, logp_ref, choice = forced_divergence(model, caches, tail, path, start, ref, resume=passes)
    first = first_divergence(choice, path)
    t2 = time.perf_counter()
    answers = [list(path) for _ in caches]
    diverged = [i for i, d in enumerate(first) if d is not None and i != ref]
    steps = [i for i in diverged if stepwise(caches[i])]
    dense = [i for i in diverged if i not in steps]
    parts = []
    resumes = {i: first[i] if streams(caches[i]) else 0 for i in steps}  # where each stepwise row resumes decoding
    for resume in sorted(set(resumes.values())):  # rows that resume at one point share a group
        rows = [i for i in steps if resumes[i] == resume]
        prefix = list(path[:resume])
        parts.append(Diverged(rows, True, prefix, Group([caches[i] for i in rows], tail, start, max_new_tokens - resume,
                                                        tuple(prefix))))
    resumable = [(group, batch) for group, batch in passes if batch.splittable()]  # the dense passes, if splittable
    if dense and resumable:
        eos, resumed = stop_ids(model), {}
        for group, batch in resumable:  # each dense row from the batch it was fed in (`length_buckets`)
            mine = [i for i in dense if i in group]
            local = [group.index(i) for i in mine]
            for i, r, cache in zip(mine, local, batch.split(local, [len(tail) + first[i] for i in mine])):
                resumed[i] = (cache, int(batch.shift[r]))
        for i in dense:
            (cache, shift), d, token = resumed[i], first[i], int(choice[i, first[i]])
            answers[i] = path[:d] + [token]
            if token not in eos and d + 1 < max_new_tokens:
                seen = None if source is None else [*source, *tail, *path[:d]]
                parts.append(Diverged([i], False, answers[i], Group([cache], [token], shift + start + len(tail) + d,
                                                                    max_new_tokens - d - 1, (), seen)))
    elif dense:  # sliding-window layers: fed the prefix they all share, from the tail
        shared = min(first[i] for i in dense)
        prefix = list(path[:shared])
        parts.append(Diverged(dense, False, prefix, Group([caches[i] for i in dense], tail + prefix, start, max_new_tokens - shared,
                                                          (), source)))
    return Verified(answers, div, logp_ref, first, t1 - t0, t2 - t1, parts)


@torch.no_grad()
def verified_decode(
    model, caches: list[DynamicCache], ref: int, tail: list[int], start: int, max_new_tokens: int,
    path: list[int] | None = None, source: list[int] | None = None,
) -> Verified:
    """Greedy answers of every row, decoding step by step only the rows that leave the reference's answer (`verify`,
    then its diverged rows decoded, each kind as one batch: `decode_diverged`)."""
    run = verify(model, caches, ref, tail, start, max_new_tokens, path, source)
    decode_diverged(model, [run])
    return run


@torch.no_grad()
@record_function("kvlab.decode_diverged")
def decode_diverged(model, runs: list[Verified]) -> None:
    """Decode the rows that left their reference's answer in these verified turns (of several samples): every dense
    group in one batch, every stepwise group in another (`decode_groups`: each step reads the weights once for all),
    and settle each turn, its decode seconds the share of its rows in its kind's batch."""
    parts = [(run, part) for run in runs for part in run.diverged]
    answers, seconds = {}, {}
    for kind in (False, True):
        chosen = [(run, part) for run, part in parts if part.stepwise == kind]
        if not chosen:
            continue
        t0 = time.perf_counter()
        decoded = decode_groups(model, [part.group for _, part in chosen])
        each = (time.perf_counter() - t0) / sum(len(part.rows) for _, part in chosen)
        for (_, part), rest in zip(chosen, decoded):
            answers[id(part)], seconds[id(part)] = rest, each * len(part.rows)
    for run in runs:
        run.settle([answers[id(part)] for part in run.diverged], sum(seconds[id(part)] for part in run.diverged))


@torch.no_grad()
@record_function("kvlab.stepped")
def stepped(model, requests: list[tuple[DynamicCache, list[int], list[int], int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Dense caches of several prompts, each `(cache, tail, path, start)`, teacher-forced along their `path` one
    token at a time, as decoding feeds it: each tail as one chunk, then one step per path token, every prompt in one
    right-padded batch at its own positions (as `decode_references` decodes), a row leaving once its path ends.
    Models with sliding-window layers step each prompt alone. Per request: log-probabilities (len(path), V) and
    the greedy choice at each position (len(path),)."""
    if len(requests) > 1 and any(is_sliding(model, i) for i in range(len(requests[0][0].layers))):
        return [out for request in requests for out in stepped(model, [request])]
    if any(not tail or not path for _, tail, path, _ in requests):
        raise ValueError("stepping a path needs a tail token after the cache and at least one path token")
    batch, first = _joined(model, [Group([cache], tail, start, len(path)) for cache, tail, path, start in requests])
    paths = [path for _, _, path, _ in requests]
    logits = [[f] for f in first]
    live = list(range(len(requests)))
    for step in range(max(map(len, paths)) - 1):
        going = [row for row, i in enumerate(live) if len(paths[i]) > step + 1]
        if not going:
            break
        if len(going) < len(live):
            batch.keep(going)
            live = [live[r] for r in going]
        out = batch.forward(torch.tensor([[paths[i][step]] for i in live], device=model.device), step)[:, -1]
        for row, i in enumerate(live):
            logits[i].append(out[row])
    results = []
    for rows in logits:
        stacked = torch.stack(rows)
        results.append((torch.log_softmax(stacked.float(), dim=-1), greedy(stacked)))
    return results


@torch.no_grad()
@record_function("kvlab.noise_floor")
def noise_floor(model, requests: list[tuple[DynamicCache, list[int], list[int], int, torch.Tensor]]) -> list[dict]:
    """The reference against itself under changes that should not matter. Each request `(cache, tail, path, start,
    logp_ref)` is a full row whose `logp_ref` (len(path), V) came from the one pass it shared with every other row of
    its prompt; here its cache is teacher-forced again one token at a time, in a batch of the other requests'
    prompts, right-padded (`stepped`). Per request: mean and max per-token KL(one pass ‖ steps) in nats, and where
    the steps' greedy choice first leaves `path` (None: nowhere). What rounding alone does: a KL or an answer change
    of a method no larger than this is no evidence of anything. (On a CPU in fp32, the same pass alone or in a batch,
    padded or not, gave bitwise equal logits on the tiny model; one-token steps take other kernels.)"""
    return [_against("noise", logp_ref, logp, choice, path)
            for (_, _, path, _, logp_ref), (logp, choice) in zip(requests, stepped(model, [r[:4] for r in requests]))]


def stepped_noise(logp_ref: torch.Tensor, logits: torch.Tensor, one_pass_first: int | None) -> dict:
    """`noise_floor`'s columns for a full row whose one-token steps along its path were already taken: `logits`
    (len(path), V), those the reference's own decoding chose the path from (`decode_references`' `keep`), in a batch
    of other prompts, right-padded, as `noise_floor` would step it again. Their greedy choice is the path itself, so
    where the two readings' answers part is where the one pass's choice first leaves the path (`one_pass_first`, the
    full row's `first_divergence`; None: nowhere): `noise_diverged_at`."""
    return {**_kl_columns("noise", logp_ref, torch.log_softmax(logits.float(), dim=-1)), "noise_diverged_at": one_pass_first}


def _against(prefix: str, logp_ref: torch.Tensor, logp: torch.Tensor, choice: torch.Tensor, path: list[int]) -> dict:
    """A noise floor's columns for one path: `_kl_columns`, and where the other reading's greedy `choice` first leaves
    `path` (None: nowhere), named `{prefix}_diverged_at`."""
    return {**_kl_columns(prefix, logp_ref, logp), f"{prefix}_diverged_at": first_divergence(choice[None], path)[0]}


def _kl_columns(prefix: str, logp_ref: torch.Tensor, logp: torch.Tensor) -> dict:
    """Mean and max per-token KL(reference ‖ other reading) in nats, named `{prefix}_kl`, `{prefix}_kl_max`."""
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1).clamp_min(0)
    return {f"{prefix}_kl": float(kl.mean()), f"{prefix}_kl_max": float(kl.max())}


@torch.no_grad()
@record_function("kvlab.dtype_floor")
def dtype_floor(other, requests: list[tuple[list[int], list[int], torch.Tensor]]) -> list[dict]:
    """The reference in another compute dtype. `other` is the model loaded in that dtype (float32 beside a bfloat16
    run); each request `(ids, path, logp_ref)` is a full row: every token id fed before its path (prompt and turn),
    the path, and the log-probabilities (len(path), V) the run's full cache gave it. `other` reads `ids` and the path
    in one plain forward pass (its own dense cache, the model's own attention); requests with the same tokens (the
    agnostic and aware first turn) share it. Per request: mean and max per-token KL(run ‖ other dtype) in nats,
    and where the other dtype's greedy choice first leaves `path` (None: nowhere)."""
    out, done = [], {}
    for ids, path, logp_ref in requests:
        key = (tuple(ids), tuple(path))
        if key not in done:
            x = torch.tensor([list(ids) + list(path[:-1])], device=other.device)
            logits = other(input_ids=x, logits_to_keep=len(path), use_cache=False).logits[0]  # the last id predicts path[0]
            done[key] = (torch.log_softmax(logits.float(), dim=-1).to(logp_ref.device), greedy(logits).to(logp_ref.device))
        out.append(_against("dtype_noise", logp_ref, *done[key], path))
    return out


@record_function("kvlab.divergence")
def divergence(logp: torch.Tensor, path: list[int], ref: int) -> list[dict]:
    """Per row: mean and max per-token KL(row `ref` ‖ row) and mean NLL of `path` (nats)."""
    p_ref = logp[ref].exp()
    scratch = torch.empty_like(p_ref)  # one block for every row: no (B, T, vocabulary) temporary, no fresh block per row
    kl = torch.stack([_kl_terms(logp[ref], p_ref, row, scratch) for row in logp]).clamp_min(0)  # (B, T)
    target = torch.tensor(path, device=logp.device)
    nll = -logp.gather(-1, target.expand(logp.shape[0], -1)[..., None])[..., 0]  # (B, T)
    return _divergence_rows(kl, nll, path)


def _kl_terms(logp_ref: torch.Tensor, p_ref: torch.Tensor, logp: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per-token KL(ref ‖ row), p_ref · (logp_ref − logp) summed over the vocabulary, computed in `scratch` (bitwise
    as written out; half the time of a new product per row)."""
    torch.sub(logp_ref, logp, out=scratch)
    return scratch.mul_(p_ref).sum(-1)


def _divergence_rows(kl: torch.Tensor, nll: torch.Tensor, path: list[int]) -> list[dict]:
    """`divergence`'s columns from per-token KL and NLL (B, T)."""
    return [
        {"kl_vs_full": float(kl[b].mean()), "kl_max": float(kl[b].max()), "nll": float(nll[b].mean()),
         "ppl": math.exp(float(nll[b].mean())), "tf_tokens": len(path)}
        for b in range(kl.shape[0])
    ]