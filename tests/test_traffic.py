"""Your traffic without references (issue 54, parts 1 and 2): prompts-only rows scored by agreement with the full
cache's answer, and chat-format rows (messages) rendered by the model's chat template, asked on their last user turn
or turn by turn on one cache, with one-line errors for bad rows before any job."""

import json

import pytest

from kvlab.steps.evaluate import run_job
from kvlab.methods import build
from kvlab.tasks import dataset, generate
from kvlab.tasks.scoring import AGREEMENT, agreement, agreement_f1, clean, normalize, score

DOCS = [f"Document {i}. The code of vault {i} is {1000 + i}. " + "Filler words go here. " * 20 for i in range(6)]
PLAIN = [{"id": f"p{i}", "context": d, "question": f"What is the code of vault {i}?"} for i, d in enumerate(DOCS)]
CHAT = [
    {"id": "c0", "messages": [{"role": "system", "content": "Answer from this manual. " + DOCS[0]},
                              {"role": "user", "content": "What is the code of vault 0?"},
                              {"role": "assistant", "content": "1000"},
                              {"role": "user", "content": "And its document number?"}]},
    {"id": "c1", "messages": [{"role": "user", "content": DOCS[1] + "\n\nWhat is the code of vault 1?"}]},
    {"id": "c2", "messages": [{"role": "user", "content": DOCS[2]}, {"role": "assistant", "content": "Read."},
                              {"role": "user", "content": "The code of vault 2?"}]},
]
SPEC = {"kind": "dataset", "columns": {}, "template": dataset.DEFAULT_TEMPLATE, "context_tokens": [0], "samples": 2,
        "seed": 0, "chat_turns": "last"}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def spec_for(path, **extra):
    """A task entry as config validation leaves it: its metric derived from the rows where not given."""
    spec = {**SPEC, "path": path, **extra}
    dataset.derive("mine", spec)
    return spec


def test_agreement_scores_the_answer_against_the_full_cache_s():
    assert agreement("The Vault, 1000.", ["vault 1000"]) == 1.0 and agreement("1001", ["1000"]) == 0.0
    assert agreement("", [""]) == 1.0 and agreement_f1("", [""]) == 1.0
    assert agreement_f1("code 1000 here", ["code 1000"]) == pytest.approx(0.8) and agreement_f1("x", ["y"]) == 0.0
    assert score("agreement", "a b", ["a b"]) == 1.0 and set(AGREEMENT) == {"agreement", "agreement_f1"}
    with pytest.raises(ValueError, match="exactly the full cache's answer"):
        agreement("a", [])


def test_prompts_only_rows_load_and_default_to_agreement(tmp_path):
    path = jsonl(tmp_path / "rows.jsonl", PLAIN)
    assert all(r.answers == () for r in dataset.load(path))
    spec = spec_for(path)
    assert spec["metric"] == "agreement" and dataset.problem("mine", spec) is None
    with_answers = jsonl(tmp_path / "answers.jsonl", [{**r, "answers": "1000"} for r in PLAIN])
    assert spec_for(with_answers)["metric"] == "qa_f1"  # the default stays qa_f1 where every row has answers
    assert dataset.problem("mine", spec_for(with_answers, metric="agreement")) is None  # and may ask for agreement
    assert spec_for("missing.jsonl")["metric"] == "qa_f1"  # the file's own problem is problem()'s to say
    assert {"qa_mix": "qa_f1", "chat_mix": "agreement"} == {
        r: (s := {**SPEC, "recipe": r, "recipe_rows": 4}, dataset.derive("t", s), s["metric"])[2] for r in ("qa_mix", "chat_mix")}


def test_a_reference_metric_on_rows_without_answers_is_one_line(tmp_path):
    path = jsonl(tmp_path / "rows.jsonl", [{**PLAIN[0], "answers": "1000"}, PLAIN[1]])
    key, message = dataset.problem("mine", spec_for(path, metric="qa_f1"))
    assert key == "metric" and message.startswith(f"{path} row 2: no answers (field answers), which metric qa_f1 scores")
    assert "use metric: agreement" in message and "\n" not in message
    csv = tmp_path / "rows.csv"
    csv.write_text("context,question\nc,q\n")
    assert dataset.problem("mine", spec_for(str(csv), samples=1)) is None  # a CSV without an answers column: agreement
    assert dataset.problem("mine", spec_for(str(csv), metric="exact_match"))[1].startswith(f"{csv} row 1: no answers (field answers)")


def test_prompts_only_rows_run_through_a_job_and_score_their_agreement(tmp_path, tiny_dir):
    """The full cache's rows score 1 by definition; a method that keeps every entry (SnapKV at budget 1.0) never
    changes an answer and scores 1 too; each row's gold is the full cache's answer, and its KL is measured along it."""
    spec = spec_for(jsonl(tmp_path / "rows.jsonl", PLAIN), samples=3)
    run = {"methods": build({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}}}),
           "budgets": [1.0, 0.25], "question_modes": ["agnostic", "aware"], "max_new_tokens": 6, "noise_floor_samples": 3,
           "dtype": "float32", "device": "cpu", "threads": 1}
    rows = run_job(tiny_dir, "traffic", spec, 0, run, tmp_path / "out.parquet")
    assert set(rows["metric"]) == {"agreement"} and rows["sample_id"].nunique() == 3
    full = rows[rows["method"] == "full"]
    assert (full["score"] == 1.0).all() and (full["gold"].map(list) == full["prediction"].map(lambda p: [p])).all()
    kept = rows[(rows["method"] == "snapkv") & (rows["budget"] == 1.0)]
    assert len(kept) == 6 and (kept["score"] == 1.0).all() and kept["diverged_at"].isna().all()
    assert kept["kl_vs_full"].notna().all() and full["noise_kl"].notna().all()  # KL along the full answer; the noise floor
    compressed = rows[rows["budget"] == 0.25].merge(full[["sample_id", "question_mode", "prediction"]], on=["sample_id", "question_mode"],
                                                    suffixes=("", "_full"))
    same = compressed["prediction"].map(normalized) == compressed["prediction_full"].map(normalized)
    assert len(compressed) == 6 and (compressed["score"] == same).all()


def normalized(text):
    return tuple(normalize(clean(text)))


def test_chat_rows_render_with_the_chat_template_and_split_context_from_question(tmp_path, tiny):
    tokenizer = tiny[1]
    path = jsonl(tmp_path / "chat.jsonl", CHAT)
    records = {r.id: r for r in dataset.load(path)}
    assert records["c0"].messages[0] == ("system", "Answer from this manual. " + DOCS[0]) and records["c0"].answers == ()
    spec = spec_for(path, samples=3)
    assert spec["metric"] == "agreement" and dataset.problem("mine", spec) is None
    samples = {s.sample_id.rsplit("-", 1)[1]: s for s in generate("mine", spec, tokenizer, 0)}
    p = samples["c0"].prompt
    context, question, suffix = (tokenizer.decode(x) for x in (p.context, p.question, p.suffix))
    assert context == ("<|im_start|>system\nAnswer from this manual. " + DOCS[0] + "<|im_end|>\n<|im_start|>user\nWhat is the "
                       "code of vault 0?<|im_end|>\n<|im_start|>assistant\n1000<|im_end|>\n<|im_start|>user\n")
    assert question == "And its document number?" and suffix == "<|im_end|>\n<|im_start|>assistant\n" and not p.followups
    assert context + question + suffix == tokenizer.apply_chat_template(CHAT[0]["messages"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(p.context[: p.prefix]) == "<|im_start|>system\n" and p.head == p.prefix  # the template's head, kept
    one = samples["c1"].prompt  # a conversation that opens on its question: that turn is the context, no question
    assert not one.question and tokenizer.decode(one.context).endswith("What is the code of vault 1?")
    assert tokenizer.decode(one.context[: one.prefix]) == "<|im_start|>user\n"
    assert samples["c2"].prompt.question and tokenizer.decode(samples["c2"].prompt.question) == "The code of vault 2?"


def test_chat_turns_each_asks_every_user_turn_on_one_cache(tmp_path, tiny):
    tokenizer = tiny[1]
    rows = [{**CHAT[0], "answers": "no number"}]
    path = jsonl(tmp_path / "chat.jsonl", rows)
    s = generate("mine", spec_for(path, samples=1, chat_turns="each", metric="agreement"), tokenizer, 0)[0]
    p = s.prompt
    assert tokenizer.decode(p.context) == "<|im_start|>system\nAnswer from this manual. " + DOCS[0] + "<|im_end|>\n<|im_start|>user\n"
    assert tokenizer.decode(p.question) == "What is the code of vault 0?" and len(p.followups) == 1
    assert tokenizer.decode(p.followups[0].ids) == ("1000<|im_end|>\n<|im_start|>user\nAnd its document number?<|im_end|>\n"
                                                    "<|im_start|>assistant\n")  # the logged reply, then the next question
    whole = tokenizer.decode(p.context + p.question + p.suffix + p.followups[0].ids)
    assert whole == tokenizer.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=False)
    assert p.followups[0].gold == ["no number"]  # the row's answers belong to its last user turn
    key, message = dataset.problem("mine", spec_for(path, samples=1, chat_turns="each", metric="qa_f1"))
    assert key == "metric" and "chat_turns: each asks 2 user turns" in message
    assert dataset.problem("mine", spec_for(path, samples=1, chat_turns="last", metric="qa_f1")) is None
    gap = jsonl(tmp_path / "gap.jsonl", [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}])
    key, message = dataset.problem("mine", spec_for(gap, samples=1, chat_turns="each"))
    assert key == "chat_turns" and message.startswith(f"{gap} row 1: field messages: two user turns with no assistant reply")
    key, message = dataset.problem("mine", spec_for(path, samples=1, context_tokens=[0, 512]))
    assert key == "context_tokens" and "a conversation is kept whole" in message


def test_chat_rows_run_through_a_job(tmp_path, tiny_dir):
    spec = spec_for(jsonl(tmp_path / "chat.jsonl", CHAT), samples=3, chat_turns="each")
    run = {"methods": build({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 8}}}),
           "budgets": [0.5], "question_modes": ["agnostic", "aware", "multi_turn"], "max_new_tokens": 4, "noise_floor_samples": 0,
           "dtype": "float32", "device": "cpu", "threads": 1}
    rows = run_job(tiny_dir, "chat", spec, 0, run, tmp_path / "out.parquet")
    assert (rows.loc[rows["method"] == "full", "score"] == 1.0).all() and rows["score"].between(0, 1).all()
    assert rows.loc[rows["sample_id"].str.endswith("c0"), "turn"].max() == 2  # c0 asked turn by turn


BAD = [
    ({"messages": "nope"}, "row 1: field messages is not a JSON list of {role, content}"),
    ({"messages": {"role": "user"}}, "row 1: field messages must be a list of {role, content}"),
    ({"messages": [{"role": "user"}]}, "row 1: messages[1] must be an object with role and content"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}]},
     "row 1: messages[1].role 'tool' is not one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "row 1: messages[1].content must be non-empty text"),
    ({"messages": [{"role": "system", "content": "s"}]}, "row 1: field messages has no user turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "row 1: messages[2] (role assistant) ends the conversation; the last turn must be the user's question"),
    ({"messages": [{"role": "user", "content": "q"}], "context": "c"}, "row 1: field messages, and context, question or followups too"),
    ({"context": "c", "question": "q", "followups": [{"question": "q2", "answers": "a"}]},
     "row 1: field followups needs the row's answers"),
]


@pytest.mark.parametrize("row,message", BAD, ids=[b[1][7:47] for b in BAD])
def test_bad_chat_rows_get_one_line_naming_file_row_and_field(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(dataset.DatasetError) as info:
        dataset.load(path)
    assert str(info.value).startswith(f"{path} {message}") and "\n" not in str(info.value)


def agreement_tables(changed: dict, noise_changed: int, n: int = 80, noise_n: int = 80) -> dict:
    """The report's queries for one agreement task: per method, `changed[method]` of `n` prompts changed (score 0)
    and the rest kept (score 1; the full cache scores 1 on each), and `noise_changed` of the full cache's `noise_n`
    answers changed by batch noise."""
    import pandas as pd

    base = {"model": "m", "shape": "workload traffic", "task": "traffic", "task_kind": "dataset", "context_tokens": 0,
            "question_mode": "agnostic", "method_kind": "kvpress", "press": "SnapKVPress", "wrapper": None, "scheme": None,
            "budget": 0.5, "turn": 1, "full_score": 1.0, "kl_vs_full": None, "kv_fraction_bf16": 0.5, "max_samples": n}
    answers = pd.DataFrame([{**base, "method": method, "sample_id": f"s{i}", "draw": i + 1, "round": 0, "score": float(i >= k)}
                            for method, k in changed.items() for i in range(n)])
    agreement_rows = answers.assign(metric="agreement", kl_vs_full=[0.01 * (1 - s) for s in answers["score"]])
    noise = pd.DataFrame({"model": "m", "dtype": "float32", "change": "one-token steps in another batch", "task": "traffic",
                          "sample_id": [f"s{i}" for i in range(noise_n)], "turn": 1, "scored": True,
                          "changed": [i < noise_changed for i in range(noise_n)]})
    return {"answers": answers, "agreement": agreement_rows[list(agreement_rows.columns.drop(["full_score"]))], "noise_floor": noise}


def test_the_report_decides_agreement_cells_and_shows_the_noise_floor_beside_them():
    """A method that never changes an answer is decided safe within the prompts a lossless accuracy cell needs (66 at
    5 points); one that changes half is unsafe; beside each, the full cache's own change rate under batch noise and the
    KL along its answer. A noise floor above the tolerance is called out: that tolerance cannot be met."""
    from kvlab.report.decision import Rule
    from kvlab.report.sections import SECTIONS, agreement as section

    assert section in SECTIONS and "agreement" in section.QUERIES
    q = agreement_tables({"never": 0, "half": 40}, noise_changed=1)
    c = section.agreement_cells(q, Rule()).set_index("method")
    assert c.loc["never", "decision"] == "safe" and c.loc["never", "changed_points"] == 0 and c.loc["never", "kl_mean_nats"] == 0
    assert c.loc["half", "decision"] == "unsafe" and c.loc["half", "changed_low"] > 5
    assert (c["noise_changed"] == "1/80").all() and (c["noise_high_points"] < 10).all()
    text = section.body(q, Rule())
    assert "<td>1/80</td>" in text and "cannot be met" in text and "more often than the tolerance" not in text
    safe_at = section.agreement_cells(agreement_tables({"never": 0}, noise_changed=0, n=66), Rule())
    assert safe_at["decision"].tolist() == ["safe"]
    noisy = section.body(agreement_tables({"never": 0}, noise_changed=20), Rule())
    assert "the full cache's own answers change under batch noise more often than the tolerance (5 points)" in noisy
    import pandas as pd

    empty = {"agreement": pd.DataFrame(columns=["model", "task"]), "answers": pd.DataFrame(), "noise_floor": pd.DataFrame()}
    assert "No task of this run was scored by agreement" in section.body(empty, Rule())


def test_the_chat_recipe_s_settings_are_checked_before_any_job():
    recipe = {**SPEC, "recipe": "chat_mix", "recipe_rows": 4, "recipe_words": [700, 1400], "samples": 2}
    assert dataset.problem("t", spec_for("unused", **recipe)) is None
    assert dataset.problem("t", spec_for("unused", **{**recipe, "recipe_words": [300, 300]})) == (
        "recipe_words", "[300, 300] is no range: give [low, high] with low < high, e.g. [700, 1400]")
    assert dataset.problem("t", spec_for("unused", **recipe, metric="qa_f1"))[0] == "metric"
    assert dataset.problem("t", spec_for("unused", **{**recipe, "context_tokens": [512]}))[0] == "context_tokens"


def test_a_conversation_beyond_the_model_s_context_names_its_field(tmp_path, tiny):
    from kvlab.steps.evaluate import check_lengths

    s = generate("mine", spec_for(jsonl(tmp_path / "chat.jsonl", CHAT), samples=1), tiny[1], 0)[0]
    with pytest.raises(ValueError, match=r"row \d, field messages\) has \d+ prompt tokens .*; a conversation is kept whole: "
                                         "shorten it or leave the row out$"):
        check_lengths("mine", [s], 4, s.prompt.tokens)
