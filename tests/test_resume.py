"""A killed evaluation job resumes from its checkpoint (kvlab.state.resume) and writes the rows an uninterrupted run
writes; a checkpoint of another config or code version is never mixed in."""

import logging
import os
import pickle
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from kvlab.state import resume
from kvlab.steps.evaluate import run_job
from kvlab.methods import build, variants
from kvlab.models.card import read_card

METHODS = {"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}},
           "fp8": {"kind": "quant", "scheme": "fp8", "scales": "dynamic", "residual": 0}}
NEEDLE = {"kind": "niah", "context_tokens": [384], "depths": [0.2, 0.7], "samples": 1, "seed": 0}
# a 1-point tolerance decides nothing in 16 prompts: every round runs every variant
RUN = {"methods": build(METHODS), "budgets": [0.5], "question_modes": ["agnostic", "aware"], "max_new_tokens": 4,
       "noise_floor_samples": 2, "dtype": "float32", "device": "cpu", "threads": 1,
       "sequential": {"max_samples": 16, "round": 2, "rule": {"tolerance_points": 1.0}}}
TIMING = ("_s", "seconds", "wall", "rows_per_s")
CHILD = """
import sys
from kvlab.steps.evaluate import run_job
from kvlab.methods import build
run_job(sys.argv[1], "niah_single", {needle}, 384, {{**{run}, "methods": build({run}["methods"])}}, sys.argv[2])
"""  # a Method's repr is its config entry: the child builds the typed methods again


def non_timing(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[[c for c in frame.columns if not any(t in c for t in TIMING)]].reset_index(drop=True)


def kill_after_first_checkpoint(tiny_dir, out) -> None:
    """Run the job in a child process and kill -9 it as soon as its first checkpoint is on disk."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(needle=NEEDLE, run=RUN), str(tiny_dir), str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not resume.path_for(out).exists():
        assert child.poll() is None, "the job ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()


@pytest.mark.slow
def test_a_killed_job_resumes_and_writes_what_an_uninterrupted_run_writes(tmp_path, tiny_dir, caplog):
    whole = run_job(tiny_dir, "niah_single", NEEDLE, 384, RUN, tmp_path / "whole.parquet")
    assert whole["round"].max() == 8 and not resume.path_for(tmp_path / "whole.parquet").exists()
    out = tmp_path / "killed.parquet"
    kill_after_first_checkpoint(tiny_dir, out)
    assert not out.exists() and resume.path_for(out).exists()
    saved = resume.load(out, resume.job_key("niah_single", NEEDLE, 384, RUN, read_card(tiny_dir)))
    assert saved is not None and 2 <= saved["next"] < 16
    with caplog.at_level(logging.INFO, logger="kvlab.steps.evaluate"):
        resumed = run_job(tiny_dir, "niah_single", NEEDLE, 384, RUN, out)
    assert f"resumed from {resume.path_for(out)}: {saved['next']} samples done, in round" in caplog.text
    pd.testing.assert_frame_equal(non_timing(resumed), non_timing(whole))
    pd.testing.assert_frame_equal(non_timing(pd.read_parquet(out)), non_timing(pd.read_parquet(tmp_path / "whole.parquet")))
    assert not resume.path_for(out).exists()  # removed with the output written


@pytest.mark.slow
def test_a_checkpoint_of_another_config_or_code_version_is_ignored(tmp_path, tiny_dir, caplog, monkeypatch):
    out = tmp_path / "rows.parquet"
    kill_after_first_checkpoint(tiny_dir, out)
    card = read_card(tiny_dir)
    key = resume.job_key("niah_single", NEEDLE, 384, RUN, card)
    saved = resume.load(out, key)
    with open(resume.path_for(out), "rb") as f:
        written = pickle.load(f)  # what the killed job wrote: under this job's key, the state `load` gives back
    assert written["key"] == key and saved.keys() == written["state"].keys()
    pd.testing.assert_frame_equal(pd.DataFrame(saved["rows"]), pd.DataFrame(written["state"]["rows"]))
    assert {k: v for k, v in saved.items() if k != "rows"} == {k: v for k, v in written["state"].items() if k != "rows"}
    # the rows of the samples before `next`, each with every variant in both question modes (a 1-point tolerance
    # decides no cell, so none stops)
    per_sample = len(variants(RUN["methods"], RUN["budgets"], "niah_single")) * len(RUN["question_modes"])
    assert len(saved["rows"]) == saved["next"] * per_sample and {r["draw"] for r in saved["rows"]} == set(range(saved["next"]))
    with monkeypatch.context() as m:  # the same job under other code
        m.setattr(resume, "code_version", lambda: "another kvlab")
        assert resume.load(out, resume.job_key("niah_single", NEEDLE, 384, RUN, card)) is None
    fewer = {**RUN, "sequential": {**RUN["sequential"], "max_samples": 2}}  # the same job under another config
    with caplog.at_level(logging.INFO):
        rows = run_job(tiny_dir, "niah_single", NEEDLE, 384, fewer, out)
    assert "written under another config or kvlab version; starting over" in caplog.text
    assert "resumed from" not in caplog.text
    assert set(rows["round"]) == {1} and rows["draw"].nunique() == 2 and not resume.path_for(out).exists()


def test_a_damaged_checkpoint_costs_only_its_work(tmp_path, caplog):
    out = tmp_path / "rows.parquet"
    resume.path_for(out).write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING):
        assert resume.load(out, "k") is None
    assert "cannot be read" in caplog.text
    resume.save(out, "k", {"next": 3})
    assert resume.load(out, "k") == {"next": 3} and resume.load(out, "other") is None
