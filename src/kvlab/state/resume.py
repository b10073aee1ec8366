"""Checkpoints of an evaluation job, so that a rerun after an interruption (kill, crash, a cluster's time limit)
continues from its last finished chunk of samples instead of starting over.

The job (`kvlab.steps.evaluate.run_job`) evaluates its prompts chunk by chunk, and a chunk's rows depend only on its
samples and on the variants still open, which the rows before it decide; so the rows so far, the next sample
and the round's state are all a rerun needs to write the same rows as an uninterrupted run. After each chunk the
job writes that state beside its output (`<output>.partial`, a pickle written through kvlab.util.io.atomic_path, so a
kill mid-write leaves the previous checkpoint whole), and removes it once the output is written.

A checkpoint is only used by the same job: its key hashes the task and its spec, the context length, the job's
run settings (methods, budgets, dtype, threads, rounds...), the model's card (its weights' checksums) and the
code of the installed kvlab package. A checkpoint under another key is ignored (and replaced), never mixed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from functools import lru_cache
from pathlib import Path

from kvlab.util.io import atomic_path

log = logging.getLogger(__name__)

VERSION = 1  # of the checkpoint's layout


@lru_cache(maxsize=1)
def code_version() -> str:
    """SHA-256 over the installed kvlab package's source files (relative path and bytes), kernels included."""
    import kvlab
    import kvlab.kernels

    digest = hashlib.sha256()
    for root in sorted({Path(kvlab.__file__).parent, Path(kvlab.kernels.__file__).parent}):
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".sql", ".yaml", ".json") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root.parent)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def job_key(*parts) -> str:
    """The key of one job's checkpoint: its settings (JSON-able parts) and the code version."""
    text = json.dumps([VERSION, code_version(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def path_for(out_path: str | Path) -> Path:
    out = Path(out_path)
    return out.with_name(out.name + ".partial")


def load(out_path: str | Path, key: str) -> dict | None:
    """The state saved for this job, or None (no checkpoint, another job's, or one that cannot be read)."""
    path = path_for(out_path)
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except Exception as error:  # a damaged checkpoint only costs the work it held
        log.warning("checkpoint %s cannot be read (%s); starting over", path, error)
        return None
    if saved.get("key") != key:
        log.warning("checkpoint %s was written under another config or kvlab version; starting over", path)
        return None
    return saved["state"]


def save(out_path: str | Path, key: str, state: dict) -> None:
    """Write the job's state atomically (kvlab.util.io.atomic_path: a temporary file renamed over the checkpoint)."""
    with atomic_path(path_for(out_path)) as tmp, open(tmp, "wb") as f:
        pickle.dump({"key": key, "state": state}, f, protocol=pickle.HIGHEST_PROTOCOL)


def clear(out_path: str | Path) -> None:
    path_for(out_path).unlink(missing_ok=True)
