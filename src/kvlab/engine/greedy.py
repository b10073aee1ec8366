"""Greedy decoding over batches of caches: the full cache's answers (`greedy_decode`, `decode_references`, which
keeps the logits of the steps the noise floor asks for), groups of caches of several prompts decoded as one batch,
each at its own positions (`decode_groups`, `join_groups`), and decoding with drafts looked up in what each row has
seen (`_drafted`, kvlab.engine.drafts)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from kvlab.engine.batch import Batch
from kvlab.engine.drafts import Lookup
from kvlab.engine.tuning import tuned
from kvlab.models.structure import is_sliding, stop_ids


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


def _greedy(batch: Batch, x: torch.Tensor, pos: int, caps: int | list[int], eos: set[int],
            kept: dict[int, list] | None = None, seen: list[Lookup] | None = None) -> list[list[int]]:
    """Feed `x` (B, n) at position `pos`, then decode every row greedily until EOS or its cap (`caps`: one for
    every row, or each row's own). `kept`: sequence -> a list, to which each step appends the logits (V,) that row
    chose its token from. `seen`: each row's tokens so far (before `x`), from which drafts are looked up: a dense
    batch then decodes with drafts (`_drafted`), unless logits are kept (they are one-token steps' by definition)."""
    caps = [caps] * batch.size if isinstance(caps, int) else caps
    kept = kept or {}
    if seen is not None and not kept and batch.can_reject():
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
    every row its next token and up to `draft_tokens` tokens (kvlab.engine.tuning) looked up in what it has seen, and a row keeps the leading
    drafts its own greedy choices confirm, then its choice after them: the tokens one-token steps would choose, up to
    the rounding of a pass of several tokens (the same reading the teacher-forced pass gives verified rows). The
    drafts it rejects are taken back (`Batch.reject`). Rows whose tokens never occurred before get no drafts."""
    out: list[list[int]] = [[] for _ in range(batch.size)]
    live = list(range(batch.size))
    for row, ids in zip(live, x.tolist()):
        seen[row].extend(ids)
    tuning = tuned(x.device)
    while True:
        room = min(tuning.draft_tokens, tuning.pass_rows // len(live) - x.shape[1])
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
        batch, logits = join_groups(model, part)
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


def join_groups(model, groups: list[Group]) -> tuple[Batch, torch.Tensor]:
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

