"""python -m kvlab.tools.progress: the decision table so far, from a finished job's file and a running job's checkpoint,
read without touching the checkpoint (tiny model, prose KL: its cells decide without references)."""

import os
import re
from pathlib import Path

import pytest
import yaml
from kvlab.state import resume
from kvlab.steps.evaluate import run_job
from kvlab.methods import build
from kvlab.tools.progress import main

CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"
METHODS = {"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}},
           "fp8": {"kind": "quant", "scheme": "fp8", "scales": "dynamic", "residual": 0}}


RULE = {"kl_tail_share": 0.1}  # a relaxed tail (the default's 3% needs 110 samples at KL 0): its cells decide by 36


class Stopped(Exception):
    """The job stopped right after its first checkpoint, as a killed job would be."""


def prose_job(tiny_dir, out, ctx: int, max_samples: int):
    spec = {"kind": "continuation", "context_tokens": [ctx], "continuation_tokens": 16, "samples": 3, "seed": 0}
    run = {"methods": build(METHODS), "budgets": [0.5, 0.1], "question_modes": ["agnostic"], "max_new_tokens": 4,
           "noise_floor_samples": 0, "dtype": "float32", "device": "cpu", "threads": 1,
           "sequential": {"max_samples": max_samples, "round": 3, "rule": {**RULE, "tolerance_points": 5.0, "kl_safe": 0.01,
                                                                           "kl_cap_ratio": 5}}}
    return run_job(tiny_dir, "prose", spec, ctx, run, out)


def test_progress_shows_decided_and_open_cells_and_leaves_the_checkpoint_alone(tmp_path, tiny_dir, monkeypatch, capsys):
    results = tmp_path / "results"
    jobs = results / "eval" / "tiny" / "prose"
    done = prose_job(tiny_dir, jobs / "256.parquet", 256, 36)  # finished: every cell decided safe by 36 samples
    assert done["draw"].nunique() == 36
    saved = resume.save

    def save_then_stop(*args):
        saved(*args)
        raise Stopped

    running = jobs / "128.parquet"
    with monkeypatch.context() as m:
        m.setattr(resume, "save", save_then_stop)
        with pytest.raises(Stopped):
            prose_job(tiny_dir, running, 128, 36)  # stopped after its first round (3 samples): every cell open
    checkpoint = resume.path_for(running)
    assert checkpoint.exists() and not running.exists()
    before = (checkpoint.read_bytes(), checkpoint.stat().st_mtime_ns, sorted(os.listdir(jobs)))

    config = yaml.safe_load(CONFIG.read_text())
    config["decision"].update(RULE)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    main(["--results", str(results), "--config", str(tmp_path / "config.yaml")])
    out = capsys.readouterr().out
    assert (checkpoint.read_bytes(), checkpoint.stat().st_mtime_ns, sorted(os.listdir(jobs))) == before
    assert "3 of 6 job cells decided; running: tiny/prose/128: 3 samples so far, round 1" in out
    lines = {(int(m[1]), m[2], float(m[3])): m[4] for m in
             re.finditer(r"tiny +prose +(\d+) +agnostic +(\w+) +([\d.]+) +(.*)", out)}
    assert len(lines) == 6
    for method, budget in (("fp8", 1.0), ("snapkv", 0.5), ("snapkv", 0.1)):
        tail = r"0 of (\d+) documents above 0\.05 nat \(share ≤ [\d.]+%\)"
        assert re.match(rf"decided safe +36 +KL \[0, 0\.00\d+\] nat; {tail}( +yes)?$", lines[(256, method, budget)].strip())
        assert re.match(rf"open +3 +KL \[0, 0\.0\d+\] nat; {tail} +needs about \d+ more samples$", lines[(128, method, budget)].strip())
    page = (results / "progress.html").read_text()
    assert "<h2>Decisions so far</h2>" in page and "3 of 6 job cells decided, 3 open" in page and "border-collapse" in page
    assert page.count("decided safe") == 3 and page.count("needs about") == 3
    assert not list(jobs.glob(".*"))  # nothing written beside the jobs' files


def test_progress_on_a_run_that_has_not_started(tmp_path, capsys):
    main(["--results", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"no evaluation rows under {tmp_path / 'eval'} yet" in out and "0 of 0 job cells decided; running: none" in out
    assert (tmp_path / "progress.html").exists()
