"""The engine compresses a copy of a shared prefill; it must equal kvpress compressing inside its hooks."""

import pytest
import torch
from transformers import DynamicCache

from kvlab.engine import cache_stats, compress, evaluate_sample, greedy_decode, prefill
from kvlab.methods import Variant, variants
from kvlab.tasks import GENERATORS

PRESSES = [
    ("SnapKVPress", {"window_size": 16, "kernel_size": 5}),
    ("StreamingLLMPress", {"n_sink": 4}),
    ("KnormPress", {}),
    ("TOVAPress", {}),
]


@pytest.fixture(scope="module")
def sample(tiny):
    spec = {"kind": "niah_single", "depths": [0.5], "samples": 1, "seed": 3}
    return GENERATORS["niah_single"]("niah_single", spec, tiny[1], 700)[0]


def hook_compressed(model, press, ids):
    """kvpress's own path: compression inside forward hooks during prefill."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    return cache


@pytest.mark.parametrize("press,kwargs", PRESSES)
@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_posthoc_compress_equals_kvpress_hooks(tiny, sample, press, kwargs, budget):
    model, _ = tiny
    ids = sample.prompt.context + sample.prompt.question
    variant = Variant(press, "kvpress", budget, {"press": press, "kwargs": kwargs})
    ours = compress(model, prefill(model, ids), variant)
    theirs = hook_compressed(model, variant.make_press(), ids)
    for a, b in zip(ours.layers, theirs.layers):
        assert a.keys.shape == b.keys.shape
        assert a.keys.shape[-2] == int(len(ids) * budget)
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)


def test_chunked_prefill_continues_the_same_cache(tiny, sample):
    model, _ = tiny
    p = sample.prompt
    whole = prefill(model, p.context + p.question)
    chunked = prefill(model, p.question, past=prefill(model, p.context))
    assert chunked.length == whole.length
    for a, b in zip(whole.cache.layers, chunked.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    for a, b in zip(whole.captures, chunked.captures):
        torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=1e-5, atol=1e-5)


def test_full_decode_equals_hf_generate(tiny, sample):
    model, tokenizer = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    ours = greedy_decode(model, tokenizer, compress(model, base, Variant("full", "full", 1.0)), p.question + p.suffix, base.length, 12)
    ref = model.generate(torch.tensor([p.context + p.question + p.suffix]), max_new_tokens=12, do_sample=False)
    expected = ref[0, p.tokens :].tolist()
    assert ours == expected[: len(ours)]


def test_rows_cover_grid_and_bytes_are_measured(tiny, sample):
    model, tokenizer = tiny
    grid = variants(
        {"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}}},
        [0.5, 0.25],
    )
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic", "aware"], 4)
    assert len(rows) == 3 * 2
    per_token = 2 * 2 * 2 * 16 * 4  # layers × (K,V) × kv_heads × head_dim × fp32 bytes
    p = sample.prompt
    for r in rows:
        held = len(p.context) + (len(p.question) if r["question_mode"] == "aware" else 0)
        assert r["compressed_tokens"] == held
        assert r["kv_tokens_mean"] == int(held * r["budget"])
        assert r["kv_bytes"] == per_token * int(held * r["budget"])
    full = [r for r in rows if r["method"] == "full"]
    assert full[0]["prediction"] == full[1]["prediction"]


def test_cache_stats_counts_stored_tensors():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8), 0)
    assert cache_stats(cache) == {"kv_bytes": 2 * 2 * 10 * 8 * 4, "kv_tokens_mean": 10.0}
