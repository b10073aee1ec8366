"""Single needle in a haystack (RULER niah_single shape): a 7-digit value for a named key is hidden at a
given depth of filler text; the question asks for the key's value. Scored with string_match_all."""

from __future__ import annotations

import random

from kvlab.tasks.base import Prompt, Sample, encode, split_chat

FILLER = (
    "The river runs slowly past the old stone mill.",
    "A bell rings somewhere across the quiet town.",
    "The wind moves through the tall summer grass.",
    "Clouds drift over the hills toward the sea.",
    "An old dog sleeps in the shade of the porch.",
    "The baker opens the shop before the sun is up.",
    "Rain taps gently on the roof of the barn.",
    "A cart rolls along the road to the market.",
)
ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faded", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
    "misty", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "umber", "vivid", "woolly", "young",
)
NOUNS = (
    "anchor", "badger", "candle", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "ribbon", "saddle", "thistle",
    "violin", "walrus", "yarrow", "zephyr",
)
INSTRUCTION = "A special magic number is hidden in the text below. Remember it: you will be asked for it afterwards."
NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the text above? Answer with the number only."


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    """All samples of one (task, context length): `samples` per depth, seeded and deterministic."""
    out = []
    for depth in spec["depths"]:
        for i in range(spec["samples"]):
            rng = random.Random(f"{name}:{spec['seed']}:{context_tokens}:{depth}:{i}")
            out.append(make_sample(name, tokenizer, context_tokens, depth, spec["seed"], i, rng))
    return out


def make_sample(name: str, tokenizer, target: int, depth: float, seed: int, index: int, rng) -> Sample:
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(key=key, value=value)
    question = "\n\n" + QUESTION.format(key=key)
    start = rng.randrange(len(FILLER))

    def build(n: int) -> tuple[Prompt, int]:
        sentences = [FILLER[(start + j) % len(FILLER)] for j in range(n)]
        at = round(depth * n)
        sentences.insert(at, needle)
        head, q, suffix = split_chat(tokenizer, INSTRUCTION + "\n\n" + " ".join(sentences), question)
        return Prompt(encode(tokenizer, head), encode(tokenizer, q), encode(tokenizer, suffix)), at

    fixed = build(0)[0].tokens
    if fixed >= target:
        raise ValueError(f"task '{name}': context_tokens {target} is too short; the prompt alone needs {fixed} tokens")
    lo, hi = 0, 1
    while build(hi)[0].tokens <= target:  # grow until too long, then bisect: the largest n that fits
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if build(mid)[0].tokens <= target else (lo, mid)
    prompt, at = build(lo)
    return Sample(
        task=name,
        sample_id=f"{name}-{target}-d{depth:g}-s{index}",
        context_tokens=target,
        depth=depth,
        seed=seed,
        prompt=prompt,
        gold=[value],
        meta={"key": key, "needle_sentence": at, "haystack_sentences": lo},
    )
