"""Prose continuation (no question): a prefix of real public-domain prose, then its true continuation
teacher-forced, for per-token KL(full ‖ method) and perplexity. Plain text, no chat template — the
protocol of the quantization study (prefix of `context_tokens`, `continuation_tokens` scored)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.util.corpus import kjv_sentences, prose_ids
from kvlab.util.params import param
from kvlab.tasks.base import Prompt, Sample, independent
from kvlab.tasks.params import TaskParams


NAME = "continuation"


def shape(sample: Sample) -> str:
    return "prose"


def reference_tokens(spec: dict) -> int:
    return spec["continuation_tokens"]  # teacher-forced after the prefix; no question, no answer


@dataclass(kw_only=True)
class Params(TaskParams):  # nothing is answered: no decoding cap
    continuation_tokens: int = param(128, "true continuation tokens teacher-forced for KL and perplexity", minimum=2, maximum=4096)


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    sentences = kjv_sentences()
    want = context_tokens + spec["continuation_tokens"]

    def make(i: int, rng: random.Random) -> Sample:
        start = rng.randrange(len(sentences))
        ids, count = prose_ids(tokenizer, sentences, start, want)
        # The last prefix token is fed with the continuation, so every continuation token is predicted
        # from a possibly compressed cache.
        prompt = Prompt(ids[: context_tokens - 1], [], ids[context_tokens - 1 : context_tokens], reference=ids[context_tokens:want])
        return Sample(
            task=name,
            kind=NAME,
            sample_id=f"{name}-{context_tokens}-s{i}",
            context_tokens=context_tokens,
            depth=None,
            seed=spec["seed"],
            prompt=prompt,
            gold=[],
            metric="none",
            meta={"span": ("prose", start, count, len(sentences))},  # its first sentence, how many, of how many
        )

    return independent(name, [(f"{name}:{spec['seed']}:{context_tokens}:{i}", lambda rng, i=i: make(i, rng)) for i in range(spec["samples"])])
