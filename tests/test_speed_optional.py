"""Speed benchmarks are optional (`speed_benchmarks`): a run of only the user's workload needs no niah task and
costs only acquire, calibrate and its evaluation jobs; the report says which speed jobs were not run."""

import copy
from pathlib import Path

import pytest
import yaml

from kvlab.state.config import ConfigError, resolve

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "config.schema.yaml"


@pytest.fixture
def config():
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_a_preset_of_only_a_dataset_task_needs_no_needle_without_the_speed_benchmarks(config, tmp_path):
    """The workload preset runs no speed job, so a preset of only the user's own task (no niah task) is accepted; the
    same preset asking for the engine-vs-pipeline benchmark is refused with one line saying how to leave it out, and
    throughput alone needs no task."""
    (tmp_path / "t.jsonl").write_text('{"context": "The sky is blue.", "question": "What colour is the sky?", "answers": "blue"}\n')
    tickets = {"kind": "dataset", "path": str(tmp_path / "t.jsonl"), "samples": 1, "context_tokens": [0]}
    config["presets"]["mine"] = {"extends": "workload", "replace": ["tasks"], "tasks": {"tickets": tickets}}
    assert resolve({**config, "preset": "workload"}, SCHEMA)["speed_benchmarks"] == []
    assert resolve(copy.deepcopy({**config, "preset": "mine"}), SCHEMA)["speed_benchmarks"] == []
    assert resolve(copy.deepcopy({**config, "preset": "default"}), SCHEMA)["speed_benchmarks"] == [
        "throughput", "engine_vs_pipeline", "decode_kernels"]
    config["presets"]["mine"]["speed_benchmarks"] = ["throughput"]
    assert list(resolve(copy.deepcopy({**config, "preset": "mine"}), SCHEMA)["tasks"]) == ["tickets"]
    config["presets"]["mine"]["speed_benchmarks"] = ["throughput", "engine_vs_pipeline"]
    with pytest.raises(ConfigError) as error:
        resolve({**config, "preset": "mine"}, SCHEMA)
    assert str(error.value) == (
        "preset 'mine': key 'benchmark.task': 'niah_single' must name a niah task asking after the document; candidates: "
        "none; or leave engine_vs_pipeline out of speed_benchmarks (e.g. speed_benchmarks: [] for only the evaluation jobs)")
