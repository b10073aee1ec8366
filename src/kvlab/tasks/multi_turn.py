"""Multi-turn: two needles; the first turn asks for one, the second turn — on the same cache, after the
first answer — asks for the other. The cache is compressed once, for the first turn, so an eviction
method that kept only what the first question needed loses the second answer. Rows carry `turn`."""

from __future__ import annotations

from kvlab.tasks.base import Prompt, Sample, fit, grid_samples
from kvlab.tasks.haystack import Filler
from kvlab.tasks.needle import INSTRUCTION, NEEDLE, QUESTION, draw_keys, draw_values, render
from kvlab.tasks.params import AtDepths

NAME = "multi_turn"


def shape(sample: Sample) -> str:
    return "multi-turn"


Params = AtDepths  # no parameters of its own


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    return grid_samples(name, spec, tokenizer, context_tokens, spec["depths"], make_sample)


def make_sample(name: str, spec: dict, tokenizer, target: int, depth: float, index: int, rng) -> Sample:
    first, second = draw_keys(rng, 2)
    v1, v2 = draw_values(rng, 2)
    inserts = [(depth, NEEDLE.format(key=first, value=v1)), (rng.random(), NEEDLE.format(key=second, value=v2))]
    filler = Filler(spec.get("haystack", "noise"), rng)

    def build(n: int) -> Prompt:
        followup = [(v1, QUESTION.format(key=second), [v2])]
        return render(tokenizer, INSTRUCTION, filler.take(n), inserts, QUESTION.format(key=first), "after", followup)

    n = fit(name, target, build)
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{target}-d{depth:g}-s{index}",
        context_tokens=target,
        depth=depth,
        seed=spec["seed"],
        prompt=build(n),
        gold=[v1],
        meta={"keys": [first, second], "second_depth": inserts[1][0], "needles": [s for _, s in inserts], "span": filler.span(n)},
    )
