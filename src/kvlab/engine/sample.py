"""Rows of samples: every variant × question mode × turn, from one shared prefill per compression; the full
cache's answers of several samples decoded as one batch."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from functools import partial

from kvlab.engine.compress import cache_stats, compress
from kvlab.engine.floors import dtype_floor, noise_floor, stepped_noise
from kvlab.engine.greedy import decode_references, greedy_decode
from kvlab.engine.teacher import forced_divergence
from kvlab.engine.tuning import tuned
from kvlab.engine.verify import Verified, decode_diverged, verify
from kvlab.engine.prefill import Prefilled, prefill
from kvlab.util.hardware import hand_back
from kvlab.kernels.kvcache import layer_nbytes
from kvlab.methods import Variant
from kvlab.tasks.base import Sample
from kvlab.tasks.scoring import AGREEMENT, score


NOISE_COLUMNS = ("noise_kl", "noise_kl_max", "noise_diverged_at", "noise_s")  # set on measured full rows by `noise_floor`
DTYPE_NOISE_COLUMNS = ("noise_dtype", "dtype_noise_kl", "dtype_noise_kl_max", "dtype_noise_diverged_at", "dtype_noise_s")  # `dtype_floor`
QUESTION_MODES = {  # mode -> (what the cache was compressed with, which turns it labels)
    "agnostic": ("agnostic", lambda turn: True),  # the context alone: no question ever seen
    "aware": ("aware", lambda turn: turn == 1),  # the question asked is inside the compressed prompt
    "multi_turn": ("aware", lambda turn: turn > 1),  # compressed for the first question, asked a later one
}


@dataclass
class Plan:
    """One sample's prefilled bases and what each gives: compression key -> (base, tail after it), the prefill
    seconds per key, turn number -> modes labelled, and the tails and gold answers of the turns."""

    sample: Sample
    bases: dict[str, tuple[Prefilled, list[int]]]
    prefill_s: dict[str, float]
    turns_of: dict[str, dict[int, list[str]]]
    turns: dict[str, list[tuple[list[int], list[str]]]] = field(default_factory=dict)

    def verified(self, number: int) -> bool:
        """Whether a turn's answers are verified along the full cache's answer (else: prose, whose KL path is its
        reference text, and which decodes nothing, or a reference-bearing first turn)."""
        return self.sample.metric != "none" and not (self.sample.prompt.reference and number == 1)


def plan(model, sample: Sample, modes: list[str]) -> Plan:
    """Prefill a sample once per compression its modes need (the aware prefill continues the context's)."""
    p = sample.prompt
    t0 = time.perf_counter()
    context = prefill(model, p.context)
    context.span = (max(p.head, p.prefix), len(p.context))  # prompt compression drops only from the user's text
    context.prefix = p.prefix  # a dataset template's text before the document: never evicted (the aware prefill inherits it)
    prefill_s = {"agnostic": time.perf_counter() - t0}
    bases = {"agnostic": (context, p.question + p.suffix)}
    if any(QUESTION_MODES[m][0] == "aware" for m in modes) and p.question:
        t0 = time.perf_counter()
        bases["aware"] = (prefill(model, p.question, past=context), p.suffix)
        prefill_s["aware"] = prefill_s["agnostic"] + time.perf_counter() - t0
    turns_of = {}  # compression -> {turn number: modes whose rows it gives}
    for mode in modes:
        key = QUESTION_MODES[mode][0] if QUESTION_MODES[mode][0] in bases else "agnostic"
        for number in range(1, len(p.followups) + 2):
            if QUESTION_MODES[mode][1](number):
                turns_of.setdefault(key, {}).setdefault(number, []).append(mode)
    out = Plan(sample, bases, prefill_s, turns_of)
    for key in turns_of:
        turns = [(bases[key][1], sample.gold)]
        for turn in p.followups:
            turns.append((turns[-1][0] + turn.ids, turn.gold))
        out.turns[key] = turns
    return out


def evaluate_sample(
    model, tokenizer, sample: Sample, variants: list[Variant], modes: list[str], max_new_tokens: int, kl: bool = True
):
    """Rows for one sample (see `evaluate_samples`)."""
    return evaluate_samples(model, tokenizer, [sample], variants, modes, max_new_tokens, kl)


def evaluate_samples(
    model, tokenizer, samples: list[Sample], variants: list[Variant], modes: list[str], max_new_tokens: int,
    kl: bool = True, noise_samples: int | None = None, other=None, other_samples: int | None = None,
    open_modes: dict | None = None, on_rows=None, waves=None,
):
    """Rows for several samples: every variant × question mode × turn, from one shared prefill per compression.

    Question modes (`QUESTION_MODES`): `agnostic` compresses the context before any question (every turn is
    asked on it); `aware` compresses context and question together and answers that question; `multi_turn`
    reuses the aware cache for the sample's later turns (a different question about another needle), so it
    only has rows on samples with follow-up turns. A sample whose question sits inside the context (asked
    before the document) is compressed once for both agnostic and aware.

    The full cache's answers of every sample, compression and turn are decoded first, as one batch
    (`decode_references`). Then per compression each variant compresses its own copy of the prefilled cache, and
    `verify` gives every variant's answer from one teacher-forced pass along the full answer, but for the rows that
    leave it: those of every sample are decoded together at the end, one batch per kind (`verify.decode_diverged`,
    `Waiting`; at most `diverged_bytes` of their caches wait, kvlab.engine.tuning: beyond, the samples so far are
    decoded then). With `kl`, KL and NLL come from that pass: along the sample's reference text if it has one, else
    the full cache's own answer (so KL measures how far each method drifts from full). The seconds of the shared
    reference decoding are split evenly among its answers. The noise floor (`floors.noise_floor`) is measured on the
    full rows of the first `noise_samples` samples (None: every sample): a verified turn's from the one-token steps
    its full answer was decoded with (kept by `decode_references`, the reading the noise floor would step again), the
    others' (a reference text's path) stepped together as one batch, their seconds split evenly among them (`Pending`,
    `NoiseRequest`). With `other` (the model loaded in another compute dtype), the full rows of the first
    `other_samples` samples (None: every sample) are also read by it (`floors.dtype_floor`): the noise floor of the
    compute dtype. `open_modes` ((method, budget) -> question modes; None: all) names the modes each variant still
    needs (kvlab.state.sequential): a variant is compressed and decoded only for the compressions that give one of its modes
    (it still gets every row those compressions give). `on_rows`, if given, is called with the number of rows each
    sample adds once its teacher-forced passes are done (its diverged rows' answers may still wait for the joint
    decode; a job's progress lines). `waves`: how each compression's variants are split into waves that fit the job's
    memory budget (`_rows`; None: one wave).
    """
    if sum(v.kind == "full" for v in variants) != 1:
        raise ValueError("the engine needs exactly one 'full' variant as the reference for KL")
    ref = next(i for i, v in enumerate(variants) if v.kind == "full")
    plans = [plan(model, sample, modes) for sample in samples]
    wanted = [(i, key, number) for i, pl in enumerate(plans) for key, labelled in pl.turns_of.items()
              for number in labelled if pl.verified(number)]

    def measured(limit: int | None, i: int) -> bool:
        return limit is None or i < limit

    t0 = time.perf_counter()
    answers, kept = decode_references(model, [(plans[i].bases[key][0].cache, plans[i].turns[key][number - 1][0],
                                               plans[i].bases[key][0].length) for i, key, number in wanted], max_new_tokens,
                                      keep={n for n, (i, _, _) in enumerate(wanted) if kl and measured(noise_samples, i)},
                                      sources=[plans[i].bases[key][0].ids for i, key, _ in wanted])
    reference_s = (time.perf_counter() - t0) / max(len(wanted), 1)
    paths = dict(zip(wanted, answers))
    steps = {wanted[n]: logits for n, logits in kept.items()}  # the noise floor's one-token steps, already taken
    del kept

    pending: list[Pending] = []  # the measured full rows' noise floors, filled in once every sample's rows are made
    waiting, most = Waiting(model, pending), tuned(model.device).diverged_bytes
    for i, pl in enumerate(plans):
        wanted_here = measured(noise_samples, i) or (other is not None and measured(other_samples, i))
        makers, verified, count = _rows(model, tokenizer, pl, variants, ref, max_new_tokens, kl,
                                        {k[1:]: v for k, v in paths.items() if k[0] == i}, reference_s,
                                        pending if wanted_here else None, open_modes,
                                        {k[1:]: steps.pop(k) for k in list(steps) if k[0] == i}, waves)
        waiting.add(i, makers, verified)
        if on_rows is not None:
            on_rows(count)
        if waiting.held > most:
            waiting.settle()
    waiting.settle()
    chosen = [measured(noise_samples, i) for i in waiting.owner]
    for entry, keep in zip(pending, chosen):
        if keep and entry.request.noise is not None:  # a verified turn's: measured from its reference's own decoding (`_rows`)
            for row in entry.rows:
                row.update(entry.request.noise)
    _fill(pending, [keep and entry.request.noise is None for entry, keep in zip(pending, chosen)],
          lambda todo: noise_floor(model, [entry.request.stepping() for entry in todo]), "noise_s")
    if other is not None:
        dtype = {"noise_dtype": str(next(other.parameters()).dtype).removeprefix("torch.")}
        _fill(pending, [measured(other_samples, i) for i in waiting.owner],
              lambda todo: [{**f, **dtype} for f in dtype_floor(other, [(e.ids, e.request.path, e.request.logp_ref) for e in todo])],
              "dtype_noise_s")
    return waiting.rows


@dataclass
class NoiseRequest:
    """A measured full row's noise floor (`floors.noise_floor`): its cache, the tail fed after it, its KL path, the
    position the tail starts at, the log-probabilities (len(path), V) of the one teacher-forced pass it shared with
    its prompt's other rows, and the noise columns when already measured (a verified turn's, from the one-token steps
    of its reference's own decoding: `floors.stepped_noise`; None: `noise_floor` steps it later)."""

    cache: object
    tail: list[int]
    path: list[int]
    start: int
    logp_ref: object
    noise: dict | None = None

    def stepping(self) -> tuple:
        """What `noise_floor` reads of it: (cache, tail, path, start, logp_ref)."""
        return self.cache, self.tail, self.path, self.start, self.logp_ref


@dataclass
class Pending:
    """A full row whose noise floors are filled in once every sample's rows are made: its `NoiseRequest`, the rows it
    gives (one per question mode), and the token ids fed before its path (prompt and turn: what `dtype_floor` reads)."""

    request: NoiseRequest
    rows: list[dict]
    ids: list[int]


class Waiting:
    """Samples whose rows wait for their verified turns' diverged rows to be decoded (`evaluate_samples`): each sample's
    row makers (`_rows`), the verified turns, and the bytes their diverged rows' caches hold. `settle` decodes every
    waiting turn's diverged rows at once, one batch per kind, then makes the rows, in order, into `rows`; `owner`
    gives the sample of each entry its makers added to `pending`."""

    def __init__(self, model, pending: list[Pending]):
        self.model, self.pending = model, pending
        self.rows: list[dict] = []
        self.owner: list[int] = []
        self.makers: list[tuple[int, list]] = []
        self.runs: list[Verified] = []
        self.held = 0

    def add(self, sample: int, makers: list, verified: list[Verified]) -> None:
        """A sample's row makers and its verified turns, whose diverged rows are not decoded yet."""
        self.makers.append((sample, makers))
        self.runs += verified
        self.held += sum(cache_bytes(c) for run in verified for part in run.diverged for c in part.group.caches)

    def settle(self) -> None:
        """Decode every waiting turn's diverged rows in one batch per kind, then make the waiting samples' rows."""
        decode_diverged(self.model, self.runs)
        for sample, makers in self.makers:
            before = len(self.pending)
            self.rows += [row for make in makers for row in make()]
            self.owner += [sample] * (len(self.pending) - before)
        self.makers, self.runs, self.held = [], [], 0


def cache_bytes(cache) -> int:
    """Bytes a cache's layers store (kvcache.layer_nbytes)."""
    return sum(layer_nbytes(layer) for layer in cache.layers)


def _fill(pending: list[Pending], chosen: list[bool], measure, seconds: str) -> None:
    """Measure the `chosen` pending full rows at once (`measure` of their entries gives one dict of columns each)
    and write the columns, with the seconds split evenly among them in column `seconds`, into each entry's rows."""
    todo = [entry for entry, keep in zip(pending, chosen) if keep]
    if not todo:
        return
    t0 = time.perf_counter()
    found = measure(todo)
    each = (time.perf_counter() - t0) / len(todo)
    for entry, columns in zip(todo, found):
        for row in entry.rows:
            row.update(columns, **{seconds: each})


def _needed(variants: list[Variant], ref: int, modes: set[str], open_modes: dict | None) -> tuple[list[Variant], int]:
    """The variants a compression must run (the reference, and those with one of its `modes` open) and the
    reference's index among them."""
    if open_modes is None:
        return variants, ref
    keep = [v for i, v in enumerate(variants) if i == ref or modes & set(open_modes.get((v.method, v.budget), ()))]
    return keep, keep.index(variants[ref])


def _rows(model, tokenizer, pl: Plan, variants: list[Variant], ref: int, max_new_tokens: int, kl: bool, paths: dict,
          reference_s: float, pending: list[Pending] | None, open_modes: dict | None = None,
          steps: dict | None = None, waves=None) -> tuple[list, list[Verified], int]:
    """One sample's rows, its full answers already decoded (`paths`: (key, turn) -> answer), as makers: call each,
    in order, for its turn's rows once the returned verified turns' diverged rows are decoded and settled (with
    other samples' diverged rows, as one batch: `evaluate_samples`); and how many rows the makers will make. With
    `pending` (a list), each full row with a KL path adds its `Pending` entry (its `NoiseRequest`, its rows and
    the token ids before its path), to be filled in later. `steps`: (key, turn) -> the logits the full answer's own decoding chose
    it from (`decode_references`' `keep`), from which a verified turn's noise floor is measured at once
    (`stepped_noise`: that decoding is the one-token reading the noise floor compares the one pass with), each
    freed once used. `open_modes`: as in `evaluate_samples`. `waves` (variants, reference index, context tokens) ->
    lists of variant indices, each with the reference: the variants compressed, teacher-forced and decoded together
    (with several waves, a wave's diverged rows too), one wave's caches freed before the next is compressed
    (kvlab.state.memory plans them under the job's budget; None: one wave). Each row is what one wave of every variant gives (tests/test_memory.py)."""
    sample = pl.sample
    makers, runs, count = [], [], 0
    every, every_ref = variants, ref
    keys = list(pl.turns_of)
    for at, (key, labelled) in enumerate(pl.turns_of.items()):
        variants, ref = _needed(every, every_ref, {m for ms in labelled.values() for m in ms}, open_modes)
        base, _ = pl.bases[key]
        groups = waves(variants, ref, base.length) if waves is not None else [list(range(len(variants)))]
        stats, compress_s = [None] * len(variants), [0.0] * len(variants)
        batch = [next(len(w) for w in groups if i in w) for i in range(len(variants))]  # rows decoded with each
        found: dict[int, list] = {}  # turn -> each wave's (its variant indices, what the turn gave them)
        for wave in groups:
            if len(groups) > 1:  # the last phase's or wave's freed memory handed back first (`hardware.hand_back`):
                hand_back()  # a heap that keeps it would hold every wave's temporaries, fragmented, beside the next
            caches = []
            for i in wave:
                t0 = time.perf_counter()
                caches.append(compress(model, base, variants[i]))
                if stats[i] is None:  # the reference is compressed again in every wave: its first wave's
                    compress_s[i] = time.perf_counter() - t0
                    stats[i] = cache_stats(caches[-1], variants[i], base.length)
            local, turns = wave.index(ref), []
            for number, (turn_tail, _) in enumerate(pl.turns[key], start=1):
                if number in labelled:
                    turns.append(_turn(model, pl, caches, local, number, key, turn_tail, max_new_tokens, kl, paths))
                    found.setdefault(number, []).append((wave, turns[-1]))
            if len(groups) > 1:  # its rows that left the full answer decoded now, not with the other samples' rows:
                decode_diverged(model, [t.run for t in turns if t.run is not None])  # their caches go with the wave's
            del caches  # this wave's caches: only the reference's stays (its noise-floor request holds it)
        if not any(pl.bases[k][0].parent is base for k in keys[at + 1 :]):
            base.captures = []  # compressed by every variant: its captured layer inputs are no longer read
        for number, (turn_tail, gold) in enumerate(pl.turns[key], start=1):
            if number not in labelled:
                continue
            turn = _joined(found[number], len(variants))
            if turn.run is not None:
                runs.append(turn.run)
            request = None
            if turn.logp_ref is not None and pending is not None:
                noise, logits = None, (steps or {}).pop((key, number), None)
                if logits is not None and turn.run is not None:
                    t0 = time.perf_counter()
                    noise = stepped_noise(turn.logp_ref, logits, turn.run.first[ref])
                    noise["noise_s"] = time.perf_counter() - t0
                request = NoiseRequest(turn.ref_cache, turn_tail, turn.path, base.length, turn.logp_ref, noise)
            # a verified turn's decode seconds are known once its diverged rows are decoded (`_turn_rows`)
            timing = {"prefill_s": pl.prefill_s[key], "teacher_forced_s": turn.tf_s, "decode_s": turn.decode_s,
                      "waves": len(groups)}
            makers.append(partial(_turn_rows, tokenizer, sample, variants, ref, number, gold, labelled[number], base,
                                  stats, compress_s, turn.div, turn.run or turn.decoded, reference_s, timing, request,
                                  pending, batch))
            count += len(variants) * len(labelled[number])
    return makers, runs, count


@dataclass
class Turn:
    """What one turn gives a wave's rows (`_turn`), or every wave's joined (`_joined`): answers (`run`, a verified
    turn's, else `decoded`), KL columns, the reference's log-probabilities and cache, the KL path, and seconds."""

    run: Verified | None
    decoded: list | None
    div: list[dict]
    logp_ref: object
    ref_cache: object
    path: list[int] | None
    tf_s: float
    decode_s: float | None


def _turn(model, pl: Plan, caches: list, ref: int, number: int, key: str, turn_tail: list[int], max_new_tokens: int,
          kl: bool, paths: dict) -> Turn:
    """One turn on one wave's caches: verified along the full cache's answer (diverged rows decoded later: with other
    samples', or, with several waves, at the wave's end), or, for prose, every row decoded and read along the sample's
    reference text."""
    sample, p = pl.sample, pl.sample.prompt
    base = pl.bases[key][0]
    div, logp_ref, path, run, decoded = [{} for _ in caches], None, None, None, None
    if pl.verified(number):  # KL along the full cache's answer; diverged rows decoded later, with other samples'
        run = verify(model, caches, ref, turn_tail, base.length, max_new_tokens, path=paths[(key, number)], source=base.ids)
        decode_s, tf_s = None, run.teacher_forced_s
        if kl and run.answers[ref]:
            div, logp_ref, path = run.divergence, run.logp_ref, run.answers[ref]
    else:  # KL along the sample's reference text (prose), and answers (if any) decoded by every row
        t0 = time.perf_counter()
        decoded = greedy_decode(model, caches, turn_tail, base.length, max_new_tokens) if sample.metric != "none" else [[] for _ in caches]
        decode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if kl and p.reference:
            div, logp_ref, _ = forced_divergence(model, caches, turn_tail, p.reference, base.length, ref)
            path = p.reference
        tf_s = time.perf_counter() - t0
    return Turn(run, decoded, div, logp_ref, caches[ref], path, tf_s, decode_s)


def _joined(parts: list[tuple[list[int], Turn]], n: int) -> Turn:
    """The turns of a compression's waves as one: each variant's answer and KL from its wave (the reference's, and its
    log-probabilities, from the first), the seconds summed, the diverged rows renumbered among all `n` variants."""
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        return parts[0][1]
    first, pick = parts[0][1], [None] * n
    for wave, turn in parts:
        for j, i in enumerate(wave):
            if pick[i] is None:
                pick[i] = (turn, j)
    run = None
    if first.run is not None:
        run = Verified([t.run.answers[j] for t, j in pick], [t.run.divergence[j] for t, j in pick], first.run.logp_ref,
                       [t.run.first[j] for t, j in pick], sum(t.run.decode_s for _, t in parts),
                       sum(t.run.teacher_forced_s for _, t in parts),
                       [replace(d, rows=[wave[r] for r in d.rows]) for wave, t in parts for d in t.run.diverged])
    decoded = None if first.decoded is None else [t.decoded[j] for t, j in pick]
    decode_s = None if first.decode_s is None else sum(t.decode_s for _, t in parts)
    return Turn(run, decoded, [t.div[j] for t, j in pick], first.logp_ref, first.ref_cache, first.path,
                sum(t.tf_s for _, t in parts), decode_s)


def _turn_rows(tokenizer, sample: Sample, variants: list[Variant], ref: int, number: int, gold, modes: list[str], base,
               stats: list[dict], compress_s: list[float], div: list[dict], answers, reference_s: float, timing: dict,
               request: NoiseRequest | None, pending: list[Pending] | None, batch: list[int]) -> list[dict]:
    """One turn's rows, every variant × its question modes (`_rows`). `answers`: every row's answer, or the turn's
    `Verified` (settled: its decode seconds then include the diverged rows' share). `batch`: the rows of each
    variant's wave (decoded together)."""
    if isinstance(answers, Verified):
        first, timing = answers.first, {**timing, "decode_s": reference_s + answers.decode_s}
        answers = answers.answers
    else:
        first = [None] * len(variants)
    rows = []
    if sample.metric in AGREEMENT:  # scored against (and `gold` is) the full cache's answer to this turn: its row scores 1
        gold = [tokenizer.decode(answers[ref], skip_special_tokens=True)]
    for i, variant in enumerate(variants):
        prediction = tokenizer.decode(answers[i], skip_special_tokens=True)
        row = {
            **sample.row(),
            "method": variant.method,
            "method_kind": variant.kind,
            "press": variant.params.get("press"),
            "wrapper": variant.params.get("wrapper"),
            "press_kwargs": json.dumps(variant.params["kwargs"], sort_keys=True) if "press" in variant.params else None,
            "layer_budgets": "layer_budgets" in variant.params,  # per-layer budgets from calibration
            **variant.storage,
            "budget": variant.budget,
            "turn": number,
            "gold": list(gold),
            "compressed_tokens": base.length,
            "prediction": prediction,
            "score": score(sample.metric, prediction, gold),
            **stats[i],
            **div[i],
            "prefill_s": timing["prefill_s"],
            "compress_s": compress_s[i],
            "decode_s": timing["decode_s"],
            "decode_batch": batch[i],
            "waves": timing["waves"],  # the waves the compression's variants ran in (kvlab.state.memory: the job's budget)
            "teacher_forced_s": timing["teacher_forced_s"],
            "new_tokens": len(answers[i]),
            # where the row's greedy choice first left the full cache's answer (None: never, so its
            # answer is the full cache's; on the full row itself, a near-tie between its parallel and
            # its step-by-step pass: the numerical noise floor)
            "diverged_at": first[i],
            # on the full row: the same cache read along the same path token by token, in a batch of other
            # prompts (its own decoding's steps, or `noise_floor`'s, filled in once every sample's rows are made),
            # the floor of KL and of answer changes that rounding alone produces; empty on every other row
            **dict.fromkeys(NOISE_COLUMNS),
            # on the full row: its path read by the model in another compute dtype (`dtype_floor`)
            **dict.fromkeys(DTYPE_NOISE_COLUMNS),
        }
        made = [{**row, "question_mode": mode} for mode in modes]
        rows += made
        if i == ref and request is not None:
            pending.append(Pending(request, made, base.ids + request.tail))
    return rows
