"""What a task generator produces: prompts split where compression happens, with gold answers."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Turn:
    """A later turn of the same conversation: the previous answer (the gold one, so every method is
    asked the same second question), the end of that turn, the next user turn and the assistant header."""

    ids: list[int]
    gold: list[str]


@dataclass(frozen=True)
class Prompt:
    """A prompt cut into the pieces the engine needs.

    ``context`` is always compressed, but for its first ``prefix`` tokens; ``question`` is compressed only in
    question-aware mode; ``suffix`` (the chat template's end of turn + assistant header) is never compressed.
    ``followups`` are later turns asked on the same compressed cache (multi-turn tasks).
    ``reference`` is a continuation to teacher-force for KL and perplexity (prose tasks); when empty
    the engine teacher-forces the full cache's own answer instead.
    Each is a list of token ids; context + question + suffix is the whole first-turn prompt.
    """

    context: list[int]
    question: list[int]
    suffix: list[int]
    followups: tuple[Turn, ...] = ()
    reference: list[int] = field(default_factory=list)
    text: tuple[str, str] = ("", "")  # the user's text before the question, and the question (un-templated)
    head: int = 0  # context tokens of the chat template before the user's text (kept by prompt compression)
    # leading context tokens no method evicts or drops (a dataset template's text before {context}, and the chat
    # template's head before it): compression budgets count the tokens after them, as kvpress counts only its context
    prefix: int = 0

    @property
    def tokens(self) -> int:
        return len(self.context) + len(self.question) + len(self.suffix)

    @cached_property  # every row of the sample carries it
    def sha1(self) -> str:
        """SHA-1 of every token id the prompt feeds (context, question, suffix, later turns, reference): two
        samples with the same hash ask the same question of the same document, so they are one prompt, not two."""
        pieces = [self.context, self.question, self.suffix, [t.ids for t in self.followups], self.reference]
        return hashlib.sha1(json.dumps(pieces, default=int).encode()).hexdigest()


@dataclass(frozen=True)
class Sample:
    task: str
    kind: str
    sample_id: str
    context_tokens: int  # the target length
    depth: float | None  # needle position as a fraction of the document (None where it does not apply)
    seed: int
    prompt: Prompt
    gold: list[str]
    metric: str = "string_match_all"
    meta: dict = field(default_factory=dict)

    @property
    def shape(self) -> str:
        """The task's shape, the report's grouping (the article's decision table has one row per shape), as the
        sample's kind gives it (its module's `shape`)."""
        from kvlab.tasks import shape  # the kinds' registry, which imports the kinds, which import this module

        return shape(self)

    def row(self) -> dict:
        """The columns every result row of this sample carries."""
        return {
            "task": self.task,
            "task_kind": self.kind,
            "shape": self.shape,
            "sample_id": self.sample_id,
            "context_tokens": self.context_tokens,
            "prompt_tokens": self.prompt.tokens,
            "prompt_sha1": self.prompt.sha1,
            "depth": self.depth,
            "seed": self.seed,
            "metric": self.metric,
            "ruler_task": self.meta.get("ruler_task"),  # RULER's own task name (niah_single_1 … qa_2); None elsewhere
            "cut_tokens": self.meta.get("cut_tokens"),  # a dataset row's prompt tokens cut from its middle; None elsewhere
            "prefix_tokens": self.prompt.prefix or None,  # leading prompt tokens kept out of compression; None elsewhere
        }

    def to_dict(self) -> dict:
        return asdict(self)

    def clash(self, other: Sample) -> str | None:
        """Why this sample is not independent of `other` (None if it is): the same prompt, a needle in common
        (meta `needles`: the sentences that hold the answer), or overlapping stretches of one corpus (meta `span`:
        pool, first sentence, sentences, pool size; a span wraps around the pool's end)."""
        if self.prompt.sha1 == other.prompt.sha1:
            return "the same prompt"
        if set(self.meta.get("needles", ())) & set(other.meta.get("needles", ())):
            return "a needle in common"
        a, b = self.meta.get("span"), other.meta.get("span")
        if a and b and a[0] == b[0] and ((b[1] - a[1]) % a[3] < a[2] or (a[1] - b[1]) % a[3] < b[2]):
            return f"overlapping {a[0]} text"
        return None


def chat_pieces(tokenizer, before: str, question: str) -> tuple[str, str, str]:
    """Apply the chat template to one user turn; return (template head + `before`, `question`, suffix).

    The template is rendered around a marker so the pieces are cut exactly where the template puts them.
    """
    marker = "\x00KVLAB-SPLIT\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": before + marker + question + marker}],
        add_generation_prompt=True,
        tokenize=False,
    )
    head, q, suffix = rendered.split(marker)
    return head, q, suffix


def chat_prompt(tokenizer, before: str, question: str, followups: list[tuple[str, str, list[str]]] = ()) -> Prompt:
    """A chat Prompt from the user's text before the question and the question itself.

    `followups` are (previous gold answer text, next user message, next gold) triples: each later turn
    is the template's rendering of the conversation so far, minus what the engine already fed.
    """
    head, q, suffix = chat_pieces(tokenizer, before, question)
    context, template = encode(tokenizer, head), encode(tokenizer, chat_pieces(tokenizer, "", question)[0])
    shared = next((i for i, (a, b) in enumerate(zip(context, template)) if a != b), min(len(context), len(template)))
    messages = [{"role": "user", "content": before + question}]
    fed = head + q + suffix
    turns = []
    for answer, user, gold in followups:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not rendered.startswith(fed):
            raise ValueError("the chat template renders earlier turns differently once a later turn is added")
        turns.append(Turn(encode(tokenizer, rendered[len(fed) :]), list(gold)))
        fed = rendered
    return Prompt(
        context, encode(tokenizer, q), encode(tokenizer, suffix), tuple(turns), text=(before, question), head=shared
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


REDRAWS = 100  # draws per sample before `independent` gives up


class TooFewPrompts(ValueError):
    """`independent` found no distinct prompt for a sample after REDRAWS draws; `kept` holds the samples drawn
    before it, the prefix a shorter draw returns."""

    def __init__(self, message: str, kept: list[Sample]) -> None:
        super().__init__(message)
        self.kept = kept


def independent(name: str, draws: list[tuple[str, Callable[[random.Random], Sample]]]) -> list[Sample]:
    """One sample per (seed text, make) in `draws`, each `make(rng)` with an rng seeded by its text. A sample that
    clashes with an earlier one (`Sample.clash`: the same prompt, a shared needle, an overlapping stretch of corpus)
    is drawn again from `text:redraw{k}`, so every sample of a task at one length is an independent prompt, and
    a draw appended to `draws` leaves the earlier ones unchanged."""
    kept: list[Sample] = []
    for text, make in draws:
        for k in range(REDRAWS):
            sample = make(random.Random(text if k == 0 else f"{text}:redraw{k}"))
            why = next((w for w in map(sample.clash, kept) if w), None)
            if why is None:
                kept.append(sample)
                break
        else:
            raise TooFewPrompts(f"task '{name}': sample {len(kept) + 1} of {len(draws)} still shares {why} with another after "
                                f"{REDRAWS} draws; the generator has too few distinct prompts at this length: ask fewer samples", kept)
    return kept


def grid_samples(name: str, spec: dict, tokenizer, context_tokens: int, points, make: Callable) -> list[Sample]:
    """`spec["samples"]` independent samples per grid point (a depth, a distance), each from
    `make(name, spec, tokenizer, context_tokens, point, index, rng)` with its own rng, seeded by task name,
    seed, context length, point and index. They are drawn and returned index by index (every point's first sample,
    then every point's second, …), so raising `samples` only adds draws after the existing ones and leaves those
    unchanged, and any prefix covers the points evenly (an evaluation job's rounds take prefixes); a new point may
    redraw a later sample that would share its prompt, needle or prose."""
    order = [(point, i) for i in range(spec["samples"]) for point in points]
    return independent(name, [
        (f"{name}:{spec['seed']}:{context_tokens}:{point}:{i}",
         lambda rng, point=point, i=i: make(name, spec, tokenizer, context_tokens, point, i, rng))
        for point, i in order
    ])


def fit(name: str, target: int, build: Callable[[int], Prompt]) -> int:
    """The largest filler count n whose prompt `build(n)` fits in `target` tokens (bisection).

    Raises a one-line error when even no filler at all is too long.
    """
    fixed = build(0).tokens
    if fixed >= target:
        raise ValueError(f"task '{name}': context_tokens {target} is too short; the prompt alone needs {fixed} tokens")
    lo, hi = 0, 1
    while build(hi).tokens <= target:  # grow until too long, then bisect
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if build(mid).tokens <= target else (lo, mid)
    return lo
