"""The shipped workload example (kvlab.workload_recipe.qa_mix): real SQuAD and HotpotQA rows from RULER's installed
data, deterministic, within their word bounds, each context holding the documents that answer it."""

import json

import pytest

from kvlab.tasks import dataset
from kvlab.workload_recipe import _hotpotqa, _squad, qa_mix


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    assert qa_mix(path, rows=12, seed=3) == 12
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def test_deterministic_mixed_and_within_bounds(rows, tmp_path):
    path, data = rows
    again = tmp_path / "again.jsonl"
    qa_mix(again, rows=12, seed=3)
    assert again.read_bytes() == path.read_bytes()
    qa_mix(tmp_path / "other.jsonl", rows=12, seed=4)
    assert (tmp_path / "other.jsonl").read_bytes() != path.read_bytes()
    assert [r["source"] for r in data] == ["squad", "hotpotqa"] * 6
    assert all(700 <= len(r["context"].split()) - 2 * r["context"].count("Document ") <= 1400 for r in data)
    assert len({r["question"] for r in data}) == 12 and len({r["id"] for r in data}) == 12
    assert len(dataset.load(path)) == 12  # a valid file for kind dataset


def test_each_context_holds_the_documents_that_answer_it(rows):
    _, data = rows
    squad_q, squad_docs = _squad()
    hotpot_q, hotpot_docs = _hotpotqa()
    for r in data:
        source, number = r["id"].split("-")
        questions, docs = (squad_q, squad_docs) if source == "squad" else (hotpot_q, hotpot_docs)
        q = questions[int(number)]
        assert q["question"] == r["question"] and q["answers"] == r["answers"]
        assert all(docs[i] in r["context"] for i in q["gold"])
        assert r["context"].count("Document ") >= len(q["gold"]) + 1  # distractors beside the gold
        if source == "squad":  # SQuAD's answers are spans of their paragraph
            assert all(a in r["context"] for a in r["answers"])


@pytest.mark.parametrize("kwargs,message", [({"rows": 0}, "rows must be at least 1, got 0"),
                                            ({"words": (900, 500)}, "words must be (low, high) with 0 < low < high, got (900, 500)")])
def test_bad_arguments_get_one_line(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        qa_mix(tmp_path / "x.jsonl", **kwargs)
    assert str(info.value) == f"qa_mix: {message}"
    assert not (tmp_path / "x.jsonl").exists()
