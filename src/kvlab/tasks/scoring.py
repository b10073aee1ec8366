"""Answer scorers, each (prediction, gold answers) -> a score in [0, 1], applied after RULER's clean-up of a
prediction (its eval/evaluate.py): RULER's substring matches, the last number (arithmetic), and LongBench's QA and
summary metrics for a user's own workload (`kind: dataset`): SQuAD's token F1 and exact match, ROUGE-L; and
agreement with the full cache's own answer (exact, or token F1), which needs no reference."""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cache

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


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> list[str]:
    """SQuAD v1.1's answer normalization, as LongBench's QA metrics use it: lower case, punctuation removed, the
    articles a / an / the removed, whitespace collapsed; returned as tokens."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def _best(prediction: str, gold: list[str], metric: str, one) -> float:
    if not gold:
        raise ValueError(f"{metric} needs at least one gold answer")
    pred = clean(prediction)
    return max(one(pred, g) for g in gold)


def _f1(prediction: str, answer: str) -> float:
    pred, ref = normalize(prediction), normalize(answer)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, gold: list[str]) -> float:
    """Token F1 of the normalized prediction against the best gold answer (SQuAD v1.1's F1, LongBench's
    qa_f1_score): the bag of tokens they share, its precision and recall; 0 when they share none."""
    return _best(prediction, gold, "qa_f1", _f1)


def exact_match(prediction: str, gold: list[str]) -> float:
    """1.0 when the normalized prediction equals a normalized gold answer (SQuAD v1.1's exact match)."""
    return _best(prediction, gold, "exact_match", lambda p, g: float(normalize(p) == normalize(g)))


@cache
def _rouge():
    from rouge_score import rouge_scorer  # PyPI rouge-score, Google's implementation of the ROUGE metrics

    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, gold: list[str]) -> float:
    """ROUGE-L F-measure (longest common subsequence of tokens) against the best gold answer, from rouge-score.
    Its default tokenizer keeps ASCII letters and digits only, lower-cased: text in another script (Chinese,
    Cyrillic, ...) has no tokens there and scores 0."""
    return _best(prediction, gold, "rouge_l", lambda p, g: float(_rouge().score(g, p)["rougeL"].fmeasure))


def agreement(prediction: str, full: list[str]) -> float:
    """1.0 when the answer is the full cache's answer to the same prompt (`full`: that one answer) after SQuAD's
    normalization, else 0.0: 1 − the mean is the share of answers the compression changed. No reference needed;
    an empty answer agrees with an empty one."""
    if len(full) != 1:
        raise ValueError("agreement needs exactly the full cache's answer")
    return float(normalize(clean(prediction)) == normalize(clean(full[0])))


def agreement_f1(prediction: str, full: list[str]) -> float:
    """Token F1 of the answer against the full cache's answer to the same prompt (a partial agreement): 1.0 when
    they normalize to the same tokens (two empty answers included), else SQuAD's F1 (0 when they share none)."""
    if len(full) != 1:
        raise ValueError("agreement_f1 needs exactly the full cache's answer")
    pred, ref = clean(prediction), clean(full[0])
    return 1.0 if normalize(pred) == normalize(ref) else _f1(pred, ref)


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part, "last_number": last_number,
           "qa_f1": qa_f1, "exact_match": exact_match, "rouge_l": rouge_l, "agreement": agreement,
           "agreement_f1": agreement_f1}
# metrics scored against the full cache's own answer to the same prompt, not the sample's references (the engine
# passes that answer as the gold: kvlab.engine.sample)
AGREEMENT = ("agreement", "agreement_f1")


def score(metric: str, prediction: str, gold: list[str]) -> float:
    """The sample's score in [0, 1]; NaN for tasks measured by KL and perplexity only (metric 'none')."""
    if metric == "none":
        return float("nan")
    return SCORERS[metric](prediction, gold)
