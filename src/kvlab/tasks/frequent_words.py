"""Aggregation, frequent words (RULER's fwe shape): running text of words whose counts follow a Zipf law
(count of the r-th word ∝ r^-alpha); the answer is the three most frequent. Scored with string_match_all."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.util.corpus import kjv_vocabulary
from kvlab.util.params import param
from kvlab.tasks.base import Prompt, Sample, chat_prompt, fit, independent
from kvlab.tasks.params import Answered

INSTRUCTION = "Read the following text of words and note how often each word occurs."
QUESTION = "What are the three most frequent words in the text above? Answer with the three words only."
TOP = 3


NAME = "frequent_words"


def shape(sample: Sample) -> str:
    return "aggregation"


@dataclass(kw_only=True)
class Params(Answered):
    alpha: float = param(2.0, "Zipf exponent of word counts", exclusiveMinimum=0)


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    return independent(name, [
        (f"{name}:{spec['seed']}:{context_tokens}:{i}", lambda rng, i=i: make_sample(name, spec, tokenizer, context_tokens, i, rng))
        for i in range(spec["samples"])
    ])


def zipf_counts(total: int, alpha: float) -> list[int]:
    """Counts for ranks 1, 2, … summing to at most `total`, strictly decreasing over the top TOP + 1 ranks
    (so the answer is unique), ranks with a zero count dropped."""
    weights = [r**-alpha for r in range(1, total + 1)]
    norm = sum(weights)
    counts = [int(total * w / norm) for w in weights]
    counts = [c for c in counts if c > 0]
    for i in range(min(TOP, len(counts) - 1), 0, -1):  # break ties at the top by lifting higher ranks
        if counts[i - 1] <= counts[i]:
            counts[i - 1] = counts[i] + 1
    return counts


def make_sample(name: str, spec: dict, tokenizer, target: int, index: int, rng) -> Sample:
    alpha = spec.get("alpha", 2.0)
    vocab = list(kjv_vocabulary())
    rng.shuffle(vocab)
    order_seed = rng.random()

    def build(n: int) -> Prompt:
        counts = zipf_counts(n, alpha) if n else []
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"{order_seed}:{n}").shuffle(words)
        return chat_prompt(tokenizer, f"{INSTRUCTION}\n\n" + " ".join(words), "\n\n" + QUESTION)

    n = fit(name, target, build)
    counts = zipf_counts(n, alpha)
    if len(counts) <= TOP:
        raise ValueError(f"task '{name}': context_tokens {target} leaves too few words for a top {TOP}")
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{target}-s{index}",
        context_tokens=target,
        depth=None,
        seed=spec["seed"],
        prompt=build(n),
        gold=vocab[:TOP],
        meta={"words": sum(counts), "top_counts": counts[: TOP + 1]},
    )
