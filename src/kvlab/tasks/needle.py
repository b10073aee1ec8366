"""Needles in a haystack, RULER's niah family in one generator.

A key (`amber-falcon`) is bound to 7-digit values hidden in filler text; the question asks for values.
Parameters: `keys` (needles with distinct keys; those not asked are distractors — multi-key), `values`
(values per key, all asked — multi-value), `queries` (keys asked at once — multi-query), `haystack`
(noise | prose) and `question_position` (after the document, or before it). The first asked needle sits at
the sample's depth; the others at positions drawn once per sample. Scored with string_match_all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from kvlab.util.params import param
from kvlab.tasks.base import Prompt, Sample, chat_prompt, fit, grid_samples
from kvlab.tasks.haystack import Filler
from kvlab.tasks.params import AtDepths

ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faded", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
    "misty", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "umber", "vivid", "woolly", "young",
)
NOUNS = (
    "anchor", "badger", "candle", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "ribbon", "saddle", "thistle",
    "violin", "walrus", "yarrow", "zephyr",
)
INSTRUCTION = "Special magic numbers are hidden in the text below. Remember them: you will be asked for them."
NEEDLE = "The special magic number for {key} is: {value}."
NEEDLE_OF_MANY = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the text? Answer with the number only."
QUESTION_VALUES = "What are all the special magic numbers for {key} mentioned in the text? Answer with the numbers only."
QUESTION_KEYS = "What are the special magic numbers for {keys} mentioned in the text? Answer with the numbers only."


NAME = "niah"


def shape(sample: Sample) -> str:
    """One needle asked after the document, several (distractor keys, several values or keys asked at once), or a
    needle asked before the document."""
    if not sample.prompt.question:
        return "needle, question first"
    return "single needle" if len(sample.gold) == 1 and len(sample.meta["keys"]) == 1 else "several needles"


@dataclass(kw_only=True)
class Params(AtDepths):
    keys: int = param(1, "needles with distinct keys (the ones not asked are distractors)", minimum=1, maximum=16)
    values: int = param(1, "values per key, all asked", minimum=1, maximum=8)
    queries: int = param(1, "keys asked at once (at most keys)", minimum=1, maximum=8)
    question_position: Literal["after", "before"] = param("after", "question after the document, or before it")


DEFAULTS = {"haystack": "noise", "keys": 1, "values": 1, "queries": 1, "question_position": "after"}


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    """All samples of one (task, context length): `samples` per depth, seeded and deterministic."""
    spec = {**DEFAULTS, **spec}
    if spec["queries"] > spec["keys"]:
        raise ValueError(f"task '{name}': queries ({spec['queries']}) cannot exceed keys ({spec['keys']})")
    return grid_samples(name, spec, tokenizer, context_tokens, spec["depths"], make_sample)


def draw_keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def draw_values(rng: random.Random, n: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n)]


def question_for(asked: list[str], values: int) -> str:
    if len(asked) > 1:
        return QUESTION_KEYS.format(keys=", ".join(asked[:-1]) + " and " + asked[-1])
    return (QUESTION_VALUES if values > 1 else QUESTION).format(key=asked[0])


def render(
    tokenizer,
    instruction: str,
    filler: list[str],
    inserts: list[tuple[float, str]],
    question: str,
    position: str,
    followups: list[tuple[str, str, list[str]]] = (),
) -> Prompt:
    """The chat prompt: `instruction`, filler with each (fraction, sentence) inserted, and the question
    after the document (its own compressible piece) or before it (then part of the context);
    `followups` are later turns (see `chat_prompt`)."""
    doc = list(filler)
    at = [(round(frac * len(filler)), i, sentence) for i, (frac, sentence) in enumerate(inserts)]
    for idx, _, sentence in sorted(at, reverse=True):  # from the back, so indices stay valid and ties keep order
        doc.insert(idx, sentence)
    text = " ".join(doc)
    if position == "before":
        return chat_prompt(tokenizer, f"{instruction}\n\n{question}\n\n{text}", "", followups)
    return chat_prompt(tokenizer, f"{instruction}\n\n{text}", f"\n\n{question}", followups)


def make_sample(name: str, spec: dict, tokenizer, target: int, depth: float, index: int, rng) -> Sample:
    keys = draw_keys(rng, spec["keys"])
    values = {k: draw_values(rng, spec["values"]) for k in keys}
    template = NEEDLE_OF_MANY if spec["values"] > 1 else NEEDLE
    needles = [template.format(key=k, value=v) for k in keys for v in values[k]]
    fractions = [depth] + [rng.random() for _ in needles[1:]]  # the first asked needle at the sample's depth
    asked = keys[: spec["queries"]]
    question = question_for(asked, spec["values"])
    filler = Filler(spec["haystack"], rng)

    def build(n: int) -> Prompt:
        return render(tokenizer, INSTRUCTION, filler.take(n), list(zip(fractions, needles)), question, spec["question_position"])

    n = fit(name, target, build)
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{target}-d{depth:g}-s{index}",
        context_tokens=target,
        depth=depth,
        seed=spec["seed"],
        prompt=build(n),
        gold=[v for k in asked for v in values[k]],
        meta={"keys": keys, "asked": asked, "haystack_sentences": n, "needle_sentence": round(depth * n), "needles": needles,
              "span": filler.span(n)},
    )


def problem(name: str, spec: dict):
    if spec["queries"] > spec["keys"]:
        return "queries", f"{spec['queries']} exceeds keys {spec['keys']}; ask at most as many keys as there are"
    return None


def benchmarkable(spec: dict) -> bool:
    """Whether the engine-vs-pipeline benchmark can time this task: a niah task asking after the document (kvpress's
    pipeline takes the question apart from the context)."""
    return spec["kind"] == "niah" and spec["question_position"] == "after"
