"""Rows of samples: every variant × question mode × turn, from one shared prefill per compression; the full
cache's answers of several samples decoded as one batch."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

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


@dataclass(frozen=True)
class Reading:
    """What `evaluate_samples` reads beside the answers: with `kl`, KL and NLL along each path; the noise floor on the
    full rows of the first `noise_samples` samples (None: every sample); with `other` (the model loaded in another
    compute dtype), the compute dtype's floor on the full rows of the first `other_samples` samples (None: every one)."""

    kl: bool = True
    noise_samples: int | None = None
    other: object = None
    other_samples: int | None = None

    def noise(self, i: int) -> bool:
        """Whether the noise floor is measured on sample `i`'s full rows."""
        return self.noise_samples is None or i < self.noise_samples

    def dtype(self, i: int) -> bool:
        """Whether the compute dtype's floor is measured on sample `i`'s full rows."""
        return self.other is not None and (self.other_samples is None or i < self.other_samples)


@dataclass(frozen=True)
class Scope:
    """What a job asks of `evaluate_samples` beyond its samples (kvlab.steps.evaluate): the modes each variant still
    needs (`open_modes`: (method, budget) -> question modes; None: all), the memory waves (`waves`; None: one wave)
    and a callback with the rows each sample adds (`on_rows`; None: none)."""

    open_modes: dict | None = None
    waves: object = None
    on_rows: object = None


def evaluate_sample(
    model, tokenizer, sample: Sample, variants: list[Variant], modes: list[str], max_new_tokens: int, kl: bool = True
):
    """Rows for one sample (see `evaluate_samples`)."""
    return evaluate_samples(model, tokenizer, [sample], variants, modes, max_new_tokens, Reading(kl=kl))


def evaluate_samples(
    model, tokenizer, samples: list[Sample], variants: list[Variant], modes: list[str], max_new_tokens: int,
    reading: Reading = Reading(), scope: Scope = Scope(),
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
    decoded then). With `reading.kl`, KL and NLL come from that pass: along the sample's reference text if it has one,
    else the full cache's own answer (so KL measures how far each method drifts from full). The seconds of the shared
    reference decoding are split evenly among its answers. The noise floor (`floors.noise_floor`) is measured on the
    full rows `reading` names: a verified turn's from the one-token steps its full answer was decoded with (kept by
    `decode_references`, the reading the noise floor would step again), the others' (a reference text's path) stepped
    together as one batch, their seconds split evenly among them (`Pending`, `NoiseRequest`); the compute dtype's
    (`floors.dtype_floor`) by `reading.other`. `scope.open_modes` names the modes each variant still needs
    (kvlab.state.sequential): a variant is compressed and decoded only for the compressions that give one of its modes
    (it still gets every row those compressions give). `scope.on_rows`, if given, is called with the number of rows
    each sample adds once its teacher-forced passes are done (its diverged rows' answers may still wait for the joint
    decode; a job's progress lines). `scope.waves`: how each compression's variants are split into waves that fit the
    job's memory budget (`_compressed`; None: one wave).
    """
    if sum(v.kind == "full" for v in variants) != 1:
        raise ValueError("the engine needs exactly one 'full' variant as the reference for KL")
    shared = Shared(model, tokenizer, variants, next(i for i, v in enumerate(variants) if v.kind == "full"), max_new_tokens,
                    reading, scope)
    plans = [plan(model, sample, modes) for sample in samples]
    full = _full_answers(shared, plans, [reading.kl and reading.noise(i) for i in range(len(plans))])
    pending: list[Pending] = []  # the measured full rows' noise floors, filled in once every sample's rows are made
    owner: list[int] = []  # the sample of each entry of `pending`
    waiting, most, rows = Waiting(model), tuned(model.device).diverged_bytes, []
    for i, pl in enumerate(plans):
        wanted_here = reading.noise(i) or reading.dtype(i)
        before = len(pending)
        turns = _sample_rows(shared, pl, full[i], pending if wanted_here else None)
        owner += [i] * (len(pending) - before)
        rows += [row for turn in turns for made in turn.rows for row in made]
        waiting.add(turns)
        if scope.on_rows is not None:
            scope.on_rows(sum(len(made) for turn in turns for made in turn.rows))
        if waiting.held > most:
            waiting.decode()
    waiting.decode()
    _floors(model, pending, owner, reading)
    return rows


def _floors(model, pending: list[Pending], owner: list[int], reading: Reading) -> None:
    """Fill in the noise floors of the pending full rows (`evaluate_samples`) of the samples `reading` names: a
    verified turn's from its reference's own decoding (measured in `_sample_rows`), the others' stepped together as
    one batch; with `reading.other`, the compute dtype's floor."""
    chosen = [reading.noise(i) for i in owner]
    for entry, keep in zip(pending, chosen):
        if keep and entry.request.noise is not None:  # a verified turn's: measured from its reference's own decoding
            for row in entry.rows:
                row.update(entry.request.noise)
    _fill(pending, [keep and entry.request.noise is None for entry, keep in zip(pending, chosen)],
          lambda todo: noise_floor(model, [entry.request.stepping() for entry in todo]), "noise_s")
    if reading.other is not None:
        dtype = {"noise_dtype": str(next(reading.other.parameters()).dtype).removeprefix("torch.")}
        _fill(pending, [reading.dtype(i) for i in owner],
              lambda todo: [{**f, **dtype} for f in dtype_floor(reading.other, [(e.ids, e.request.path, e.request.logp_ref) for e in todo])],
              "dtype_noise_s")


@dataclass
class Shared:
    """What every sample of one `evaluate_samples` call shares: the model and tokenizer, the variants (the reference
    at `ref`), the decoding cap, what is read beside the answers (`reading`) and what the job asks (`scope`)."""

    model: object
    tokenizer: object
    variants: list[Variant]
    ref: int
    max_new_tokens: int
    reading: Reading
    scope: Scope


@dataclass
class FullAnswers:
    """One sample's full-cache answers, decoded with every sample's as one batch (`_full_answers`): (compression key,
    turn) -> answer; the logits the measured ones were chosen from (`steps`: a verified turn's noise floor reads them,
    `stepped_noise`, each freed once used); and each answer's share of the batch's seconds."""

    paths: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    seconds: float = 0.0


def _full_answers(shared: Shared, plans: list[Plan], keep: list[bool]) -> list[FullAnswers]:
    """The full cache's answers of every sample's verified turns, decoded as one batch (`decode_references`), with the
    one-token steps of the samples `keep` marks kept for their noise floors; the seconds split evenly among them."""
    wanted = [(i, key, number) for i, pl in enumerate(plans) for key, labelled in pl.turns_of.items()
              for number in labelled if pl.verified(number)]
    t0 = time.perf_counter()
    answers, kept = decode_references(shared.model, [(plans[i].bases[key][0].cache, plans[i].turns[key][number - 1][0],
                                                      plans[i].bases[key][0].length) for i, key, number in wanted],
                                      shared.max_new_tokens, keep={n for n, (i, _, _) in enumerate(wanted) if keep[i]},
                                      sources=[plans[i].bases[key][0].ids for i, key, _ in wanted])
    seconds = (time.perf_counter() - t0) / max(len(wanted), 1)
    full = [FullAnswers(seconds=seconds) for _ in plans]
    for n, ((i, key, number), answer) in enumerate(zip(wanted, answers)):
        full[i].paths[key, number] = answer
        if n in kept:
            full[i].steps[key, number] = kept.pop(n)
    return full


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
    """Verified turns whose diverged rows are not decoded yet (`evaluate_samples`), and the bytes their caches hold:
    `decode` decodes every waiting turn's diverged rows at once, one batch per kind, then writes their answers into
    the turns' rows (`TurnRows.answer`)."""

    def __init__(self, model):
        self.model = model
        self.turns: list[TurnRows] = []
        self.held = 0

    def add(self, turns: list[TurnRows]) -> None:
        """A sample's turns: those decoded row by row are answered now, the verified ones wait for `decode`."""
        for turn in turns:
            if isinstance(turn.answers, Verified):
                self.turns.append(turn)
                self.held += sum(cache_bytes(c) for part in turn.answers.diverged for c in part.group.caches)
            else:
                turn.answer()

    def decode(self) -> None:
        """Decode every waiting turn's diverged rows in one batch per kind, then write the turns' answers."""
        decode_diverged(self.model, [turn.answers for turn in self.turns])
        for turn in self.turns:
            turn.answer()
        self.turns, self.held = [], 0


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


@dataclass
class Compression:
    """One prefilled base of a sample compressed by the variants that need one of its modes (the reference at `ref`),
    in waves (lists of variant indices, each with the reference: compressed, teacher-forced and decoded together, one
    wave's caches freed before the next is compressed): each variant's cache statistics and compression seconds (its
    first wave's), and what each labelled turn gave each wave (`found`: turn -> [(wave, TurnResult)])."""

    key: str
    base: Prefilled
    variants: list[Variant]
    ref: int
    groups: list[list[int]]
    stats: list = field(default_factory=list)
    compress_s: list = field(default_factory=list)
    found: dict = field(default_factory=dict)

    @property
    def batch(self) -> list[int]:
        """The rows decoded with each variant's (its wave's)."""
        return [next(len(w) for w in self.groups if i in w) for i in range(len(self.variants))]


def _sample_rows(shared: Shared, pl: Plan, full: FullAnswers, pending: list[Pending] | None) -> list[TurnRows]:
    """One sample's rows, turn by turn, its full answers already decoded (`full`): per compression, its variants
    compressed and every labelled turn verified or decoded, wave by wave (`_compressed`), then each turn's rows made
    (`_turn_rows`; a verified turn's answers written once its diverged rows are decoded: `Waiting`). With `pending`
    (a list), each full row with a KL path adds its `Pending` entry, to be filled in later (`evaluate_samples`)."""
    turns, keys = [], list(pl.turns_of)
    for at, (key, labelled) in enumerate(pl.turns_of.items()):
        comp = _compressed(shared, pl, key, labelled, full)
        if not any(pl.bases[k][0].parent is comp.base for k in keys[at + 1 :]):
            comp.base.captures = []  # compressed by every variant: its captured layer inputs are no longer read
        for number, (turn_tail, _) in enumerate(pl.turns[key], start=1):
            if number in labelled:
                turn = _joined(comp.found[number], len(comp.variants))
                request = _noise_request(comp, turn, turn_tail, full.steps.pop((key, number), None)) if pending is not None else None
                turns.append(_turn_rows(shared, pl, comp, number, turn, full.seconds, request, pending))
    full.steps.clear()  # the logits no turn read
    return turns


def _compressed(shared: Shared, pl: Plan, key: str, labelled: dict, full: FullAnswers) -> Compression:
    """The compression `key` of a sample by the variants that need one of its `labelled` turns' modes (`_needed`),
    wave by wave (`shared.scope.waves`, kvlab.state.memory plans them under the job's budget; None: one wave); each row is
    what one wave of every variant gives (tests/test_memory.py)."""
    variants, ref = _needed(shared.variants, shared.ref, {m for ms in labelled.values() for m in ms}, shared.scope.open_modes)
    base = pl.bases[key][0]
    waves = shared.scope.waves
    groups = waves(variants, ref, base.length) if waves is not None else [list(range(len(variants)))]
    comp = Compression(key, base, variants, ref, groups, [None] * len(variants), [0.0] * len(variants))
    for wave in groups:
        if len(groups) > 1:  # the last phase's or wave's freed memory handed back first (`hardware.hand_back`):
            hand_back()  # a heap that keeps it would hold every wave's temporaries, fragmented, beside the next
        caches = []
        for i in wave:
            t0 = time.perf_counter()
            caches.append(compress(shared.model, base, variants[i]))
            if comp.stats[i] is None:  # the reference is compressed again in every wave: its first wave's
                comp.compress_s[i] = time.perf_counter() - t0
                comp.stats[i] = cache_stats(caches[-1], variants[i], base.length)
        turns = []
        for number, (turn_tail, _) in enumerate(pl.turns[key], start=1):
            if number in labelled:
                turns.append(_turn(shared, pl, caches, wave.index(ref), number, key, turn_tail, full.paths.get((key, number))))
                comp.found.setdefault(number, []).append((wave, turns[-1]))
        if len(groups) > 1:  # its rows that left the full answer decoded now, not with the other samples' rows:
            decode_diverged(shared.model, [t.run for t in turns if t.run is not None])  # their caches go with the wave's
        del caches  # this wave's caches: only the reference's stays (its noise-floor request holds it)
    return comp


def _noise_request(comp: Compression, turn: TurnResult, turn_tail: list[int], logits) -> NoiseRequest | None:
    """A measured full row's noise-floor request (None where the turn has no KL path): a verified turn's measured at
    once from `logits`, the one-token steps its full answer's own decoding chose it from (`stepped_noise`: the reading
    the noise floor compares the one pass with); the others' stepped later (`noise_floor`)."""
    if turn.logp_ref is None:
        return None
    noise = None
    if logits is not None and turn.run is not None:
        t0 = time.perf_counter()
        noise = stepped_noise(turn.logp_ref, logits, turn.run.first[comp.ref])
        noise["noise_s"] = time.perf_counter() - t0
    return NoiseRequest(turn.ref_cache, turn_tail, turn.path, comp.base.length, turn.logp_ref, noise)


@dataclass
class TurnResult:
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


def _turn(shared: Shared, pl: Plan, caches: list, ref: int, number: int, key: str, turn_tail: list[int], path: list[int] | None) -> TurnResult:
    """One turn on one wave's caches (the reference's at `ref`): verified along the full cache's answer `path`
    (diverged rows decoded later: with other samples', or, with several waves, at the wave's end), or, for prose,
    every row decoded and read along the sample's reference text."""
    model, max_new_tokens, kl = shared.model, shared.max_new_tokens, shared.reading.kl
    sample, p = pl.sample, pl.sample.prompt
    base = pl.bases[key][0]
    div, logp_ref, path_read, run, decoded = [{} for _ in caches], None, None, None, None
    if pl.verified(number):  # KL along the full cache's answer; diverged rows decoded later, with other samples'
        run = verify(model, caches, ref, turn_tail, base.length, max_new_tokens, path=path, source=base.ids)
        decode_s, tf_s = None, run.teacher_forced_s
        if kl and run.answers[ref]:
            div, logp_ref, path_read = run.divergence, run.logp_ref, run.answers[ref]
    else:  # KL along the sample's reference text (prose), and answers (if any) decoded by every row
        t0 = time.perf_counter()
        decoded = greedy_decode(model, caches, turn_tail, base.length, max_new_tokens) if sample.metric != "none" else [[] for _ in caches]
        decode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if kl and p.reference:
            div, logp_ref, _ = forced_divergence(model, caches, turn_tail, p.reference, base.length, ref)
            path_read = p.reference
        tf_s = time.perf_counter() - t0
    return TurnResult(run, decoded, div, logp_ref, caches[ref], path_read, tf_s, decode_s)


def _joined(parts: list[tuple[list[int], TurnResult]], n: int) -> TurnResult:
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
    return TurnResult(run, decoded, [t.div[j] for t, j in pick], first.logp_ref, first.ref_cache, first.path,
                      sum(t.tf_s for _, t in parts), decode_s)


@dataclass
class TurnRows:
    """One turn's rows, made when the turn is verified or decoded (`_turn_rows`): per variant, one row per question
    mode the turn labels. Their answer columns (gold, where the metric is agreement; prediction, score, decode seconds,
    new tokens, where each left the full answer) are written by `answer` once the answers are known: at once for a
    turn decoded row by row, after `decode_diverged` gives a verified one its diverged rows' answers (`Verified`: its decode seconds then
    include the diverged rows' share, beside `decode_s`, the full answer's share of the shared decoding)."""

    tokenizer: object
    sample: Sample
    ref: int
    gold: list[str]
    answers: Verified | list
    decode_s: float | None
    rows: list[list[dict]]

    def answer(self) -> None:
        """Write the answer columns into the rows."""
        if isinstance(self.answers, Verified):
            answers, first, decode_s = self.answers.answers, self.answers.first, self.decode_s + self.answers.decode_s
        else:
            answers, first, decode_s = self.answers, [None] * len(self.rows), self.decode_s
        gold = self.gold
        if self.sample.metric in AGREEMENT:  # scored against (and `gold` is) the full cache's answer to this turn: its row scores 1
            gold = [self.tokenizer.decode(answers[self.ref], skip_special_tokens=True)]
        for i, made in enumerate(self.rows):
            prediction = self.tokenizer.decode(answers[i], skip_special_tokens=True)
            columns = {"gold": list(gold), "prediction": prediction, "score": score(self.sample.metric, prediction, gold),
                       "decode_s": decode_s, "new_tokens": len(answers[i]), "diverged_at": first[i]}
            for row in made:
                row.update(columns)


def _turn_rows(shared: Shared, pl: Plan, comp: Compression, number: int, turn: TurnResult, reference_s: float,
               request: NoiseRequest | None, pending: list[Pending] | None) -> TurnRows:
    """One turn's rows, every variant of the compression × the question modes the turn labels, their answer columns
    to come (`TurnRows.answer`); with `request`, the full row's `Pending` entry (its rows and the token ids before its
    path) added to `pending`."""
    batch, rows = comp.batch, []
    for i, variant in enumerate(comp.variants):
        row = {
            **pl.sample.row(),
            "method": variant.method,
            "method_kind": variant.kind,
            "press": variant.params.get("press"),
            "wrapper": variant.params.get("wrapper"),
            "press_kwargs": json.dumps(variant.params["kwargs"], sort_keys=True) if "press" in variant.params else None,
            "layer_budgets": "layer_budgets" in variant.params,  # per-layer budgets from calibration
            **variant.storage,
            "budget": variant.budget,
            "turn": number,
            "gold": None,  # this and the other answer columns: `TurnRows.answer`
            "compressed_tokens": comp.base.length,
            "prediction": None,
            "score": None,
            **comp.stats[i],
            **turn.div[i],
            "prefill_s": pl.prefill_s[comp.key],
            "compress_s": comp.compress_s[i],
            "decode_s": None,
            "decode_batch": batch[i],
            "waves": len(comp.groups),  # the waves the compression's variants ran in (kvlab.state.memory: the job's budget)
            "teacher_forced_s": turn.tf_s,
            "new_tokens": None,
            # where the row's greedy choice first left the full cache's answer (None: never, so its
            # answer is the full cache's; on the full row itself, a near-tie between its parallel and
            # its step-by-step pass: the numerical noise floor)
            "diverged_at": None,
            # on the full row: the same cache read along the same path token by token, in a batch of other
            # prompts (its own decoding's steps, or `noise_floor`'s, filled in once every sample's rows are made),
            # the floor of KL and of answer changes that rounding alone produces; empty on every other row
            **dict.fromkeys(NOISE_COLUMNS),
            # on the full row: its path read by the model in another compute dtype (`dtype_floor`)
            **dict.fromkeys(DTYPE_NOISE_COLUMNS),
        }
        made = [{**row, "question_mode": mode} for mode in pl.turns_of[comp.key][number]]
        rows.append(made)
        if i == comp.ref and request is not None:
            pending.append(Pending(request, made, comp.base.ids + request.tail))
    answers, decode_s = (turn.run, reference_s) if turn.run is not None else (turn.decoded, turn.decode_s)
    return TurnRows(shared.tokenizer, pl.sample, comp.ref, pl.turns[comp.key][number - 1][1], answers, decode_s, rows)
