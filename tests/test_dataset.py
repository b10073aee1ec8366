"""`kind: dataset` (kvlab.tasks.dataset): a user's rows from every file type, mapped columns, the seeded draw, the
middle cut, the one-line errors, and a job that scores them."""

import json

import pandas as pd
import pytest

from kvlab.steps.evaluate import check_lengths, run_job
from kvlab.methods import build
from kvlab.tasks import dataset, generate

ROWS = [
    {"id": f"r{i}", "context": f"Document {i}. The code of vault {i} is {1000 + i}. " + "Filler words go here. " * 30,
     "question": f"What is the code of vault {i}?", "answers": [str(1000 + i), f"code {1000 + i}"]}
    for i in range(8)
]
ROWS[0]["followups"] = [{"question": "And of vault 3?", "answers": "1003"}]
SPEC = {"kind": "dataset", "columns": {}, "metric": "qa_f1", "template": dataset.DEFAULT_TEMPLATE, "context_tokens": [0],
        "samples": 3, "seed": 0}


def write(path, rows, kind: str):
    """`rows` in one file type (list-valued cells as JSON arrays in CSV, as lists in Parquet and datasets)."""
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        frame = pd.DataFrame([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows])
        frame.to_csv(path, index=False)
    elif kind == "parquet":
        pd.DataFrame([{**r, "followups": json.dumps(r.get("followups", []))} for r in rows]).to_parquet(path)
    else:
        import datasets

        datasets.Dataset.from_list([{**r, "followups": json.dumps(r.get("followups", []))} for r in rows]).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "datasets"])
def test_every_file_type_gives_the_same_records(tmp_path, kind):
    path = write(tmp_path / (f"rows.{kind}" if kind != "datasets" else "rows"), ROWS, kind)
    records = dataset.load(path)
    assert [r.id for r in records] == [f"r{i}" for i in range(8)] and [r.row for r in records] == list(range(1, 9))
    assert records[2].answers == ("1002", "code 1002") and records[2].question == "What is the code of vault 2?"
    assert records[0].followups == (("And of vault 3?", ("1003",)),) and records[1].followups == ()


def test_columns_are_mapped_and_one_answer_string_is_a_list(tmp_path):
    rows = [{"doc": r["context"], "q": r["question"], "gold": r["answers"][0], "key": r["id"]} for r in ROWS]
    path = write(tmp_path / "mine.jsonl", rows, "jsonl")
    records = dataset.load(path, {"context": "doc", "question": "q", "answers": "gold", "id": "key"})
    assert records[5].answers == ("1005",) and records[5].id == "r5" and records[5].context == ROWS[5]["context"]


def test_the_draw_is_seeded_and_more_samples_only_add(tmp_path, tiny):
    tokenizer = tiny[1]
    spec = {**SPEC, "path": str(write(tmp_path / "rows.jsonl", ROWS, "jsonl"))}
    three = generate("mine", spec, tokenizer, 0)
    five = generate("mine", {**spec, "samples": 5}, tokenizer, 0)
    assert [s.sample_id for s in five[:3]] == [s.sample_id for s in three]
    assert len({s.sample_id for s in five}) == 5
    other = generate("mine", {**spec, "seed": 1}, tokenizer, 0)
    assert [s.sample_id for s in other] != [s.sample_id for s in three]
    s = three[0]
    assert s.kind == "dataset" and s.metric == "qa_f1" and s.shape == "workload mine" and s.depth is None
    assert s.row()["cut_tokens"] == 0 and s.row()["prompt_tokens"] == s.prompt.tokens
    named = generate("mine", {**spec, "shape": "support tickets"}, tokenizer, 0)[0]
    assert named.shape == "support tickets"


def test_a_long_prompt_loses_the_middle_of_its_context_only(tmp_path, tiny):
    """Cut to N tokens: the context's head and tail stay, its middle goes, the question and template stay whole, and
    the row says how many tokens were cut."""
    tokenizer = tiny[1]
    row = {"id": "long", "context": "HEADMARK " + " ".join(f"w{i}" for i in range(600)) + " TAILMARK",
           "question": "Which marks open and close the text?", "answers": "HEADMARK TAILMARK"}
    spec = {**SPEC, "path": str(write(tmp_path / "long.jsonl", [row], "jsonl")), "samples": 1,
            "template": "Read this.\n{context}\nNow answer: {question} Be brief."}
    natural = generate("long", spec, tokenizer, 0)[0]
    cut = generate("long", spec, tokenizer, 512)[0]
    assert natural.prompt.tokens > 512 >= cut.prompt.tokens > 500
    assert cut.meta["cut_tokens"] == natural.prompt.tokens - cut.prompt.tokens
    text = tokenizer.decode(cut.prompt.context + cut.prompt.question)
    assert "Read this.\nHEADMARK w0 w1" in text and "w599 TAILMARK\nNow answer: Which marks open and close the text? Be brief." in text
    assert " w300 " not in text  # the middle
    assert cut.prompt.question == natural.prompt.question and cut.prompt.suffix == natural.prompt.suffix


def test_followups_are_asked_on_the_same_cache(tmp_path, tiny):
    spec = {**SPEC, "path": str(write(tmp_path / "rows.jsonl", ROWS[:1], "jsonl")), "samples": 1}
    s = generate("mine", spec, tiny[1], 0)[0]
    assert len(s.prompt.followups) == 1 and s.prompt.followups[0].gold == ["1003"]
    assert "And of vault 3?" in tiny[1].decode(s.prompt.followups[0].ids)


BAD = [
    ("rows.txt", "x", "unknown file type '.txt'; use .jsonl"),
    ("rows.jsonl", '{"context": "c", "question": "q", "answers": "a"}\n{oops\n', "rows.jsonl line 2: not JSON"),
    ("rows.jsonl", json.dumps({"context": "c", "answers": "a"}) + "\n", "rows.jsonl row 1: no column 'question' (field question)"),
    ("rows.jsonl", json.dumps({"context": "c", "question": "q", "answers": "a"}) + "\n" + json.dumps({"context": "c", "question": "q", "answers": ""}),
     "rows.jsonl row 2: field answers must be a non-empty string or a list of them"),
    ("rows.jsonl", json.dumps({"context": " ", "question": "q", "answers": "a"}), "rows.jsonl row 1: field context (column 'context') is empty"),
    ("rows.jsonl", "\n".join(json.dumps({"id": 7, "context": "c", "question": "q", "answers": "a"}) for _ in range(2)),
     "rows.jsonl row 2: id '7' repeats row 1; ids must be unique"),
    ("rows.json", "[1, 2]", "rows.json row 1: not an object"),
    ("rows.csv", "context,answers\nc,a\n", "rows.csv row 1: no column 'question' (field question)"),
    # (a file without answers is prompts-only, scored by agreement; a reference metric on it: tests/test_traffic.py)
    ("rows.jsonl", json.dumps({"context": "c", "question": "q", "answers": "a", "followups": [{"question": "q2"}]}),
     "rows.jsonl row 1: followups[1] must be an object with question and answers"),
]


@pytest.mark.parametrize("name,text,message", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_files_get_one_line_naming_file_row_and_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(dataset.DatasetError) as info:
        dataset.load(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_a_folder_of_splits(tmp_path):
    with pytest.raises(dataset.DatasetError, match=r"nope.jsonl: no such file or folder; give `path` relative to the working directory"):
        dataset.load(tmp_path / "nope.jsonl")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:4])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(dataset.DatasetError, match=r"a DatasetDict with splits train, test; point path at one split's folder"):
        dataset.load(tmp_path / "dd")


def test_templates_are_checked():
    assert dataset.check_template("{context}\n{question}") is None
    assert "once each" in dataset.check_template("{context} only")
    assert "puts {question} before {context}" in dataset.check_template("{question} then {context}")


def test_a_prompt_beyond_the_model_s_context_is_refused_before_any_work(tmp_path, tiny):
    spec = {**SPEC, "path": str(write(tmp_path / "rows.jsonl", ROWS, "jsonl")), "samples": 2}
    samples = generate("mine", spec, tiny[1], 0)
    limit = samples[0].prompt.tokens + 10
    with pytest.raises(ValueError, match=rf"^task 'mine': sample {samples[0].sample_id} \(.*rows.jsonl row \d, field context\) has "
                                         rf"{samples[0].prompt.tokens} prompt tokens \+ 16 to generate, beyond the model's context of {limit}; "
                                         rf"set context_tokens \(at most {limit - 16}\)"):
        check_lengths("mine", samples, 16, limit)


def test_a_job_scores_the_rows_with_their_metric(tmp_path, tiny_dir):
    """The tiny model's answers are scored by qa_f1 against each row's answers; rows carry the workload's shape and
    natural lengths."""
    spec = {**SPEC, "path": str(write(tmp_path / "rows.jsonl", ROWS, "jsonl")), "samples": 2, "shape": "vault codes"}
    run = {"methods": build({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}}}),
           "budgets": [0.5], "question_modes": ["agnostic", "aware"], "max_new_tokens": 4, "noise_floor_samples": 0,
           "dtype": "float32", "device": "cpu", "threads": 1}
    rows = run_job(tiny_dir, "vaults", spec, 0, run, tmp_path / "out.parquet")
    assert set(rows["metric"]) == {"qa_f1"} and set(rows["shape"]) == {"vault codes"} and set(rows["task_kind"]) == {"dataset"}
    assert rows["score"].between(0, 1).all() and (rows["context_tokens"] == 0).all()
    assert (rows["prompt_tokens"] > 100).all() and (rows["cut_tokens"] == 0).all()
    assert set(rows["method"]) == {"full", "snapkv"} and rows["sample_id"].nunique() == 2
