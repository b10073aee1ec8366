"""The shipped workload example (kvlab.workload_recipe.qa_mix): real SQuAD and HotpotQA rows from RULER's installed
data, deterministic, mixed, within their word bounds, each context holding the documents that answer it; checked
against the installed json files themselves, not the recipe's reading of them."""

import json
import re
from importlib import resources

import pytest

from kvlab.tasks import dataset
from kvlab.workload_recipe import qa_mix

ROWS, SEED, WORDS = 12, 3, (700, 1400)


def _raw(name):
    return json.loads(resources.files("long_context_eval").joinpath("data", "synthetic", "json", name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    assert qa_mix(path, rows=ROWS, seed=SEED, words=WORDS) == ROWS
    return path, [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _documents(context):
    """The numbered documents of a context, checking they run 1..n."""
    blocks = context.split("\n\n")
    headers = [re.match(r"Document (\d+):\n", b) for b in blocks]
    assert all(headers) and [int(h.group(1)) for h in headers] == list(range(1, len(blocks) + 1))
    return [b[h.end():] for b, h in zip(blocks, headers)]


def test_deterministic(written, tmp_path):
    path, _ = written
    qa_mix(tmp_path / "again.jsonl", rows=ROWS, seed=SEED, words=WORDS)
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()
    qa_mix(tmp_path / "other.jsonl", rows=ROWS, seed=SEED + 1, words=WORDS)
    assert (tmp_path / "other.jsonl").read_bytes() != path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.jsonl", "other.jsonl"]  # no temporary file left


def test_rows_mixed_distinct_and_within_bounds(written):
    path, data = written
    assert len(data) == ROWS and len(dataset.load(path)) == ROWS  # a valid file for kind dataset
    assert [r["source"] for r in data] == ["squad", "hotpotqa"] * (ROWS // 2)
    assert all(set(r) == {"id", "context", "question", "answers", "source"} for r in data)
    assert all(r["id"].startswith(r["source"] + "-") for r in data)
    assert all(isinstance(r["answers"], list) and r["answers"] and all(isinstance(a, str) and a.strip() for a in r["answers"]) for r in data)
    assert all(WORDS[0] <= len(r["context"].split()) <= WORDS[1] for r in data)
    assert len({r["question"] for r in data}) == ROWS and len({r["id"] for r in data}) == ROWS


def test_squad_answers_are_spans_of_the_context(written):
    _, data = written
    gold = {}  # question -> the paragraphs that ask it (a few questions recur)
    for article in _raw("squad.json")["data"]:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                gold.setdefault(qa["question"].strip(), set()).add(p["context"])
    for r in (r for r in data if r["source"] == "squad"):
        documents = _documents(r["context"])
        assert gold[r["question"]] & set(documents) and len(documents) > 1  # the gold paragraph among distractors
        assert all(a in r["context"] for a in r["answers"])


def test_hotpotqa_contexts_hold_their_supporting_documents(written):
    _, data = written
    items = {item["question"].strip(): item for item in _raw("hotpotqa.json")}
    for r in (r for r in data if r["source"] == "hotpotqa"):
        item = items[r["question"]]
        assert r["answers"] == [item["answer"].strip()]
        titles = {title for title, _ in item["supporting_facts"]}
        paragraphs = {title: f"{title}\n{''.join(sentences)}" for title, sentences in item["context"]}
        documents = _documents(r["context"])
        assert all(paragraphs[t] in documents for t in titles)
        distractors = [d for d in documents if d not in {paragraphs[t] for t in titles}]
        assert distractors and not set(distractors) & set(paragraphs.values())  # from other questions


@pytest.mark.parametrize("kwargs,message", [
    ({"rows": 0}, "rows must be an integer of at least 1, got 0"),
    ({"words": (900, 500)}, "words must be a pair (low, high) of whole numbers with 0 < low < high, e.g. (700, 1400), got (900, 500)"),
    ({"words": (1, 2)}, "squad has too few distinct questions whose documents fit (1, 2) words for 120 rows; ask fewer rows or wider words"),
    ({"words": (700,)}, "words must be a pair (low, high) of whole numbers with 0 < low < high, e.g. (700, 1400), got (700,)"),
])
def test_bad_arguments_get_one_line(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        qa_mix(tmp_path / "x.jsonl", **kwargs)
    assert str(info.value) == f"qa_mix: {message}" and "\n" not in str(info.value)
    assert not (tmp_path / "x.jsonl").exists()
