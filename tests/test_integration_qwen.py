"""The real default model on the real task: a 1K-token needle, answered with the full cache."""

import pytest

from kvlab.engine import evaluate_sample
from kvlab.methods import variants
from kvlab.tasks import GENERATORS

pytestmark = pytest.mark.integration


def test_qwen_finds_a_1k_needle_with_full_cache(qwen):
    model, tokenizer = qwen
    spec = {"kind": "niah_single", "depths": [0.5], "samples": 1, "seed": 0}
    (sample,) = GENERATORS["niah_single"]("niah_single", spec, tokenizer, 1024)
    assert 1024 - 30 < sample.prompt.tokens <= 1024
    grid = variants({"full": {"kind": "full"}}, [0.25])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 16)
    assert rows[0]["score"] == 1.0, rows[0]["prediction"]
    assert sample.gold[0] in rows[0]["prediction"]


def test_qwen_geometry_in_bytes(qwen):
    """24 layers × 2 KV heads × 64 dims × K,V × 4 bytes (float32) = 24,576 bytes per token held."""
    model, tokenizer = qwen
    spec = {"kind": "niah_single", "depths": [0.5], "samples": 1, "seed": 1}
    (sample,) = GENERATORS["niah_single"]("niah_single", spec, tokenizer, 512)
    grid = variants({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {}}}, [0.25])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 2)
    n = len(sample.prompt.context)
    assert rows[0]["kv_bytes"] == 24_576 * n
    assert rows[1]["kv_bytes"] == 24_576 * int(n * 0.25)
