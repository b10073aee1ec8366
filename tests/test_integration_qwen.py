"""The real default model on the real tasks: a 1K-token needle answered with the full cache, and the
engine's answers equal to kvpress's own pipeline."""

import pytest

from kvlab.steps.benchmark import engine_vs_pipeline
from kvlab.engine import evaluate_sample
from kvlab.methods import build, variants
from kvlab.tasks import KINDS

pytestmark = pytest.mark.integration


def test_qwen_finds_a_1k_needle_with_full_cache(qwen):
    model, tokenizer = qwen
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 0}
    (sample,) = KINDS["niah"].generate("niah_single", spec, tokenizer, 1024)
    assert 1024 - 30 < sample.prompt.tokens <= 1024
    grid = variants(build({"full": {"kind": "full"}}), [0.25])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 16)
    assert rows[0]["score"] == 1.0, rows[0]["prediction"]
    assert sample.gold[0] in rows[0]["prediction"]


def test_qwen_geometry_in_bytes(qwen):
    """24 layers × 2 KV heads × 64 dims × K,V × 4 bytes (float32) = 24,576 bytes per token held."""
    model, tokenizer = qwen
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 1}
    (sample,) = KINDS["niah"].generate("niah_single", spec, tokenizer, 512)
    grid = variants(build({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {}}}), [0.25])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 2)
    n = len(sample.prompt.context)
    assert rows[0]["kv_bytes"] == 24_576 * n
    assert rows[1]["kv_bytes"] == 24_576 * int(n * 0.25)


def test_engine_answers_equal_kvpress_pipeline_snapkv_1k(qwen_dir, tmp_path):
    """The same SnapKV grid at 1K tokens by our batched engine and by kvpress's pipeline, one call per
    variant: identical answers (the benchmark row records both wall times)."""
    run = {
        "methods": build({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 64, "kernel_size": 5}}}),
        "budgets": [0.5, 0.25], "question_modes": ["agnostic"], "max_new_tokens": 12,
        "dtype": "float32", "device": "cpu", "threads": 1,
    }
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 0, "haystack": "noise", "keys": 1, "values": 1,
            "queries": 1, "question_position": "after"}
    row = engine_vs_pipeline(qwen_dir, "niah_single", spec, 1024, 1, run, tmp_path / "bench.parquet").iloc[0]
    assert row["variants"] == 3 and row["agreement_agnostic"] == 1.0
    assert (tmp_path / "bench.parquet").is_file()


def test_kivi_kl_targets_on_real_prose(qwen):
    """The quantization protocol on Qwen2.5-0.5B (fp32): 512 tokens of KJV prose, then 128 true tokens fed
    one at a time; per-token KL(full ‖ method) with G = R = 32. KIVI INT4 ≤ 0.01 nat, INT2 ≤ 0.2 nat, and
    transformers' QuantizedCache at 4 bits (same G, R) at least 20× worse than KIVI INT4."""
    model, tokenizer = qwen
    kivi = {"kind": "quant", "scheme": "kivi", "group": 32, "residual": 32, "key_axis": "channel", "value_axis": "token"}
    methods = {
        "full": {"kind": "full"},
        "kivi4": {**kivi, "bits": 4},
        "kivi2": {**kivi, "bits": 2},
        "hf4": {"kind": "hf_quantized", "bits": 4, "group": 32, "residual": 32},
    }
    spec = {"kind": "continuation", "samples": 1, "seed": 0, "continuation_tokens": 128}
    (sample,) = KINDS["continuation"].generate("prose_kl", spec, tokenizer, 512)
    rows = {r["method"]: r for r in evaluate_sample(model, tokenizer, sample, variants(build(methods), [1.0]), ["agnostic"], 1)}
    assert rows["kivi4"]["tf_tokens"] == 128
    assert rows["kivi4"]["kl_vs_full"] <= 0.01
    assert rows["kivi2"]["kl_vs_full"] <= 0.2
    assert rows["hf4"]["kl_vs_full"] >= 20 * rows["kivi4"]["kl_vs_full"]
    assert rows["kivi4"]["codes_vs_bf16"] == pytest.approx(3.2)  # 64 × 4 bits + 8 B key + 8 B value metadata per head
    assert rows["kivi4"]["kv_bytes"] == rows["kivi4"]["kv_bytes_formula"]


def test_snapkv_aware_finds_a_1k_needle_that_streaming_llm_loses(qwen):
    """Needles 10% and 50% deep in 1K tokens, 25% of the KV kept. SnapKV (observation window 32) with the question
    inside its window finds them; without the question (agnostic) it loses them; StreamingLLM keeps 4 sinks and
    the newest ~250 tokens, and the needles lie ≥ 450 tokens from the end, so it loses them in both modes."""
    model, tokenizer = qwen
    spec = {"kind": "niah", "depths": [0.1, 0.5], "samples": 1, "seed": 0}
    methods = {
        "full": {"kind": "full"},
        "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 32, "kernel_size": 5}},
        "streaming": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}},
    }
    for sample in KINDS["niah"].generate("niah_single", spec, tokenizer, 1024):
        rows = evaluate_sample(model, tokenizer, sample, variants(build(methods), [0.25]), ["agnostic", "aware"], 12, kl=False)
        score = {(r["method"], r["question_mode"]): r["score"] for r in rows}
        assert score[("full", "agnostic")] == score[("full", "aware")] == 1.0
        assert score[("snapkv", "aware")] == 1.0, sample.sample_id
        assert score[("snapkv", "agnostic")] == 0.0, sample.sample_id
        assert score[("streaming", "agnostic")] == score[("streaming", "aware")] == 0.0, sample.sample_id
        for r in rows:
            if r["method"] != "full":
                assert r["kv_tokens_mean"] == int(r["compressed_tokens"] * 0.25)
