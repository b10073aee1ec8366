"""Small I/O helpers: atomic writes (nothing half-written) and logging set-up for rule scripts."""

from __future__ import annotations

import atexit
import logging
import os
import resource
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(path: Path) -> None:
    """Remove what a killed writer of `path` left (`.NAME.PID.*.partial`, with DuckDB's `.wal`), if PID is gone."""
    for stale in path.parent.glob(f".{path.name}.*.partial*"):
        pid = stale.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; move it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        if os.path.isfile(tmp):
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_parquet(frame, path: str | Path) -> None:
    """Write a DataFrame as Parquet atomically (nothing half-written)."""
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


class DamagedFileError(ValueError):
    """A result or model file that cannot be read, named in one line with the fix."""


def read_parquet(path: str | Path, columns: list[str] | None = None):
    """``pandas.read_parquet`` whose failure on a damaged file (truncated, not Parquet) names the file in one line."""
    import pandas as pd
    import pyarrow

    try:
        return pd.read_parquet(path, columns=columns)
    except FileNotFoundError:
        raise
    except (pyarrow.ArrowException, OSError) as exc:
        reason = " ".join(str(exc).split())
        raise DamagedFileError(
            f"{path}: not a readable Parquet file ({reason}); delete it and rerun the rule that writes it"
        ) from None


def log_to(path: str | Path | None) -> None:
    """Send logging (and warnings) of a rule script to its log file as well as stderr."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path, mode="w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", handlers=handlers, force=True)
    logging.captureWarnings(True)

    def excepthook(kind, value, tb):  # a failing script leaves its traceback in the rule's log too
        logging.getLogger("kvlab").error("failed", exc_info=(kind, value, tb))

    sys.excepthook = excepthook
    atexit.unregister(log_peak_rss)  # once per process, however often a script sets up logging
    atexit.register(log_peak_rss)


PEAK_RSS = "peak RSS"


def log_peak_rss() -> None:
    """Log the script's peak resident memory, the kernel's high-water mark, at exit (after a failure too).
    Snakemake's benchmark samples RSS every 0.5 s for ~15 s and then every 30 s, so it misses shorter peaks
    later in a job. Child processes are not counted: a forked child's mark starts at its parent's RSS, so the
    kernel's figure for children says nothing of their own use."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    logging.getLogger("kvlab").info("%s %.1f MB", PEAK_RSS, peak)
