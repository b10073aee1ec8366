"""Verified decoding: every row's answer from one teacher-forced pass along the reference row's answer, decoding
step by step only the rows that leave it (`verify`, `Verified`, `Diverged`), those of several samples as one batch per
kind (`decode_diverged`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from kvlab.engine.greedy import Group, decode_groups, decode_references
from kvlab.engine.teacher import first_divergence, forced_divergence, stepwise, streams
from kvlab.models.structure import stop_ids


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
    """`verify`'s result: answers, each row's KL and NLL along the reference's answer (`divergence`'s columns),
    the reference row's log-probabilities there (len(path), V), first divergences, and the seconds spent decoding
    step by step and in the teacher-forced pass. From `verify`, `diverged` lists the rows still to decode (until
    `set_decoded`, their answers are the reference's, or a dense row's answer so far: up to the token it chose instead)."""

    answers: list[list[int]]
    divergence: list[dict]
    logp_ref: torch.Tensor
    first: list[int | None]
    decode_s: float
    teacher_forced_s: float
    diverged: list[Diverged] = field(default_factory=list)

    def set_decoded(self, decoded: list[list[list[int]]], seconds: float) -> None:
        """Set the diverged rows' answers (`decode_groups` of `diverged`' groups, in order) and add their seconds."""
        for part, rest in zip(self.diverged, decoded, strict=True):
            for i, answer in zip(part.rows, rest, strict=True):
                self.answers[i] = part.prefix + answer
        self.diverged, self.decode_s = [], self.decode_s + seconds


def _stepwise_parts(caches: list[DynamicCache], steps: list[int], first: list[int | None], path: list[int], tail: list[int],
                    start: int, max_new_tokens: int) -> list[Diverged]:
    """The stepwise rows that left the reference's answer (`verify`), grouped by where each resumes decoding: fed the
    tail again, then, for quantized rows, the answer up to where they left it (`Group`'s `streamed`); else from 0."""
    parts = []
    resumes = {i: first[i] if streams(caches[i]) else 0 for i in steps}  # where each stepwise row resumes decoding
    for resume in sorted(set(resumes.values())):  # rows that resume at one point share a group
        rows = [i for i in steps if resumes[i] == resume]
        prefix = list(path[:resume])
        parts.append(Diverged(rows, True, prefix, Group([caches[i] for i in rows], tail, start, max_new_tokens - resume,
                                                        tuple(prefix))))
    return parts


@torch.no_grad()
def verify(
    model, caches: list[DynamicCache], ref: int, tail: list[int], start: int, max_new_tokens: int,
    path: list[int] | None = None, source: list[int] | None = None,
) -> Verified:
    """Every row's answer where it follows the reference's, and the rows that leave it, still to decode (`Verified`'s
    `diverged`; `decode_diverged` decodes them, kvlab.engine.sample with other samples' diverged rows).

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
    layer of a batch into per-row updates, `PerRowLayer`). The result holds each row's KL and NLL along the reference's answer and the
    reference's log-probabilities there (`forced_divergence`: the teacher-forced pass), and each row's first
    divergence from it (`first_divergence`; the reference's own value compares its parallel pass with its
    step-by-step decoding: a near-tie that flips there is numerical noise, and is kept as a row column). `path`:
    the reference's answer when it was already decoded (`decode_references`, with other prompts' references).
    `source`: the prompt's tokens before the tail (its prefill's), from which dense rows' drafts are looked up
    (`greedy._drafted`); None: no drafts."""
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
    parts = _stepwise_parts(caches, steps, first, path, tail, start, max_new_tokens)
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
@record_function("kvlab.decode_diverged")
def decode_diverged(model, runs: list[Verified]) -> None:
    """Decode the rows that left their reference's answer in these verified turns (of several samples): every dense
    group in one batch, every stepwise group in another (`decode_groups`: each step reads the weights once for all),
    and give each turn its decoded answers (`Verified.set_decoded`), its decode seconds the share of its rows in its
    kind's batch."""
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
        run.set_decoded([answers[id(part)] for part in run.diverged], sum(seconds[id(part)] for part in run.diverged))

