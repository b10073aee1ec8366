"""Recency: a single needle within the last few hundred tokens of the document, where a sliding window
(StreamingLLM) still sees it. `from_end_tokens` lists the distances (in the model's tokens) between the
needle and the end of the document; the needle goes at the sentence boundary closest to each."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.util.params import param
from kvlab.tasks.base import Sample, encode, fit, grid_samples
from kvlab.tasks.haystack import Filler
from kvlab.tasks.needle import INSTRUCTION, NEEDLE, QUESTION, draw_keys, draw_values, render
from kvlab.tasks.params import InHaystack


NAME = "recency"


def shape(sample: Sample) -> str:
    return "recency"


@dataclass(kw_only=True)
class Params(InHaystack):
    from_end_tokens: list[int] = param(doc="distances (model tokens) between the needle and the end of the document",
                                       minItems=1, items={"minimum": 0})


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    too_far = [d for d in spec["from_end_tokens"] if d >= context_tokens]
    if too_far:
        raise ValueError(f"task '{name}': from_end_tokens {too_far[0]} must be below context_tokens {context_tokens}")
    return grid_samples(name, spec, tokenizer, context_tokens, spec["from_end_tokens"], make_sample)


def make_sample(name: str, spec: dict, tokenizer, target: int, distance: int, index: int, rng) -> Sample:
    (key,) = draw_keys(rng, 1)
    (value,) = draw_values(rng, 1)
    needle = NEEDLE.format(key=key, value=value)
    question = QUESTION.format(key=key)
    filler = Filler(spec.get("haystack", "noise"), rng)
    n = fit(name, target, lambda k: render(tokenizer, INSTRUCTION, filler.take(k), [(1.0, needle)], question, "after"))
    sentences = filler.take(n)
    after, at = 0, n  # walk back from the end until `distance` tokens lie after the insertion point
    while at > 0 and after + len(encode(tokenizer, " " + sentences[at - 1])) <= distance:
        at -= 1
        after += len(encode(tokenizer, " " + sentences[at]))
    prompt = render(tokenizer, INSTRUCTION, sentences, [(at / n, needle)], question, "after")
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{target}-e{distance}-s{index}",
        context_tokens=target,
        depth=at / n,
        seed=spec["seed"],
        prompt=prompt,
        gold=[value],
        meta={"key": key, "tokens_after_needle": after, "from_end_tokens": distance, "needles": [needle], "span": filler.span(n)},
    )


def problem(name: str, spec: dict):
    if max(spec["from_end_tokens"]) >= min(spec["context_tokens"]):
        return "from_end_tokens", f"each must be below every context length ({min(spec['context_tokens'])})"
    return None
