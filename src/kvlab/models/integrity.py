"""Weight integrity: every job that loads a model first checks its weight files against the sha256 digests
``card.json`` recorded when the model was acquired (``weights``: file name -> sha256), so a damaged file is
refused before it can give wrong numbers with exit status 0.

Hashing runs at disk speed (about 1–2 s for Qwen2.5-0.5B's 2 GB of float32 safetensors), once per job: the
result is remembered per process for a file of unchanged size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from kvlab.models.card import read_card

log = logging.getLogger(__name__)

WEIGHT_GLOB = "*.safetensors"
_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, hashed in this process


class ModelIntegrityError(ValueError):
    """A model file does not match its card, described in one line."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def weight_digests(model_dir: str | Path) -> dict[str, str]:
    """sha256 of every weight file of an acquired (or staging) model folder: what the card records."""
    return {p.name: file_sha256(p) for p in sorted(Path(model_dir).glob(WEIGHT_GLOB))}


def check_safetensors(path: str | Path) -> None:
    """Refuse, naming the file, a safetensors file whose header does not parse or whose size is not what the
    header describes (a truncated or padded copy): read from its first bytes, without loading a tensor."""
    path = Path(path)
    size = path.stat().st_size
    problem = None
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= size - 8:
            problem = f"header length {n} does not fit the file's {size} bytes"
        else:
            try:
                header = json.loads(f.read(n))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                problem = f"unreadable header ({' '.join(str(exc).split())})"
            else:
                if 8 + n + end != size:
                    problem = f"{size} bytes, its header describes {8 + n + end} (truncated or damaged)"
    if problem:
        raise ModelIntegrityError(f"{path}: not a valid safetensors file: {problem}; {_fix(path.parent)}")


def _fix(model_dir: Path) -> str:
    return (f"re-acquire it: `snakemake --forcerun acquire_model` (or delete {model_dir} and rerun), "
            "which rebuilds it from its source")


def expected_digests(card: dict) -> dict[str, str] | None:
    """The digests the card holds: ``weights``; a tiny model's card from before that field holds its one file's
    sha256 as ``sha256``. None when the card has neither (the GGUF and hub cards' ``sha256`` is of the source)."""
    if card.get("weights"):
        return dict(card["weights"])
    if card.get("source", {}).get("kind") == "tiny" and card.get("sha256"):
        return {"model.safetensors": card["sha256"]}
    return None


JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_json_files(model_dir: Path) -> None:
    """Refuse, naming the file, a model folder's JSON file (config, tokenizer) that does not parse: a truncated copy
    would otherwise fail inside transformers with an error that names no fix."""
    for name in JSON_FILES:
        path = model_dir / name
        if not path.is_file():
            if name == "config.json":
                raise ModelIntegrityError(f"{path}: missing; {_fix(model_dir)}")
            continue
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelIntegrityError(f"{path}: not valid JSON ({' '.join(str(exc).split())}: truncated or damaged); "
                                      f"{_fix(model_dir)}") from None


def verify_weights(model_dir: str | Path) -> None:
    """Refuse (one line: the file and the fix) a model folder whose JSON files do not parse, or whose weight files
    are missing, extra or differ from the card."""
    model_dir = Path(model_dir)
    card = read_card(model_dir)
    check_json_files(model_dir)
    expected = expected_digests(card)
    if expected is None:
        for path in sorted(model_dir.glob(WEIGHT_GLOB)):
            check_safetensors(path)
        log.warning("%s: card.json records no weight digests (acquired by an older kvlab): weights not verified; "
                    "%s", model_dir, _fix(model_dir))
        return
    present = {p.name for p in model_dir.glob(WEIGHT_GLOB)}
    for name in sorted(present):
        check_safetensors(model_dir / name)
    for extra in sorted(present - set(expected)):
        raise ModelIntegrityError(f"{model_dir / extra}: weight file not listed in card.json; {_fix(model_dir)}")
    for name, want in sorted(expected.items()):
        path = model_dir / name
        if not path.is_file():
            raise ModelIntegrityError(f"{path}: weight file listed in card.json is missing; {_fix(model_dir)}")
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        got = _verified.get(key) or file_sha256(path)
        if got != want:
            raise ModelIntegrityError(
                f"{path}: sha256 {got[:16]}… differs from card.json's {want[:16]}… (the file is damaged); {_fix(model_dir)}"
            )
        _verified[key] = got
