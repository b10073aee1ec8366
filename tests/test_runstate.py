"""What an interrupted run leaves: stale locks, missing intermediate files, half-written files (kvlab.state.runstate,
kvlab.util.io). The real interrupts of the pipeline are in test_dag.py."""

import json
import os
import socket
import subprocess
import sys

import pytest

from kvlab.state import runstate
from kvlab.util.io import atomic_path


def _locked(work, owners):
    locks = work / runstate.LOCKS
    locks.mkdir(parents=True)
    (locks / "0.input.lock").write_text("results/a\n")
    (locks / "0.output.lock").write_text("results/b\n")
    for i, owner in enumerate(owners):
        (locks / f"kvlab-owner-{i}.json").write_text(json.dumps(owner))
    return locks


def _gone_process() -> dict:
    """The owner record of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    owner = {"host": socket.gethostname(), "pid": proc.pid, "started": runstate._start_time(proc.pid)}
    proc.kill()
    proc.wait()
    return owner


def test_the_lock_of_a_run_that_is_gone_is_removed(tmp_path):
    owner = _gone_process()
    locks = _locked(tmp_path, [owner])
    line = runstate.clear_stale_lock(tmp_path)
    assert not locks.exists()
    assert line and f"pid {owner['pid']}" in line and "no longer running" in line


@pytest.mark.parametrize("case", ["live", "other host", "no owner", "unreadable owner"])
def test_a_lock_that_may_be_held_stays(tmp_path, case):
    """A lock stays when its run is alive (same pid and start time), on another host, unknown or unreadable."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": runstate._start_time(os.getpid())}
    owners = {"live": [_gone_process(), me], "other host": [{**_gone_process(), "host": "elsewhere"}],
              "no owner": [], "unreadable owner": []}[case]
    locks = _locked(tmp_path, owners)
    if case == "unreadable owner":
        (locks / "kvlab-owner-9.json").write_text("{not json")
    assert runstate.clear_stale_lock(tmp_path) is None
    assert (locks / "0.input.lock").exists()


def test_a_reused_pid_with_another_start_time_is_gone(tmp_path):
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": "1"}  # same pid, not this process
    locks = _locked(tmp_path, [me])
    assert runstate.clear_stale_lock(tmp_path)
    assert not locks.exists()


def test_owner_recorded_only_while_a_lock_is_held(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runstate.record_owner()
    assert not (tmp_path / runstate.LOCKS).exists()  # --nolock: nothing to own
    locks = _locked(tmp_path, [])
    runstate.record_owner()
    owner = json.loads((locks / f"kvlab-owner-{os.getpid()}.json").read_text())
    assert owner == {"host": socket.gethostname(), "pid": os.getpid(), "started": runstate._start_time(os.getpid())}
    assert runstate.clear_stale_lock() is None  # this process is alive


def test_products_of_a_missing_file_are_dropped_stage_by_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("rows1", "rows2", "db", "report", "figure"):
        (tmp_path / name).write_text(name)
    stages = [(["rows1", "rows2"], ["db"]), (["db"], ["report", "figure"])]
    assert runstate.drop_orphans(stages) == []  # all present: nothing to do
    (tmp_path / "rows2").unlink()
    lines = runstate.drop_orphans(stages)
    assert not any((tmp_path / n).exists() for n in ("db", "report", "figure")) and (tmp_path / "rows1").exists()
    assert len(lines) == 2 and "rows2 is missing" in lines[0] and "db is missing" in lines[1]
    assert runstate.drop_orphans(stages) == []  # nothing left to drop: a fresh folder is left alone


def test_a_killed_writers_partial_file_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "rows.parquet"
    dead = _gone_process()["pid"]
    stale = [tmp_path / f".rows.parquet.{dead}.abc.partial", tmp_path / f".rows.parquet.{dead}.abc.partial.wal"]
    live = tmp_path / f".rows.parquet.{os.getpid()}.xyz.partial"  # a live writer's file stays
    other = tmp_path / f".other.parquet.{dead}.abc.partial"  # another target's is not this write's business
    for f in (*stale, live, other):
        f.write_text("half")
    with atomic_path(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"
    assert not any(f.exists() for f in stale) and live.exists() and other.exists()
