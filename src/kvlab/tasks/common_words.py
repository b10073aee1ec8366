"""Aggregation, common words (RULER's cwe shape): a numbered list of words where a few words recur many
times and the rest appear rarely; the answer is the frequent ones. Every word matters a little, so the
input is redundant but no single token holds the answer. Scored with string_match_all."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.util.corpus import kjv_vocabulary
from kvlab.util.params import param
from kvlab.tasks.base import Prompt, Sample, chat_prompt, fit, independent
from kvlab.tasks.params import Answered

INSTRUCTION = "Below is a numbered list of words. Some words appear more often than the others: remember which."
QUESTION = "What are the {k} most common words in the list above? Answer with the {k} words only."



NAME = "common_words"


def shape(sample: Sample) -> str:
    return "aggregation"


@dataclass(kw_only=True)
class Params(Answered):
    common_words: int = param(5, "how many words recur (the answer)", minimum=1, maximum=20)
    common_freq: int = param(10, "occurrences of each common word", minimum=2)
    uncommon_freq: int = param(2, "occurrences of each other word (below common_freq)", minimum=1)


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    return independent(name, [
        (f"{name}:{spec['seed']}:{context_tokens}:{i}", lambda rng, i=i: make_sample(name, spec, tokenizer, context_tokens, i, rng))
        for i in range(spec["samples"])
    ])


def make_sample(name: str, spec: dict, tokenizer, target: int, index: int, rng) -> Sample:
    k, freq, rare = spec.get("common_words", 5), spec.get("common_freq", 10), spec.get("uncommon_freq", 2)
    if rare >= freq:
        raise ValueError(f"task '{name}': uncommon_freq ({rare}) must be below common_freq ({freq})")
    vocab = list(kjv_vocabulary())
    rng.shuffle(vocab)
    common, others = vocab[:k], vocab[k:]
    order_seed = rng.random()

    def build(n: int) -> Prompt:
        if n > len(others):
            raise ValueError(f"task '{name}': context_tokens {target} needs more distinct words than the corpus has")
        words = common * freq + others[:n] * rare
        random.Random(f"{order_seed}:{n}").shuffle(words)
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return chat_prompt(tokenizer, f"{INSTRUCTION}\n\n{listing}", "\n\n" + QUESTION.format(k=k))

    n = fit(name, target, build)
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{target}-s{index}",
        context_tokens=target,
        depth=None,
        seed=spec["seed"],
        prompt=build(n),
        gold=common,
        meta={"uncommon_words": n},
    )


def problem(name: str, spec: dict):
    if spec["uncommon_freq"] >= spec["common_freq"]:
        return "uncommon_freq", f"must be below common_freq {spec['common_freq']}"
    return None
