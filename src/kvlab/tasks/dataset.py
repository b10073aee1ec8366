"""Your own workload: a task whose samples are the rows of a file (`kind: dataset`).

A row gives a `context` (the document: always compressed), a `question` (compressed only question-aware), its
`answers` (one string or a list; the scorer takes the best match), an optional `id` and optional `followups`
(later questions on the same cache, each {question, answers}, asked as multi_turn asks them). `columns` maps these
names to the file's own. Files: JSON lines (.jsonl, or .json holding lines or one array), .csv (a list-valued
cell as a JSON array), .parquet, or a folder written by `datasets`' save_to_disk (read offline).

Prompts: the user turn is `template` with {context} and {question} filled (default: the context, a blank line, the
question), in the model's chat template. Only the document is compressed, as kvpress compresses only its context: the
template's text before {context} (with the chat template's head before it) is the prompt's uncompressed `prefix`, no
method evicts it and budgets count the tokens after it; its text after {context} goes with the question (compressed
only question-aware). `context_tokens` 0 keeps each prompt at its natural length (`prompt_tokens`
on each row); N > 0 cuts a longer prompt to N tokens by dropping the middle of its context, keeping its head and
tail as LongBench truncates its prompts, but never the question or template (rows carry `cut_tokens`).

Samples: a seeded permutation of the rows (by task name and seed), taken in order, so more samples (the
evaluation's rounds) only add rows after those drawn. Every row is checked before any is used: a file that does not
parse, a missing column, an empty context, question or answer, a repeated id each stop with one line naming the
file, the row (1-based) and the field.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from kvlab.tasks.base import Prompt, Sample, chat_pieces, chat_prompt, encode

FIELDS = ("context", "question", "answers", "id", "followups")
REQUIRED = ("context", "question", "answers")
FORMATS = ".jsonl, .json (JSON lines or an array), .csv, .parquet, or a folder written by datasets' save_to_disk"
DEFAULT_TEMPLATE = "{context}\n\n{question}"


@dataclass(frozen=True)
class Record:
    row: int  # 1-based, in file order
    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    followups: tuple[tuple[str, tuple[str, ...]], ...]  # (question, answers) of each later turn


class DatasetError(ValueError):
    """A problem of the user's file, in one line."""


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    records = load(spec["path"], spec.get("columns", {}))
    order = list(range(len(records)))
    random.Random(f"{name}:{spec['seed']}").shuffle(order)
    template = spec.get("template", DEFAULT_TEMPLATE)
    return [make_sample(name, spec, tokenizer, context_tokens, template, records[i]) for i in order[: spec["samples"]]]


def derive(name: str, spec: dict) -> None:
    """A task whose file a recipe writes reads it where the pipeline writes it (rule workload)."""
    if "recipe" in spec:
        spec["path"] = f"results/workloads/{name}.jsonl"


def problem(name: str, spec: dict):
    """The template, and the file: every row readable and complete, at least `samples` of them (a file a recipe writes
    is checked when it is read)."""
    if why := check_template(spec["template"]):
        return "template", why
    if "recipe" in spec:
        rows, source = spec["recipe_rows"], f"recipe_rows {spec['recipe_rows']}"
    else:
        try:
            rows, source = len(load(spec["path"], spec["columns"])), f"the rows of {spec['path']}"
        except DatasetError as error:
            return "path", str(error)
    if spec["samples"] > rows:
        return "samples", f"{spec['samples']} exceeds {source} ({rows}); draw at most {rows}"
    return None


def shape(name: str, spec: dict) -> str:
    """The report's row for this workload: its `shape`, else 'workload <name>'."""
    return spec.get("shape") or f"workload {name}"


def check_template(template: str) -> str | None:
    """What is wrong with an instruction template (None if nothing): one {context}, then one {question}."""
    if template.count("{context}") != 1 or template.count("{question}") != 1:
        return "needs {context} and {question} once each"
    if template.index("{context}") > template.index("{question}"):
        return "puts {question} before {context}; the question must follow the document (only the document is cut and always compressed)"
    return None


def make_sample(name: str, spec: dict, tokenizer, context_tokens: int, template: str, record: Record) -> Sample:
    head, tail = template.split("{question}")
    before_context, after_context = head.split("{context}")
    turns, previous = [], record.answers
    for question, answers in record.followups:
        turns.append((previous[0], question, list(answers)))
        previous = answers

    def build(context: str):
        prompt = chat_prompt(tokenizer, before_context + context, after_context + record.question + tail, turns)
        return replace(prompt, prefix=kept_prefix(tokenizer, prompt, before_context, after_context + record.question + tail))

    prompt, cut = build(record.context), 0
    if context_tokens and prompt.tokens > context_tokens:
        natural, ids = prompt.tokens, encode(tokenizer, record.context)
        keep = len(ids) - (prompt.tokens - context_tokens)
        for _ in range(8):  # re-encoding the joined text can move a token boundary: trim until it fits
            if keep < 2:
                raise DatasetError(f"task '{name}': {spec['path']} row {record.row}: the template and question alone take "
                                   f"{natural - len(ids)} of context_tokens {context_tokens}; use a longer context_tokens")
            text = tokenizer.decode(ids[: keep - keep // 2]) + tokenizer.decode(ids[len(ids) - keep // 2 :])
            prompt = build(text)
            if prompt.tokens <= context_tokens:
                break
            keep -= prompt.tokens - context_tokens
        cut = natural - prompt.tokens
    return Sample(
        task=name,
        kind="dataset",
        sample_id=f"{name}-{context_tokens}-{record.id}",
        context_tokens=context_tokens,
        depth=None,
        seed=spec["seed"],
        prompt=prompt,
        gold=list(record.answers),
        metric=spec["metric"],
        meta={"shape": shape(name, spec), "row": record.row, "path": str(spec["path"]), "cut_tokens": cut},
    )


def kept_prefix(tokenizer, prompt: Prompt, before_context: str, question: str) -> int:
    """The context tokens before the document: the chat template's head and the template's text before {context},
    as they tokenize alone; where the text's last token would merge with the document's first, up to that token."""
    ids = encode(tokenizer, chat_pieces(tokenizer, before_context, question)[0])
    return next((i for i, (a, b) in enumerate(zip(prompt.context, ids)) if a != b), min(len(prompt.context), len(ids)))


def load(path: str | Path, columns: dict | None = None) -> list[Record]:
    """Every row of the file as a Record, checked (one line on the first problem). Read once per file version."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder; give `path` relative to the working directory or absolute")
    stamp = max(p.stat().st_mtime_ns for p in [path, *path.rglob("*")]) if path.is_dir() else path.stat().st_mtime_ns
    return list(_load(str(path), tuple(sorted((columns or {}).items())), stamp))


@lru_cache(maxsize=8)
def _load(path: str, columns: tuple, stamp: int) -> tuple[Record, ...]:
    mapping = {field: dict(columns).get(field, field) for field in FIELDS}
    rows = _read(Path(path))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    missing = [f for f in REQUIRED if mapping[f] not in rows[0]]
    if missing:
        raise DatasetError(f"{path} row 1: no column '{mapping[missing[0]]}' (field {missing[0]}); columns: "
                           f"{', '.join(map(str, rows[0]))}; map it with columns: {{{missing[0]}: <your column>}}")
    records, seen = [], {}
    for n, row in enumerate(rows, start=1):
        record = _record(path, n, row, mapping)
        if record.id in seen:
            raise DatasetError(f"{path} row {n}: id {record.id!r} repeats row {seen[record.id]}; ids must be unique")
        seen[record.id] = n
        records.append(record)
    return tuple(records)


def _read(path: Path) -> list[dict]:
    """The file's rows as dicts, by its type."""
    try:
        if path.is_dir():
            import datasets

            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                raise DatasetError(f"{path}: a DatasetDict with splits {', '.join(data)}; point path at one split's folder")
            return data.to_list()
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            text = path.read_text(encoding="utf-8")
            if suffix == ".json" and text.lstrip().startswith("["):
                rows = json.loads(text)
            else:
                rows = []
                for n, line in enumerate(text.splitlines(), start=1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as error:
                            raise DatasetError(f"{path} line {n}: not JSON ({error.msg}); each line must hold one object") from None
            bad = next((i for i, r in enumerate(rows, start=1) if not isinstance(r, dict)), None)
            if bad:
                raise DatasetError(f"{path} row {bad}: not an object; each row must map field names to values")
            return rows
        if suffix == ".csv":
            import pandas as pd

            return pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
        if suffix == ".parquet":
            import pandas as pd

            return pd.read_parquet(path).to_dict("records")
    except DatasetError:
        raise
    except Exception as error:  # the reader's own words, on one line
        raise DatasetError(f"{path}: cannot be read as {path.suffix or 'a datasets folder'}: {' '.join(str(error).split())}") from None
    raise DatasetError(f"{path}: unknown file type {path.suffix!r}; use {FORMATS}")


def _strings(value, path: str, n: int, field: str) -> tuple[str, ...]:
    """One string or a list of them (a JSON array in a CSV cell; an array from Parquet), none empty."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if hasattr(value, "tolist"):
        value = value.tolist()
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not items or any(not isinstance(v, str) or not v.strip() for v in items):
        raise DatasetError(f"{path} row {n}: field {field} must be a non-empty string or a list of them, got {value!r:.80}")
    return tuple(items)


def _text(row: dict, column: str, path: str, n: int, field: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{path} row {n}: field {field} (column '{column}') is empty or not text; every row needs one")
    return value


def _record(path: str, n: int, row: dict, mapping: dict) -> Record:
    for field in REQUIRED:
        if mapping[field] not in row:
            raise DatasetError(f"{path} row {n}: no column '{mapping[field]}' (field {field})")
    followups = row.get(mapping["followups"])
    if isinstance(followups, str):
        try:
            followups = json.loads(followups) if followups.strip() else []
        except json.JSONDecodeError:
            raise DatasetError(f"{path} row {n}: field followups is not a JSON list of {{question, answers}}") from None
    if hasattr(followups, "tolist"):
        followups = followups.tolist()
    turns = []
    for i, turn in enumerate(followups or [], start=1):
        if not isinstance(turn, dict) or "question" not in turn or "answers" not in turn:
            raise DatasetError(f"{path} row {n}: followups[{i}] must be an object with question and answers")
        turns.append((_text(turn, "question", path, n, f"followups[{i}].question"),
                      _strings(turn["answers"], path, n, f"followups[{i}].answers")))
    raw_id = row.get(mapping["id"])
    return Record(
        row=n,
        id=str(raw_id) if raw_id not in (None, "") else str(n),
        context=_text(row, mapping["context"], path, n, "context"),
        question=_text(row, mapping["question"], path, n, "question"),
        answers=_strings(row[mapping["answers"]], path, n, "answers"),
        followups=tuple(turns),
    )
