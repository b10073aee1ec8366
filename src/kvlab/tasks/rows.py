"""The rows of a `kind: dataset` file, read and checked (kvlab.tasks.dataset): each a `Record`, or one line naming the
file, the row (1-based) and the field of its first problem."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

FIELDS = ("context", "question", "answers", "id", "followups", "messages")
REQUIRED = ("context", "question")  # of a row without messages
ROLES = ("system", "user", "assistant")
FORMATS = ".jsonl, .json (JSON lines or an array), .csv, .parquet, or a folder written by datasets' save_to_disk"


@dataclass(frozen=True)
class Record:
    row: int  # 1-based, in file order
    id: str
    context: str  # "" on a chat row
    question: str  # "" on a chat row
    answers: tuple[str, ...]  # () when the row has none (prompts only)
    followups: tuple[tuple[str, tuple[str, ...]], ...]  # (question, answers) of each later turn
    messages: tuple[tuple[str, str], ...] = ()  # a chat row's (role, content) turns, ending on the user's

    def asked(self, each: bool) -> int:
        """The user turns a chat row asks (`chat_turns: each`: all of them, else the last)."""
        return sum(role == "user" for role, _ in self.messages) if each else 1


class DatasetError(ValueError):
    """A problem of the user's file, in one line."""


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
    missing = [] if mapping["messages"] in rows[0] else [f for f in REQUIRED if mapping[f] not in rows[0]]
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


def _present(value) -> bool:
    """Whether a cell holds a value (not missing: None, NaN, an empty string or list)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if hasattr(value, "tolist"):
        value = value.tolist()
    return not isinstance(value, (list, tuple)) or bool(value)


def _messages(value, path: str, n: int) -> tuple[tuple[str, str], ...]:
    """A chat row's turns, checked: a list of {role, content}, roles system / user / assistant, content text, the
    last turn the user's."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DatasetError(f"{path} row {n}: field messages is not a JSON list of {{role, content}}") from None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise DatasetError(f"{path} row {n}: field messages must be a list of {{role, content}}, got {value!r:.80}")
    turns = []
    for i, turn in enumerate(value, start=1):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DatasetError(f"{path} row {n}: messages[{i}] must be an object with role and content")
        if turn["role"] not in ROLES:
            raise DatasetError(f"{path} row {n}: messages[{i}].role {turn['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(turn["content"], str) or not turn["content"].strip():
            raise DatasetError(f"{path} row {n}: messages[{i}].content must be non-empty text, got {turn['content']!r:.80}")
        turns.append((turn["role"], turn["content"]))
    if not any(role == "user" for role, _ in turns):
        raise DatasetError(f"{path} row {n}: field messages has no user turn; its last user turn is the question")
    if turns[-1][0] != "user":
        raise DatasetError(f"{path} row {n}: messages[{len(turns)}] (role {turns[-1][0]}) ends the conversation; the last "
                           "turn must be the user's question (leave out the logged reply to it)")
    return tuple(turns)


def _record(path: str, n: int, row: dict, mapping: dict) -> Record:
    raw_id = row.get(mapping["id"])
    value = row.get(mapping["answers"])  # a row without answers leaves the field out (or null); an empty one is an error
    answers = () if value is None or (isinstance(value, float) and math.isnan(value)) else _strings(value, path, n, "answers")
    row_id = str(raw_id) if raw_id not in (None, "") else str(n)
    if _present(row.get(mapping["messages"])):
        followups = row.get(mapping["followups"])
        if any(_present(row.get(mapping[f])) for f in ("context", "question")) or (
                _present(followups) and not (isinstance(followups, str) and followups.strip() == "[]")):
            raise DatasetError(f"{path} row {n}: field messages, and context, question or followups too; a row is a "
                               "conversation or a document and question, not both")
        return Record(row=n, id=row_id, context="", question="", answers=answers, followups=(),
                      messages=_messages(row[mapping["messages"]], path, n))
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
    if turns and not answers:
        raise DatasetError(f"{path} row {n}: field followups needs the row's answers (its first answer is fed before the "
                           "next question); a conversation without references goes in messages")
    return Record(
        row=n,
        id=row_id,
        context=_text(row, mapping["context"], path, n, "context"),
        question=_text(row, mapping["question"], path, n, "question"),
        answers=answers,
        followups=tuple(turns),
    )
