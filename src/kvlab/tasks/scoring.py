"""RULER's substring scorers, applied after RULER's own clean-up of a prediction (its eval/evaluate.py)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(text: str) -> str:
    """As RULER's postprocess_pred: strip, each control character becomes a newline, strip again."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, gold: list[str]) -> float:
    """Fraction of gold strings found (case-insensitive) in the prediction."""
    if not gold:
        raise ValueError("string_match_all needs at least one gold answer")
    pred = clean(prediction).lower()
    return sum(g.lower() in pred for g in gold) / len(gold)


def string_match_part(prediction: str, gold: list[str]) -> float:
    """1.0 if any gold string occurs (case-insensitive) in the prediction, else 0.0."""
    if not gold:
        raise ValueError("string_match_part needs at least one gold answer")
    pred = clean(prediction).lower()
    return float(any(g.lower() in pred for g in gold))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(prediction: str, gold: list[str]) -> float:
    """1.0 if the last number in the prediction (thousands separators ignored) equals the gold number."""
    if len(gold) != 1:
        raise ValueError("last_number needs exactly one gold answer")
    numbers = _NUMBER.findall(clean(prediction))
    if not numbers:
        return 0.0
    return float(float(numbers[-1].replace(",", "")) == float(gold[0]))


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part, "last_number": last_number}


def score(metric: str, prediction: str, gold: list[str]) -> float:
    """The sample's score in [0, 1]; NaN for tasks measured by KL and perplexity only (metric 'none')."""
    if metric == "none":
        return float("nan")
    return SCORERS[metric](prediction, gold)
