"""Multi-hop variable tracking (RULER's vt shape): `VAR QXRTA = 48213`, then `VAR MBLZE = VAR QXRTA`, …
spread through filler. The question gives the value; the answer is every variable bound to it, directly or
through the chain. Other chains bound to other values are distractors. Scored with string_match_all."""

from __future__ import annotations

import string
from dataclasses import dataclass

from kvlab.util.params import param
from kvlab.tasks.base import Sample, fit, grid_samples
from kvlab.tasks.haystack import Filler
from kvlab.tasks.needle import render
from kvlab.tasks.params import AtDepths

INSTRUCTION = "Variable assignments are hidden in the text below. Keep track of them: you will be asked about them."
QUESTION = (
    "Find every variable that is assigned the value {value} in the text, directly or through other variables. "
    "Answer with the variable names only."
)



NAME = "variable_tracking"


def shape(sample: Sample) -> str:
    return "multi-hop"


@dataclass(kw_only=True)
class Params(AtDepths):
    hops: int = param(4, "variables in each chain", minimum=1, maximum=16)
    chains: int = param(2, "chains; all but the asked one are distractors", minimum=1, maximum=8)


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    return grid_samples(name, spec, tokenizer, context_tokens, spec["depths"], make_sample)


def make_sample(name: str, spec: dict, tokenizer, target: int, depth: float, index: int, rng) -> Sample:
    hops, chains = spec.get("hops", 4), spec.get("chains", 2)
    names: list[str] = []
    while len(names) < hops * chains:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names:
            names.append(v)
    values = [str(v) for v in rng.sample(range(10_000, 100_000), chains)]
    inserts = []
    for c in range(chains):
        chain = names[c * hops : (c + 1) * hops]
        start = depth if c == 0 else rng.random()  # the asked chain starts at the sample's depth
        step = (1.0 - start) / hops
        inserts.append((start, f"VAR {chain[0]} = {values[c]}."))
        inserts += [(start + j * step, f"VAR {chain[j]} = VAR {chain[j - 1]}.") for j in range(1, hops)]
    question = QUESTION.format(value=values[0])
    filler = Filler(spec.get("haystack", "noise"), rng)
    n = fit(name, target, lambda k: render(tokenizer, INSTRUCTION, filler.take(k), inserts, question, "after"))
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{target}-d{depth:g}-s{index}",
        context_tokens=target,
        depth=depth,
        seed=spec["seed"],
        prompt=render(tokenizer, INSTRUCTION, filler.take(n), inserts, question, "after"),
        gold=names[:hops],
        meta={"value": values[0], "chains": [names[c * hops : (c + 1) * hops] for c in range(chains)],
              "needles": [s for _, s in inserts], "span": filler.span(n)},
    )
