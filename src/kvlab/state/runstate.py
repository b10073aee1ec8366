"""What an interrupted run leaves behind, put right before the next run plans its jobs.

Two things stop Snakemake from finishing a run that Ctrl-C or kill -9 cut short:

- **A stale lock.** Snakemake locks the working folder (`.snakemake/locks/`) and removes the lock when it exits;
  after kill -9 the lock stays and the next run stops with "Directory cannot be locked". The lock files name
  no process, so every run records its own (`record_owner`, from the Snakefile's `onstart`, which runs while
  the lock is held). `clear_stale_lock` removes the lock only when every run that recorded itself is on this
  host and no longer running; a lock of a live run, of one on another host, or of an unknown one stays.
- **A missing intermediate file.** Snakemake deletes a job's outputs when it starts and when it is
  interrupted, and it does not rebuild a missing file whose products still exist: after an interrupted
  `collect`, `results/kvlab.duckdb` is gone, the old report stays, and the next run says "Nothing to be
  done". `drop_orphans` removes the products of a missing file, stage by stage, so the next run rebuilds the
  file and everything made from it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

from kvlab.util.io import pid_alive

LOCKS = Path(".snakemake/locks")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(owner: dict) -> bool:
    if not Path("/proc/self/stat").exists():  # no /proc: the pid alone
        return pid_alive(owner["pid"])
    return _start_time(owner["pid"]) == owner.get("started")  # a reused pid has another start time


def record_owner(workdir: str | Path = ".") -> None:
    """Record this Snakemake process as a holder of the working folder's lock (call it while the lock is held)."""
    locks = Path(workdir) / LOCKS
    if not any(locks.glob("*.lock")):  # --nolock: nothing is held
        return
    pid = os.getpid()
    owner = {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid)}
    (locks / f"kvlab-owner-{pid}.json").write_text(json.dumps(owner))


def clear_stale_lock(workdir: str | Path = ".") -> str | None:
    """Remove the lock of runs that recorded themselves and are gone; return a line saying so, or None."""
    locks = Path(workdir) / LOCKS
    if not any(locks.glob("*.lock")):
        return None
    owners = []
    for path in locks.glob("kvlab-owner-*.json"):
        try:
            owners.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None  # unreadable: leave Snakemake's own message
    host = socket.gethostname()
    if not owners or any(o.get("host") != host or _alive(o) for o in owners):
        return None
    shutil.rmtree(locks)
    pids = ", ".join(str(o["pid"]) for o in owners)
    return f"kvlab: removed the lock of an interrupted run (snakemake pid {pids} on {host} is no longer running)"


def drop_orphans(stages: list[tuple[list[str], list[str]]]) -> list[str]:
    """Remove the products of missing files. `stages` are (inputs, outputs) of rules in the order they run:
    when an input of a stage is missing (or was removed by an earlier stage), its existing outputs are removed.
    Returns one line per stage that removed something."""
    lines, missing = [], set()
    for inputs, outputs in stages:
        gone = next((f for f in inputs if f in missing or not os.path.exists(f)), None)
        if gone is None:
            continue
        missing.update(outputs)
        present = [f for f in outputs if os.path.exists(f)]
        for out in present:
            os.remove(out)
        if present:
            lines.append(f"kvlab: {gone} is missing (an interrupted run?), so {', '.join(present)}, made from it, "
                         "were removed and are rebuilt with it")
    return lines


def say(*lines: str | None) -> None:
    """Print each line that is not None to stderr, where Snakemake's own messages go."""
    for line in filter(None, lines):
        print(line, file=sys.stderr)
