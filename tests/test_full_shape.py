"""The `full` preset's shape on the CPU (kvlab.tools.full_shape): the derived config is the preset's grid on the tiny
model, validates, follows the preset when it changes, and the workflow plans every task × context length of it."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, snakemake
from kvlab.state.config import resolve, with_preset
from kvlab.tools.full_shape import derive, job_peaks, write_config

SCHEMA = ROOT / "workflow" / "config.schema.yaml"
CONFIG = yaml.safe_load((ROOT / "config.yaml").read_text())
FULL = CONFIG["presets"]["full"]  # the preset as written (its tasks replace the top level's; it sets no methods)
TASKS = with_preset(CONFIG, "full")["tasks"]  # its tasks made whole: the catalogue's entries with the preset's changes


def test_derived_config_is_the_full_preset_on_the_tiny_model():
    derived = resolve(derive(CONFIG), SCHEMA)
    assert derived["preset"] == "default" and derived["presets"] == {}
    assert (derived["device"], derived["dtype"]) == ("cpu", "float32")
    assert list(derived["tasks"]) == list(FULL["tasks"])
    for name, task in TASKS.items():
        got = derived["tasks"][name]
        assert {k: v for k, v in got.items() if k in task and k != "samples"} == {k: v for k, v in task.items() if k not in ("samples", "max_samples")}
        assert "max_samples" not in got and derived["sequential"]["max_samples"] == 0  # one sample per cell, no rounds
        assert got["samples"] == 1
    assert derived["methods"] == resolve(CONFIG, SCHEMA)["methods"]  # `full` sets no methods: the top-level ones
    for key in ("budgets", "question_modes", "throughput"):
        assert derived[key] == resolve({**CONFIG, "preset": "full"}, SCHEMA)[key]
    assert {**derived["benchmark"], "samples": FULL["benchmark"]["samples"]} == FULL["benchmark"]
    (model,) = derived["models"].values()
    assert model["source"] == "tiny"
    longest = max(n for t in TASKS.values() for n in t["context_tokens"])
    assert longest + 256 <= model["max_position_embeddings"]  # arithmetic decodes 256 tokens after its prompt


def test_derived_config_follows_the_preset():
    config = copy.deepcopy(CONFIG)
    preset = config["presets"]["full"]
    preset["tasks"]["niah_single"]["context_tokens"] = [65536]
    preset["methods"] = {"full": {"kind": "full"}, "fp8": {"kind": "quant", "scheme": "fp8"}}
    preset["replace"] = [*preset["replace"], "methods"]
    preset["budgets"] = [0.3]
    derived = resolve(derive(config), SCHEMA)
    assert derived["tasks"]["niah_single"]["context_tokens"] == [65536]
    assert list(derived["methods"]) == ["full", "fp8"] and derived["budgets"] == [0.3]
    assert derived["models"]["tiny-qwen2"]["max_position_embeddings"] == 131072  # 65536 + 256 decoded tokens


def test_a_missing_preset_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^no preset 'full' in the config; presets: smoke$"):
        derive({**CONFIG, "presets": {"smoke": CONFIG["presets"]["smoke"]}})


@pytest.mark.slow
def test_the_run_plans_every_task_and_length_of_the_preset(tmp_path):
    run = tmp_path / "run"
    write_config(run, ROOT / "config.yaml")
    proc = snakemake(run, "-s", str(ROOT / "Snakefile"), "--directory", str(run), "-n", "results/report.html", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    planned = set(re.findall(r"wildcards: model=tiny-qwen2, task=(\w+), ctx=(\d+)", out))
    expected = {(task, str(n)) for task, spec in TASKS.items() for n in spec["context_tokens"]}
    speed = {(rule, str(n)) for rule, key in (("throughput", "throughput"), ("engine_vs_pipeline", "benchmark"))
             for n in FULL[key]["context_tokens"]}
    speed_planned = set(re.findall(r"rule (throughput|engine_vs_pipeline):\n.*?wildcards: model=tiny-qwen2, ctx=(\d+)", out, flags=re.S))
    assert planned == expected and speed_planned == speed
    assert "decode_kernels" not in out  # CUDA only


def test_job_peaks_joins_the_sampled_rss_and_the_peak_each_job_logged(tmp_path):
    """A job that holds 300 MB for a moment and frees it: Snakemake's sampled RSS can miss that, the kernel's
    high-water mark logged at exit (kvlab.util.io.log_to) cannot."""
    script = ("import sys, torch; from kvlab.util.io import log_to; log_to(sys.argv[1]); "
              "x = torch.ones(300 * 2**20 // 4); x.add_(1); del x")
    log = tmp_path / "logs" / "evaluate" / "m" / "niah" / "32000.log"
    subprocess.run([sys.executable, "-c", script, str(log)], check=True, timeout=120)
    bench = tmp_path / "results" / "benchmarks"
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    for job, s, rss in (("evaluate/m/niah/32000", 40.0, 120.5), ("calibrate/m", 3.0, 400.0)):
        path = (bench / job).with_suffix(".tsv")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + f"{s}\t0:00:40\t{rss}\t0\t0\t0\t0\t0\t0\t0\n")
    first, second = job_peaks(tmp_path).to_dict("records")
    assert (first["rule"], first["job"], first["wall_s"], first["max_rss_mb"]) == ("evaluate", "evaluate/m/niah/32000", 40.0, 120.5)
    assert first["peak_rss_mb"] > 300
    assert (second["job"], second["max_rss_mb"]) == ("calibrate/m", 400.0) and second["peak_rss_mb"] != second["peak_rss_mb"]  # NaN: no log
    with pytest.raises(ValueError, match="no job has finished"):
        job_peaks(tmp_path / "empty")
