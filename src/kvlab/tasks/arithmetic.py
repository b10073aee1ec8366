"""Short-context arithmetic word problems (the article's GSM8K-style control for reasoning), generated
from templates with seeded numbers; two to four operations each. The model is asked to reason briefly and
end with the number; scored by the last number in its answer (`last_number`). `context_tokens` is an upper
bound here: the problems are short, and compression applies to the problem statement."""

from __future__ import annotations

import random

from kvlab.tasks.base import Sample, chat_prompt, independent
from kvlab.tasks.params import Answered

NAME = "arithmetic"


def shape(sample: Sample) -> str:
    return "reasoning"


Params = Answered  # no parameters of its own

NAMES = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemi", "Leo")
INSTRUCTION = "Solve the problem step by step, briefly, then finish with: The answer is N."


def marbles(rng, name, friend):
    a, b, c = rng.randint(5, 40), rng.randint(2, 6), rng.randint(3, 12)
    d = rng.randint(1, a + b * c - 1)
    return (
        f"{name} has {a} marbles. {name} buys {b} bags with {c} marbles in each bag, then gives {d} marbles to {friend}.",
        f"How many marbles does {name} have now?",
        a + b * c - d,
    )


def bakery(rng, name, friend):
    a, b = rng.randint(10, 40), rng.randint(3, 7)
    c = rng.randint(1, a * b // 2)
    d = rng.randint(1, a * b - c - 1)
    return (
        f"{name} bakes {a} loaves every morning for {b} days. {name} sells {c} loaves in total and gives {d} loaves to {friend}.",
        "How many loaves are left?",
        a * b - c - d,
    )


def train(rng, name, friend):
    a = rng.randint(20, 90)
    b, c = rng.randint(1, a - 1), rng.randint(1, 30)
    return (
        f"A train leaves with {a} passengers, {name} among them. At the first stop {b} passengers get off and {c} get on. "
        "At the second stop the number of passengers on board doubles.",
        "How many passengers are on the train after the second stop?",
        2 * (a - b + c),
    )


def savings(rng, name, friend):
    d, share = rng.randint(2, 5), rng.randint(5, 30)
    a, b = rng.randint(10, 50), rng.randint(4, 12)
    c = a * b - d * share
    if c <= 0:
        return savings(rng, name, friend)
    return (
        f"{name} saves {a} dollars a week for {b} weeks, spends {c} dollars on a bike, and splits the rest equally "
        f"into {d} jars.",
        "How many dollars go into each jar?",
        share,
    )


def orchard(rng, name, friend):
    a, b, c = rng.randint(3, 9), rng.randint(4, 12), rng.randint(5, 20)
    d = rng.randint(1, a * b * c // 3)
    return (
        f"{name}'s orchard has {a} rows of apple trees with {b} trees in each row. Each tree gives {c} apples, "
        f"and birds take {d} of them.",
        "How many apples are left for the harvest?",
        a * b * c - d,
    )


TEMPLATES = (marbles, bakery, train, savings, orchard)


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    def make(i: int, rng: random.Random) -> Sample:
        who, friend = rng.sample(NAMES, 2)
        template = TEMPLATES[i % len(TEMPLATES)]
        problem, question, answer = template(rng, who, friend)
        prompt = chat_prompt(tokenizer, f"{INSTRUCTION}\n\n{problem}", f" {question}")
        if prompt.tokens > context_tokens:
            raise ValueError(f"task '{name}': context_tokens {context_tokens} is too short; a problem needs {prompt.tokens} tokens")
        return Sample(
            task=name,
            kind=NAME,
            sample_id=f"{name}-{template.__name__}-s{i}",
            context_tokens=context_tokens,
            depth=None,
            seed=spec["seed"],
            prompt=prompt,
            gold=[str(answer)],
            metric="last_number",
            meta={"template": template.__name__},
        )

    return independent(name, [(f"{name}:{spec['seed']}:{i}", lambda rng, i=i: make(i, rng)) for i in range(spec["samples"])])
