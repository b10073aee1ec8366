"""The shipped workload example (kvlab.steps.workload_recipe.qa_mix): real SQuAD and HotpotQA rows from RULER's installed
data, deterministic, mixed, within their word bounds, each context holding the documents that answer it; checked
against the installed json files themselves, not the recipe's reading of them."""

import json
import re
from importlib import resources

import pytest

from kvlab.tasks import dataset, generate
from kvlab.steps.workload_recipe import INSTRUCTION, RECIPES, chat_mix, qa_mix

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


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    assert chat_mix(path, rows=ROWS, seed=SEED, words=WORDS) == ROWS
    return path, [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_chat_mix_writes_prompts_only_conversations_kind_dataset_reads(chats, tmp_path):
    """chat_mix (issue 54): deterministic chat rows without answers; SQuAD rows ask two questions of one paragraph
    (the first one's SQuAD answer as the logged reply), HotpotQA rows one user turn; all valid for kind dataset."""
    path, data = chats
    chat_mix(tmp_path / "again.jsonl", rows=ROWS, seed=SEED, words=WORDS)
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()
    records = dataset.load(path)
    assert len(records) == ROWS and all(r.messages and r.answers == () for r in records)
    assert all(set(r) == {"id", "messages", "source"} for r in data) and [r["source"] for r in data] == ["squad", "hotpotqa"] * (ROWS // 2)
    gold = {}
    for article in _raw("squad.json")["data"]:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                gold.setdefault(qa["question"].strip(), {}).setdefault(p["context"], {a["text"].strip() for a in qa["answers"]})
    asked = []
    for r in data:
        roles = [m["role"] for m in r["messages"]]
        questions = [m["content"].rsplit("Question: ", 1)[1].removesuffix("\n" + INSTRUCTION) for m in r["messages"] if m["role"] == "user"]
        asked += questions
        assert all(m["content"].endswith(INSTRUCTION) for m in r["messages"] if m["role"] == "user")
        assert WORDS[0] <= len(r["messages"][0]["content"].split("\n\nQuestion: ")[0].split()) <= WORDS[1]
        if r["source"] == "hotpotqa":
            assert roles == ["user"]
            continue
        assert roles == ["user", "assistant", "user"]
        documents = _documents(r["messages"][0]["content"].split("\n\nQuestion: ")[0])
        shared = set(gold[questions[0]]) & set(gold[questions[1]]) & set(documents)  # one paragraph asked twice
        assert shared and r["messages"][1]["content"] in set().union(*(gold[questions[0]][p] for p in shared))
    assert len(asked) == len(set(asked)) == ROWS + ROWS // 2


def test_chat_mix_rows_render_and_default_to_agreement(chats, tiny):
    path, data = chats
    spec = {"kind": "dataset", "recipe": "chat_mix", "recipe_rows": ROWS, "columns": {}, "template": dataset.DEFAULT_TEMPLATE,
            "context_tokens": [0], "samples": 2, "seed": 0, "chat_turns": "last"}
    dataset.derive("chats", spec)
    assert spec["metric"] == "agreement"
    spec["path"] = str(path)
    for s in generate("chats", spec, tiny[1], 0):
        row = data[s.meta["row"] - 1]
        p = s.prompt
        assert tiny[1].decode(p.context + p.question + p.suffix) == tiny[1].apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        assert bool(p.question) == (len(row["messages"]) > 1)  # a one-turn request is compressed whole


def test_every_recipe_is_in_the_schema_and_runnable():
    from conftest import ROOT

    from kvlab.state.config import load_schema

    schema = load_schema(ROOT / "workflow" / "config.schema.yaml")
    dataset_spec = next(b["then"] for b in schema["$defs"]["task"]["allOf"] if b["if"]["properties"]["kind"].get("const") == "dataset")
    assert set(dataset_spec["properties"]["recipe"]["enum"]) == set(RECIPES) == set(dataset.PROMPTS_ONLY_RECIPES)
    with pytest.raises(ValueError, match=r"^chat_mix: rows must be an integer"):
        chat_mix("unused.jsonl", rows=0)
