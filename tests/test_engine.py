"""The engine compresses a copy of a shared prefill; it must equal kvpress compressing inside its hooks."""

import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import DynamicCache

from conftest import sharpened

from kvlab.engine import Batch, Reading, cache_stats, compress, evaluate_sample, greedy_decode, prefill, teacher_forced
from kvlab.methods import Variant, build, variants
from kvlab.tasks import KINDS

PRESSES = [
    ("SnapKVPress", {"window_size": 16, "kernel_size": 5}),
    ("StreamingLLMPress", {"n_sink": 4}),
    ("KnormPress", {}),
    ("TOVAPress", {}),
]


@pytest.fixture(scope="module")
def sample(tiny):
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}
    return KINDS["niah"].generate("niah_single", spec, tiny[1], 700)[0]


def tuned(monkeypatch, model, **fields):
    """Set some of the engine's tuning (kvlab.engine.tuning) on `model`'s device for this test."""
    from kvlab.engine import tuning

    monkeypatch.setitem(tuning.BY_DEVICE, model.device.type, replace(tuning.tuned(model.device), **fields))


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


@pytest.mark.parametrize("press,kwargs,wrapper", [
    ("StreamingLLMPress", {"n_sink": 4}, "KeyRerotationPress"),
    ("SnapKVPress", {"window_size": 16}, "MergingPress"),
])
def test_wrapped_presses_equal_kvpress_hooks(tiny, sample, press, kwargs, wrapper):
    """A press inside a kvpress wrapper (re-rotation, merging) compresses as kvpress's own hooks do."""
    model, _ = tiny
    ids = sample.prompt.context + sample.prompt.question
    variant = Variant(press, "kvpress", 0.25, {"press": press, "kwargs": kwargs, "wrapper": wrapper})
    ours = compress(model, prefill(model, ids), variant)
    theirs = hook_compressed(model, variant.make_press(), ids)
    plain = compress(model, prefill(model, ids), Variant(press, "kvpress", 0.25, {"press": press, "kwargs": kwargs}))
    for a, b, c in zip(ours.layers, theirs.layers, plain.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        assert not (torch.equal(a.keys, c.keys) and torch.equal(a.values, c.values))  # the wrapper changed something


def test_chunked_prefill_continues_the_same_cache(tiny, sample):
    model, _ = tiny
    p = sample.prompt
    whole = prefill(model, p.context + p.question)
    chunked = prefill(model, p.question, past=prefill(model, p.context))
    assert chunked.length == whole.length
    for a, b in zip(whole.cache.layers, chunked.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
    assert len(chunked.captures[0].hidden_states[0]) == len(p.question)  # a continuation holds its own tokens' alone
    for idx, a in enumerate(whole.captures):
        b = chunked.capture(idx)  # joined to its parent's
        torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.cos, b.cos, rtol=0, atol=0)


def test_full_decode_equals_hf_generate(tiny, sample):
    model, tokenizer = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    (ours,) = greedy_decode(model, [compress(model, base, Variant("full", "full", 1.0))], p.question + p.suffix, base.length, 12)
    ref = model.generate(torch.tensor([p.context + p.question + p.suffix]), max_new_tokens=12, do_sample=False)
    expected = ref[0, p.tokens :].tolist()
    assert ours == expected[: len(ours)]


def test_rows_cover_grid_and_bytes_are_measured(tiny, sample):
    model, tokenizer = tiny
    grid = variants(
        build({"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}}}),
        [0.5, 0.25],
    )
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic", "aware"], 4)
    assert len(rows) == 3 * 2 and {r["turn"] for r in rows} == {1} and {r["decode_batch"] for r in rows} == {3}
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
    stats = cache_stats(cache, Variant("s", "kvpress", 0.5, {"press": "SnapKVPress"}), context=20)
    assert stats["kv_bytes"] == stats["kv_bytes_formula"] == 2 * 2 * 10 * 8 * 4
    assert stats["kv_tokens_mean"] == 10.0
    assert stats["compression_vs_bf16"] == 2.0  # half the context kept, as bf16


SNAP = {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}}
STREAM = {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}}


def test_padded_rows_decode_as_if_alone(tiny, sample):
    """A short (compressed) row batched with a long one gives the logits it gives alone: padding is masked."""
    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    short = compress(model, base, Variant("s", "kvpress", 0.25, SNAP))
    full = compress(model, base, Variant("full", "full", 1.0))
    tail = torch.tensor([p.question + p.suffix])
    alone = Batch(model, [short]).forward(tail, base.length, logits_to_keep=tail.shape[1])
    together = Batch(model, [short, full]).forward(tail.expand(2, -1), base.length, logits_to_keep=tail.shape[1])
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
    unpadded = Batch(model, [full]).forward(tail, base.length, logits_to_keep=tail.shape[1])
    torch.testing.assert_close(together[1], unpadded[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(together[0], together[1], atol=1e-3)  # the rows really differ


def test_one_token_steps_without_padding_attend_without_a_mask(tiny, sample):
    """A decode step over rows that hold the same entries (copies of one cache, as the throughput benchmark
    decodes; any batch of one) passes no mask, which hides nothing there, and gives the logits the masked step
    gives; a step over padded rows, or feeding several tokens, keeps its mask."""
    from kvlab.engine import attention_layers

    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    full = compress(model, base, Variant("full", "full", 1.0))
    short = compress(model, base, Variant("s", "kvpress", 0.25, SNAP))
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, kw, out: seen.append(kw.get("attention_mask")), with_kwargs=True)
             for layer in attention_layers(model)]  # the mask each layer's attention got (after Batch's own hooks)
    try:
        tail = torch.tensor([p.question + p.suffix] * 2)
        logits = {}
        for name, caches, force in (("free", [full, full], False), ("masked", [full, full], True), ("padded", [short, full], False)):
            batch = Batch(model, caches)
            if force:
                batch.padded_rows = [True] * len(batch.padded_rows)
            x = batch.forward(tail, base.length)[:, -1].argmax(-1, keepdim=True)
            del seen[:]
            logits[name] = batch.forward(x, base.length + tail.shape[1])[:, -1]
            assert all(m is None for m in seen) == (name == "free") and len(seen) == len(attention_layers(model))
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(logits["free"], logits["masked"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,spec", [
    ("niah", {"depths": [0.3, 0.8], "samples": 2, "seed": 1}),
    ("multi_turn", {"depths": [0.4], "samples": 2, "seed": 1}),
])
def test_engine_equals_one_method_at_a_time(tiny, kind, spec):
    """All variants decoded as one batch give the same answers and KL as each variant run alone."""
    model, tokenizer = tiny
    methods = {"full": {"kind": "full"}, "snapkv": SNAP, "streaming": STREAM}
    grid = variants(build(methods), [0.5, 0.25])
    for sample in KINDS[kind].generate(kind, spec, tokenizer, 600):
        together = evaluate_sample(model, tokenizer, sample, grid, ["agnostic", "aware"], 6)
        for v in grid:
            alone = evaluate_sample(model, tokenizer, sample, [grid[0], v] if v.kind != "full" else [v], ["agnostic", "aware"], 6)
            mine = [r for r in together if (r["method"], r["budget"]) == (v.method, v.budget)]
            theirs = [r for r in alone if (r["method"], r["budget"]) == (v.method, v.budget)]
            assert [(r["question_mode"], r["turn"], r["prediction"]) for r in mine] == [
                (r["question_mode"], r["turn"], r["prediction"]) for r in theirs
            ]
            for a, b in zip(mine, theirs):
                assert a["kl_vs_full"] == pytest.approx(b["kl_vs_full"], abs=1e-6)
        turns = {r["turn"] for r in together}
        assert turns == ({1, 2} if kind == "multi_turn" else {1})


def test_kl_is_zero_for_full_and_grows_with_eviction(tiny):
    model, tokenizer = tiny
    spec = {"kind": "continuation", "samples": 1, "seed": 0, "continuation_tokens": 48}
    (sample,) = KINDS["continuation"].generate("prose", spec, tokenizer, 600)
    grid = variants(build({"full": {"kind": "full"}, "streaming": STREAM}), [0.5, 0.1])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 4)
    kl = {r["budget"]: r["kl_vs_full"] for r in rows}
    assert kl[1.0] == pytest.approx(0.0, abs=1e-7)
    assert 0 < kl[0.5] < kl[0.1]
    assert all(r["tf_tokens"] == 48 and r["prediction"] == "" and r["new_tokens"] == 0 for r in rows)
    assert rows[0]["ppl"] == pytest.approx(torch.tensor(rows[0]["nll"]).exp().item(), rel=1e-5)


def test_question_first_modes_share_one_computation(tiny):
    model, tokenizer = tiny
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 0, "question_position": "before"}
    (sample,) = KINDS["niah"].generate("qfirst", spec, tokenizer, 600)
    rows = evaluate_sample(model, tokenizer, sample, variants(build({"full": {"kind": "full"}, "snapkv": SNAP}), [0.5]), ["agnostic", "aware"], 4)
    agnostic = [r for r in rows if r["question_mode"] == "agnostic"]
    aware = [r for r in rows if r["question_mode"] == "aware"]
    assert [{**r, "question_mode": "x"} for r in agnostic] == [{**r, "question_mode": "x"} for r in aware]


@pytest.mark.parametrize("with_mask", [True, False])
def test_gqa_attention_equals_transformers_sdpa(tiny, with_mask):
    """Our SDPA (K/V heads shared inside the kernel) returns what transformers' sdpa (K/V repeated) does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvlab.engine import attention_layers, sdpa_gqa

    module = attention_layers(tiny[0])[0]  # 4 query heads over 2 KV heads
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g)
    mask = None
    if with_mask:
        mask = torch.zeros(3, 1, 5, 9)
        mask[0, :, :, 2:4] = torch.finfo(torch.float32).min
    else:
        k, v = k[:, :, :5], v[:, :, :5]
    ours, _ = sdpa_gqa(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_heads", [None, 1, 4])
@pytest.mark.parametrize("n", [1, 3])
def test_grouped_heads_equal_transformers_sdpa(tiny, mask_heads, n):
    """The 16-bit CPU path folds each KV head's query heads into the query axis; in fp32 (called directly) it
    returns what transformers' sdpa does, with no mask, a mask per row, and a mask per query head (AdaKV)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvlab.engine import attention_layers
    from kvlab.engine.attention import _grouped

    module = attention_layers(tiny[0])[0]  # 4 query heads over 2 KV heads
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, n, 16, generator=g), torch.randn(3, 2, 11, 16, generator=g), torch.randn(3, 2, 11, 16, generator=g)
    mask = None
    if mask_heads:
        mask = torch.zeros(3, mask_heads, n, 11)
        mask[0, :, :, 2:4] = torch.finfo(torch.float32).min
        mask[1, -1, :, 5:9] = torch.finfo(torch.float32).min  # per query head: only the last head's keys hidden
    module.is_causal = False  # no mask means "see everything" here (a one-token step)
    try:
        theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    finally:
        module.is_causal = True
    ours = _grouped(q, k, v, mask, 0.0, 0.25)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_sdpa_gqa_folds_heads_in_bf16_on_the_cpu(tiny):
    """bf16 queries on the CPU take the folded path (one KV block per group, not per query head), and its result
    is the fp32 attention of the same bf16 inputs, rounded to bf16; fp32 and causal prefills keep the plain call."""
    from kvlab.engine import attention_layers, sdpa_gqa
    from kvlab.engine.attention import grouped_heads

    module = attention_layers(tiny[0])[0]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, t, 16, generator=g).bfloat16() for h, t in ((4, 1), (2, 40), (2, 40)))
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bfloat16)
    mask[1, :, :, :30] = torch.finfo(torch.bfloat16).min
    assert grouped_heads(q, k, causal=False) and not grouped_heads(q.float(), k.float(), causal=False)
    assert not grouped_heads(torch.randn(1, 4, 8, 16).bfloat16(), k, causal=True)
    ours, _ = sdpa_gqa(module, q, k, v, mask, scaling=0.25)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.25, enable_gqa=True).transpose(1, 2)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), exact, rtol=2 ** -8, atol=1e-3)  # one bf16 rounding of the output


def test_a_mask_layers_share_is_folded_once_per_pass(tiny):
    """Within a forward pass (`reading`), layers handed the same mask reuse its copy folded for grouped heads, and
    each layer's result is bitwise what folding it alone gives; a layer that restricts its keys (block-sparse) folds
    its own mask; nothing is kept once the pass ends."""
    from kvlab.engine import attention_layers, sdpa_gqa
    from kvlab.engine import attention as attn

    module = attention_layers(tiny[0])[0]
    g = torch.Generator().manual_seed(4)
    mask = torch.zeros(3, 1, 5, 40, dtype=torch.bfloat16)
    mask[1, :, :, :30] = torch.finfo(torch.bfloat16).min
    mask[2, :, :, 20:] = torch.finfo(torch.bfloat16).min
    layers = [tuple(torch.randn(3, h, t, 16, generator=g).bfloat16() for h, t in ((4, 5), (2, 40), (2, 40))) for _ in range(3)]
    alone = [sdpa_gqa(module, q, k, v, mask, scaling=0.25)[0] for q, k, v in layers]
    folds = []
    real = attn._grouped

    def counted(*args, **kwargs):
        folds.append(kwargs.get("shared"))
        return real(*args, **kwargs)

    with attn.reading(None):
        memo = attn._FOLDED.get()
        attn._grouped = counted
        try:
            shared = [sdpa_gqa(module, q, k, v, mask, scaling=0.25)[0] for q, k, v in layers]
        finally:
            attn._grouped = real
        assert len(memo) == 1 and folds == [True] * 3  # one folded copy for three layers
        own = torch.ones(3, 2, 5, 40, dtype=torch.bool)
        own[:, :, :, 35:] = False  # a layer restricting its keys gets a mask of its own, never the shared copy
        restricted = attn.restricted
        attn.restricted = lambda module, query, key, mask: mask.masked_fill(~own.repeat_interleave(2, dim=1), torch.finfo(mask.dtype).min)
        try:
            sdpa_gqa(module, *layers[0], mask, scaling=0.25)
        finally:
            attn.restricted = restricted
        assert len(memo) == 1
    assert attn._FOLDED.get() is None
    for ours, theirs in zip(shared, alone):
        assert torch.equal(ours, theirs)


def test_growing_layer_appends_in_place_as_concatenation_would():
    """Batch's dense layers append into room they hold (no copy of the cache per step); what they hold equals
    DynamicLayer's concatenation through growth past the room, dropped rows and a crop."""
    from transformers.cache_utils import DynamicLayer

    from kvlab.engine.layers import Growing

    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, 2, 5, 4, generator=g) for _ in range(3)]
    grown, plain = Growing(rows, [r + 1 for r in rows]), DynamicLayer()
    plain.update(torch.cat(rows), torch.cat(rows) + 1)
    storage = grown._keys.data_ptr()
    for step in range(grown.room + 10):  # past the first room: it grows once
        new = torch.randn(3, 2, 1 if step % 7 else 3, 4, generator=g)
        keys, values = grown.update(new, -new)
        plain.update(new, -new)
        assert torch.equal(keys, plain.keys) and torch.equal(values, plain.values)
        if step == 0:
            assert grown._keys.data_ptr() == storage  # written in place
    grown.keep([2, 0])
    plain.batch_select_indices(torch.tensor([2, 0]))
    keys, _ = grown.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    plain.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert torch.equal(keys, plain.keys) and grown.get_seq_length() == plain.get_seq_length()
    grown.crop(7)
    plain.crop(7)
    assert torch.equal(grown.keys, plain.keys) and torch.equal(grown.values, plain.values)


def test_multi_turn_mode_asks_a_later_question_on_the_aware_cache(tiny):
    """multi_turn rows are the later turns decoded on the cache compressed together with the first question;
    aware rows are that question's own turn; agnostic rows every turn on the context-only cache."""
    model, tokenizer = tiny
    spec = {"kind": "multi_turn", "depths": [0.4], "samples": 1, "seed": 2}
    (sample,) = KINDS["multi_turn"].generate("mt", spec, tokenizer, 600)
    grid = variants(build({"full": {"kind": "full"}, "snapkv": SNAP}), [0.25])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic", "aware", "multi_turn"], 6)
    assert sorted({(r["question_mode"], r["turn"]) for r in rows}) == [("agnostic", 1), ("agnostic", 2), ("aware", 1), ("multi_turn", 2)]
    p = sample.prompt
    aware = prefill(model, p.question, past=prefill(model, p.context))
    caches = [compress(model, aware, v) for v in grid]
    second = p.suffix + p.followups[0].ids
    expected = greedy_decode(model, caches, second, aware.length, 6)
    got = [r["prediction"] for r in rows if r["question_mode"] == "multi_turn"]
    assert got == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    alone = evaluate_sample(model, tokenizer, sample, grid, ["multi_turn"], 6)
    assert [r["prediction"] for r in alone] == got and {r["compressed_tokens"] for r in alone} == {aware.length}
    (niah,) = KINDS["niah"].generate("n", {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 0}, tokenizer, 600)
    assert evaluate_sample(model, tokenizer, niah, grid, ["multi_turn"], 4) == []  # no later turn to ask


def test_rerotated_rows_decode_from_the_kept_length(tiny, sample):
    """KeyRerotationPress re-rotates kept keys to positions 0…n-1; the batch then feeds the question at n…
    (as kvpress's pipeline does), which equals decoding kvpress's hook-compressed cache by hand from n."""
    model, _ = tiny
    p = sample.prompt
    spec = {**STREAM, "wrapper": "KeyRerotationPress"}
    variant = Variant("stream_rerot", "kvpress", 0.25, spec)
    assert variant.rerotates
    base = prefill(model, p.context)
    ours = compress(model, base, variant)
    n = int(base.length * 0.25)
    assert ours.position_shift == n - base.length
    full = compress(model, base, Variant("full", "full", 1.0))
    tail = p.question + p.suffix
    (mine, _) = greedy_decode(model, [ours, full], tail, base.length, 6)
    cache = hook_compressed(model, variant.make_press(), p.context)
    x, pos, ref = torch.tensor([tail]), n, []
    with torch.no_grad():
        for _ in range(len(mine)):
            logits = model(input_ids=x, past_key_values=cache, position_ids=torch.arange(pos, pos + x.shape[1])[None]).logits
            pos += x.shape[1]
            ref.append(int(logits[0, -1].argmax()))
            x = torch.tensor([[ref[-1]]])
    assert mine == ref
    unrotated = compress(model, base, Variant("stream", "kvpress", 0.25, STREAM))
    assert not torch.allclose(unrotated.layers[0].keys, ours.layers[0].keys)  # the rotation really changed keys


def test_masking_press_frees_nothing_and_hides_per_head(tiny, sample):
    """AdaKV masks keys per head instead of evicting: every token stays stored (bytes of the full cache), the
    kept count per (layer, KV head) varies but sums to the budget, and decoding equals kvpress's own
    patched attention on its hook-compressed cache."""
    model, _ = tiny
    p = sample.prompt
    spec = {**SNAP, "wrapper": "AdaKVPress"}
    variant = Variant("ada", "kvpress", 0.25, spec)
    base = prefill(model, p.context)
    ours = compress(model, base, variant)
    full = compress(model, base, Variant("full", "full", 1.0))
    stats, full_stats = cache_stats(ours, variant, base.length), cache_stats(full, Variant("full", "full", 1.0), base.length)
    assert stats["kv_bytes"] == full_stats["kv_bytes"] and stats["kv_tokens_mean"] == base.length
    heads = model.config.num_key_value_heads
    kept = stats["kv_kept_heads"]
    assert len(kept) == model.config.num_hidden_layers * heads
    for layer in range(model.config.num_hidden_layers):
        assert sum(kept[layer * heads : (layer + 1) * heads]) == heads * int(base.length * 0.25)
    assert stats["kv_kept_mean"] == int(base.length * 0.25) and len(set(kept)) > 1
    tail = torch.tensor([p.question + p.suffix])
    mine = Batch(model, [ours, full]).forward(tail.expand(2, -1), base.length)[0, -1]
    # kvpress's path: hooks during an sdpa prefill, then its patched attention hides the masked keys
    model.config._attn_implementation = "sdpa"
    try:
        cache = hook_compressed(model, variant.make_press(), p.context)
        with torch.no_grad():  # one token at a time: kvpress's fake key must cancel every query it serves
            for i in range(tail.shape[1]):
                ref = model(input_ids=tail[:, i : i + 1], past_key_values=cache, position_ids=torch.tensor([[base.length + i]])).logits[0, -1]
    finally:
        model.config._attn_implementation = "kvlab_sdpa_gqa"
        for module in model.model.layers:
            module.self_attn.masked_key_indices = None
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)
    dense = Batch(model, [full]).forward(tail, base.length)[0, -1]
    assert not torch.allclose(mine, dense, atol=1e-3)  # the mask really hid entries


def test_masked_rows_batched_with_quantized_rows_decode_as_alone(tiny, sample):
    """When a layer holds a quantized row, every row of it is batched row by row (engine.PerRowLayer); an AdaKV row
    there still hides its masked keys: its logits equal those of the AdaKV row batched alone."""
    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    ada = compress(model, base, Variant("ada", "kvpress", 0.25, {**SNAP, "wrapper": "AdaKVPress"}))
    int8 = {"scheme": "int8", "bits": 8, "group": 16, "residual": 0, "key_axis": "channel", "value_axis": "token"}
    quant = compress(model, base, Variant("int8", "quant", 1.0, int8))
    full = compress(model, base, Variant("full", "full", 1.0))
    tail = torch.tensor([p.question + p.suffix])
    alone = Batch(model, [ada]).forward(tail, base.length)[0, -1]
    batch = Batch(model, [ada, quant, full])
    assert batch.stepwise
    mixed = batch.forward(tail.expand(3, -1), base.length)
    torch.testing.assert_close(mixed[0, -1], alone, rtol=1e-4, atol=1e-4)
    dense = Batch(model, [full]).forward(tail, base.length)[0, -1]
    torch.testing.assert_close(mixed[2, -1], dense, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(alone, dense, atol=1e-3)


def test_copies_of_one_quantized_cache_are_stacked_and_decode_as_one(tiny, sample, monkeypatch):
    """A batch of one quantized cache (the throughput benchmark's) is one stacked layer per layer: a step
    updates it once and the decode kernel attends to all rows in one call. Every row decodes as the cache
    alone, on the dequantizing path and through the kernel (interpreted here), also after rows are dropped."""
    from kvlab.engine import PerRowLayer, greedy_decode
    from kvlab.kernels import decode_attention

    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    kivi = {"scheme": "kivi", "bits": 4, "group": 8, "residual": 8, "key_axis": "channel", "value_axis": "token"}
    cache = compress(model, base, Variant("kivi4", "quant", 1.0, kivi))
    other = compress(model, base, Variant("kivi4", "quant", 1.0, kivi))  # same content, another storage
    layer = next(x for x in Batch(model, [cache, cache, cache]).cache.layers if isinstance(x, PerRowLayer))
    assert layer.sizes == [3] and layer.rows[0].keys.shape[0] == 3
    assert [len(x.rows) for x in Batch(model, [cache, other]).cache.layers if isinstance(x, PerRowLayer)][0] == 2
    tail = p.question + p.suffix
    for fused in (False, True):
        monkeypatch.setattr(decode_attention, "FUSED", fused)
        (alone,) = greedy_decode(model, [cache], tail, base.length, 12, stop=False)
        assert greedy_decode(model, [cache] * 3, tail, base.length, 12, stop=False) == [alone] * 3
        batch = Batch(model, [cache] * 3)
        x = torch.tensor([tail] * 3)
        for step in range(4):
            nxt = batch.forward(x, base.length + (0 if step == 0 else len(tail) + step - 1))[:, -1].argmax(-1)
            assert nxt.tolist() == [alone[step]] * len(nxt)
            if step == 1:
                batch.keep([0, 2])
                nxt = nxt[[0, 2]]
                assert [x.sizes for x in batch.cache.layers if isinstance(x, PerRowLayer)][0] == [2]
            x = nxt[:, None]


GRAPH_VARIANTS = {
    "full": ("full", {}),
    "kivi4": ("quant", {"scheme": "kivi", "bits": 4, "group": 32, "residual": 32, "key_axis": "channel", "value_axis": "token"}),
    # residual 0: every step quantizes its token inside the captured graph
    "int8": ("quant", {"scheme": "int8", "bits": 8, "group": 16, "residual": 0, "key_axis": "channel", "value_axis": "token"}),
}


def test_only_steps_that_wait_for_nothing_on_the_host_can_be_captured(tiny, sample, monkeypatch):
    """engine.host_free_step: dense caches, and quantized ones while the decode kernel reads them; not H2O, whose
    rows are masked from host-side lengths at every step."""
    from kvlab.engine import host_free_step
    from kvlab.kernels import decode_attention

    model, _ = tiny
    base = prefill(model, sample.prompt.context)
    caches = {name: compress(model, base, Variant(name, kind, 1.0, params)) for name, (kind, params) in GRAPH_VARIANTS.items()}
    caches["h2o"] = compress(model, base, Variant("h2o", "h2o", 0.5, {"recent": 0.5}))
    for fused in (True, False):
        monkeypatch.setattr(decode_attention, "FUSED", fused)
        free = {name: host_free_step([cache, cache], model.device) for name, cache in caches.items()}
        assert free == {"full": True, "kivi4": fused, "int8": fused, "h2o": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", sorted(GRAPH_VARIANTS))
def test_a_decode_step_replayed_from_a_cuda_graph_computes_the_eager_step(tiny_dir, sample, name):
    """benchmark.graph_step captures the fourth decode step of a batch (quantized rows through the kernel) and
    times its replays: seconds per replay, so the replays' seconds lie within the call's own wall time (warm-up,
    capture and all); what the replays compute is the token eager decoding gives at that step."""

    from kvlab.steps.benchmark import graph_step
    from kvlab.engine import greedy_decode

    from kvlab.steps.evaluate import load_model

    model = load_model(tiny_dir, "float32", "cuda", verify=False)[0]
    p = sample.prompt
    base = prefill(model, p.context)
    kind, params = GRAPH_VARIANTS[name]
    cache = compress(model, base, Variant(name, kind, 1.0, params))
    replays = 3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seconds, tokens = graph_step(model, [cache] * 2, p.question + p.suffix, base.length, replays)
    wall = time.perf_counter() - t0  # graph_step synchronizes before it returns
    eager = greedy_decode(model, [cache] * 2, p.question + p.suffix, base.length, 4, stop=False)
    assert 0 < seconds * replays <= wall and tokens == [row[3] for row in eager]


def test_masking_press_refuses_quantization(tiny, sample):
    model, _ = tiny
    spec = {"press": "SnapKVPress", "kwargs": {"window_size": 16}, "wrapper": "AdaKVPress", "scheme": "int8", "bits": 8,
            "group": 16, "residual": 0, "key_axis": "channel", "value_axis": "token"}
    with pytest.raises(ValueError, match="masks keys instead of evicting"):
        compress(model, prefill(model, sample.prompt.context), Variant("ada_int8", "quant", 0.25, spec))


def configured_eviction_methods() -> dict:
    """Every evicting method of config.yaml's presets that needs no calibration table, by preset/name."""
    import yaml

    from kvlab.state.config import resolve
    from kvlab.methods import Method

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "config.yaml").read_text())
    out = {}
    for preset in ("default", "smoke"):
        config = resolve({**raw, "preset": preset}, root / "workflow" / "config.schema.yaml")
        for name, spec in config["methods"].items():
            # block_sparse keeps everything (its budget is what a step reads), prompt_compression's budget is a
            # share of the user's text and mikv keeps every token (its budget is the full-precision share): each
            # has its own tests (test_block_sparse, test_prompt_compression, test_mikv)
            method = Method(name, spec)
            if method.evicts and spec["kind"] not in ("block_sparse", "prompt_compression", "mikv") and not method.uses_calibration():
                out[f"{preset}/{name}"] = spec
    return out


@pytest.mark.parametrize("name,spec", configured_eviction_methods().items())
def test_every_configured_eviction_method_keeps_its_budget_and_window(tiny, sample, name, spec):
    """On the tiny model, at each budget: every (layer, KV head) keeps at least one token; the kept count is
    the budget's (per layer, or in total for PyramidKV's per-layer split and AdaKV's per-head split); the
    observation window (SnapKV family) or the sinks and recent tokens (StreamingLLM) are never evicted."""
    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context + p.question)
    t, layers = base.length, model.config.num_hidden_layers
    full = base.cache.layers
    for budget in (0.5, 0.25, 0.1):
        variant = Variant(name, spec["kind"], budget, {k: v for k, v in spec.items() if k not in ("kind", "tasks")})
        cache = compress(model, base, variant)
        stats = cache_stats(cache, variant, t)
        assert stats["kv_kept_min"] >= 1
        n = max(1, int(t * budget))
        kept = stats["kv_kept_heads"]
        heads = len(kept) // layers
        if spec.get("press") == "PyramidKVPress" or spec.get("wrapper") == "AdaKVPress":
            assert abs(sum(kept) - layers * heads * n) <= layers * heads  # rounding of the per-layer split
        else:
            assert kept == [n] * len(kept)
        if spec["kind"] != "kvpress" or spec.get("wrapper") in ("KeyRerotationPress", "AdaKVPress"):
            continue  # re-rotated keys differ from the prefill's; masked ones are all still stored
        window = spec["kwargs"].get("window_size")
        sinks = spec["kwargs"].get("n_sink")
        for ours, ref in zip(cache.layers, full):
            held = ours.keys.shape[-2]
            if window is not None:
                assert kept_rows(ours.keys, ref.keys[..., t - min(window, held) :, :])
            if sinks is not None:  # presses keep top-k, not in order: compare as sets of key vectors per head
                assert kept_rows(ours.keys, ref.keys[..., :sinks, :])
                assert kept_rows(ours.keys, ref.keys[..., t - (held - sinks) :, :])


def kept_rows(keys: torch.Tensor, wanted: torch.Tensor) -> bool:
    """Whether every key vector of `wanted` (1, H, w, D) is among `keys` (1, H, n, D), head by head."""
    return bool((keys[..., None, :, :] == wanted[..., :, None, :]).all(-1).any(-1).all())


def test_layer_budgets_average_the_budget_and_follow_the_weights():
    from kvlab.methods import layer_budgets

    b = layer_budgets(0.25, [1.0, 3.0, 2.0, 2.0], [False] * 4)
    assert b == pytest.approx([0.125, 0.375, 0.25, 0.25])
    capped = layer_budgets(0.5, [1.0, 10.0, 1.0, 5.0], [False, False, False, True])  # layer 3 is sliding: left alone
    assert capped[1] == 1.0 and capped[3] == 1.0 and capped[0] == capped[2] == pytest.approx(0.25)
    assert sum(capped[:3]) / 3 == pytest.approx(0.5)


def test_calibrated_layer_budgets_keep_more_where_the_weight_is_higher(tiny, sample):
    model, _ = tiny
    base = prefill(model, sample.prompt.context)
    spec = {**SNAP, "layer_budgets": [0.5, 1.5]}  # what with_calibration reads from layer_budget.parquet
    cache = compress(model, base, Variant("snap_cal", "kvpress", 0.25, spec))
    kept = [layer.keys.shape[-2] for layer in cache.layers]
    assert kept == [int(base.length * 0.125), int(base.length * 0.375)]


VERIFY_METHODS = {
    "full": {"kind": "full"}, "snapkv": SNAP, "streaming": STREAM, "h2o": {"kind": "h2o", "recent": 0.5},
    "kivi2": {"kind": "quant", "scheme": "kivi", "bits": 2, "group": 8, "residual": 8, "key_axis": "channel",
              "value_axis": "token"},
    "int8": {"kind": "quant", "scheme": "int8", "bits": 8, "group": 16, "residual": 0, "key_axis": "channel",
             "value_axis": "token"},
}


def divergence(logp: torch.Tensor, path: list[int], ref: int) -> list[dict]:
    """forced_divergence's columns from a whole (B, T, V) block of log-probabilities (teacher_forced's): per row, the
    mean and max per-token KL(row `ref` ‖ row) and the mean NLL of `path`, the KL terms by the engine's own kernel."""
    from kvlab.engine.teacher import _divergence_rows, _kl_terms

    p_ref = logp[ref].exp()
    scratch = torch.empty_like(p_ref)
    kl = torch.stack([_kl_terms(logp[ref], p_ref, row, scratch) for row in logp]).clamp_min(0)  # (B, T)
    target = torch.tensor(path, device=logp.device)
    nll = -logp.gather(-1, target.expand(logp.shape[0], -1)[..., None])[..., 0]  # (B, T)
    return _divergence_rows(kl, nll, path)


def verified_decode(model, caches, ref, tail, start, max_new_tokens):
    """The product's verified decoding of one turn: `verify`, then its diverged rows decoded (`decode_diverged`)."""
    from kvlab.engine import decode_diverged, verify

    run = verify(model, caches, ref, tail, start, max_new_tokens)
    decode_diverged(model, [run])
    return run


def verified_run(tokenizer, model, seed: int, budgets: list[float], methods: dict = VERIFY_METHODS) -> dict:
    """Decode one sample's grid both ways and check verified decoding against decoding every row; return each
    variant's first divergence."""
    from kvlab.engine import first_divergence, teacher_forced

    grid = variants(build(methods), budgets)
    (sample,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": seed}, tokenizer, 600)
    base = prefill(model, sample.prompt.context)
    caches = [compress(model, base, v) for v in grid]
    tail, ref = sample.prompt.question + sample.prompt.suffix, 0
    every = greedy_decode(model, caches, tail, base.length, 12)
    run = verified_decode(model, caches, ref, tail, base.length, 12)
    assert run.answers == every
    logp, choice = teacher_forced(model, caches, tail, every[ref], base.length)
    assert torch.equal(run.logp_ref, logp[ref]) and run.divergence == divergence(logp, every[ref], ref)
    assert run.first == first_divergence(choice, every[ref])
    assert run.first[ref] is None  # the full row's parallel pass agrees with its own decoding (fp32)
    assert all(every[i] == every[ref] for i, d in enumerate(run.first) if d is None)
    diverged = [i for i, d in enumerate(run.first) if d is not None]
    assert all(every[i][: run.first[i]] == every[ref][: run.first[i]] for i in diverged)
    assert all(every[i][run.first[i]] != every[ref][run.first[i]] for i in diverged)
    return {v.label: d for v, d in zip(grid, run.first)}


def test_verified_decoding_gives_every_row_its_own_greedy_answer(tiny, sharp):
    """Verified decoding decodes only the rows that leave the full cache's answer; every row's answer is the one
    decoding all rows step by step gives. The cases cover rows that never diverge, stepwise rows (quantized, H2O)
    that diverge, and dense rows that all diverge only after a shared prefix (fed at once), also in grids of
    dense rows alone."""
    first = {}
    for seed in (1, 2):
        for budgets in ([0.5, 0.1], [0.9]):
            for label, d in verified_run(tiny[1], sharp, seed, budgets).items():
                first.setdefault(label, []).append(d)
    assert any(d is None for label, ds in first.items() if label != "full" for d in ds)
    assert any(d is not None for d in first["kivi2"])
    dense = {name: VERIFY_METHODS[name] for name in ("full", "snapkv", "streaming")}
    shared = []  # dense rows are decoded from the prefix they all share
    for seed in (1, 2):
        run = verified_run(tiny[1], sharp, seed, [0.9], dense)
        shared.append(min((d for d in run.values() if d is not None), default=0))
    assert max(shared) > 0


def test_first_divergence_finds_the_first_other_choice():
    from kvlab.engine import first_divergence

    choice = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 2], [5, 6, 8]])
    assert first_divergence(choice, [5, 6, 7]) == [None, 1, 0, 2]


def test_divergence_is_kl_and_nll_per_row_against_the_reference_row():
    """The KL and NLL columns (the engine's `_kl_terms` and `_divergence_rows`, as `divergence` above applies them)
    row by row: KL equals KL(ref || row) from scipy, and NLL the path's mean -log p."""
    from scipy.special import rel_entr

    gen = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(3, 4, 11, generator=gen, dtype=torch.float64), -1)
    path = [2, 7, 0, 10]
    rows = divergence(logp, path, ref=1)
    p = logp.exp().numpy()
    for b, row in enumerate(rows):
        kl = rel_entr(p[1], p[b]).sum(-1)
        assert row["kl_vs_full"] == pytest.approx(kl.mean(), abs=1e-12) and row["kl_max"] == pytest.approx(kl.max(), abs=1e-12)
        assert row["nll"] == pytest.approx(-float(sum(logp[b, t, tok] for t, tok in enumerate(path))) / 4, abs=1e-12)
    assert rows[1]["kl_vs_full"] == 0.0


def test_references_of_several_prompts_decode_as_one_batch(tiny, sharp):
    """decode_references: full caches of different prompts (different lengths, tails and positions) decoded
    together give each one's own greedy answer; the logits kept for the rows asked are those each step chose its
    token from: the cache stepped along its own answer (`stepped`, alone: rounding only)."""
    from kvlab.engine import decode_references, stepped

    tokenizer = tiny[1]
    requests = []
    for seed, ctx in ((1, 500), (2, 620), (3, 560)):
        (s,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": seed}, tokenizer, ctx)
        base = prefill(sharp, s.prompt.context)
        requests.append((base.cache, s.prompt.question + s.prompt.suffix, base.length))
    together, kept = decode_references(sharp, requests, 12, keep={0, 2})
    alone = [greedy_decode(sharp, [cache], tail, start, 12)[0] for cache, tail, start in requests]
    assert together == alone and len({tuple(a) for a in alone}) == 3
    assert set(kept) == {0, 2}
    for i in kept:
        cache, tail, start = requests[i]
        ((logp, choice),) = stepped(sharp, [(cache, tail, together[i], start)])
        assert kept[i].shape == (len(together[i]), sharp.config.vocab_size)
        assert kept[i].argmax(-1).tolist() == together[i] == choice.tolist()
        # rounding only, at the file's batched-against-alone tolerance: log-probs reach ~10, and a GEMM blocked by
        # its row count (AMX Xeon: 3 rows against 1) moves them by a few fp32 ulps of that (1.05e-5 seen)
        torch.testing.assert_close(torch.log_softmax(kept[i].float(), -1), logp, rtol=1e-5, atol=1e-5)
    assert decode_references(sharp, requests, 12)[1] == {}


def test_samples_evaluated_together_give_their_rows_alone(tiny, sharp, monkeypatch):
    """evaluate_samples over several samples (references decoded as one batch, then the rows that leave them, of
    every sample, as one batch per kind) gives each sample's rows as evaluating it alone does, apart from the time
    columns and the noise floor's KL, whose steps run in a batch of every sample's full rows: another batch
    composition, rounding only."""
    from kvlab.engine import evaluate_samples

    tokenizer = tiny[1]
    grid = variants(build({"full": {"kind": "full"}, "snapkv": SNAP, "kivi2": VERIFY_METHODS["kivi2"]}), [0.5])
    samples = KINDS["multi_turn"].generate("multi_turn", {"depths": [0.3, 0.7], "samples": 1, "seed": 4}, tokenizer, 600)
    timing = ["prefill_s", "compress_s", "decode_s", "teacher_forced_s", "noise_s"]
    together = evaluate_samples(sharp, tokenizer, samples, grid, ["agnostic", "aware", "multi_turn"], 8)
    alone = [r for s in samples for r in evaluate_sample(sharp, tokenizer, s, grid, ["agnostic", "aware", "multi_turn"], 8)]
    assert len(samples) == 2 and {r["turn"] for r in together} == {1, 2}
    together, alone = pd.DataFrame(together), pd.DataFrame(alone)
    for frame in (together, alone):
        full = frame[frame["method"] == "full"]
        assert full["noise_kl"].notna().all() and (full["noise_kl_max"] < 1e-6).all()
    floor = ["noise_kl", "noise_kl_max"]
    pd.testing.assert_frame_equal(together.drop(columns=timing + floor), alone.drop(columns=timing + floor))
    # rows of both samples left the full answer: their decoding ran as one batch across samples
    left = together[(together["method"] != "full") & together["diverged_at"].notna()]
    assert left["sample_id"].nunique() == 2 and left["method"].nunique() == 2
    # with no room for waiting caches, each sample's diverged rows decode as soon as it is verified: the same rows
    tuned(monkeypatch, sharp, diverged_bytes=0)
    each = pd.DataFrame(evaluate_samples(sharp, tokenizer, samples, grid, ["agnostic", "aware", "multi_turn"], 8))
    pd.testing.assert_frame_equal(each.drop(columns=timing + floor), together.drop(columns=timing + floor))


def test_noise_floor_only_on_the_first_samples_asked(tiny, sharp):
    """noise_samples=1: the first sample's full rows carry the noise floor, the second sample's none; every other
    column is as measuring it everywhere gives."""
    from kvlab.engine import evaluate_samples

    tokenizer = tiny[1]
    grid = variants(build({"full": {"kind": "full"}, "snapkv": SNAP}), [0.5])
    samples = KINDS["niah"].generate("niah_single", {"depths": [0.3, 0.7], "samples": 1, "seed": 5}, tokenizer, 600)
    noise = ["noise_kl", "noise_kl_max", "noise_diverged_at", "noise_s"]
    timing = ["prefill_s", "compress_s", "decode_s", "teacher_forced_s"]
    every = pd.DataFrame(evaluate_samples(sharp, tokenizer, samples, grid, ["agnostic"], 8))
    first = pd.DataFrame(evaluate_samples(sharp, tokenizer, samples, grid, ["agnostic"], 8, Reading(noise_samples=1)))
    measured = first[first["noise_kl"].notna()]
    assert set(measured["sample_id"]) == {samples[0].row()["sample_id"]} and set(measured["method"]) == {"full"}
    assert every.loc[every["method"] == "full", "noise_kl"].notna().sum() == 2
    pd.testing.assert_frame_equal(first.drop(columns=timing + noise), every.drop(columns=timing + noise))
    none = pd.DataFrame(evaluate_samples(sharp, tokenizer, samples, grid, ["agnostic"], 8, Reading(noise_samples=0)))
    assert none[noise].isna().all().all()


def test_noise_floor_is_the_full_row_teacher_forced_alone(tiny, sharp):
    """The full row's noise columns: the full cache teacher-forced again one token at a time against its one
    pass in the batch of every row, as computed by hand from the engine's parts; empty on every other row.
    Rounding only: small in fp32, the same answer, and exactly nothing when the steps are compared with
    themselves."""
    from kvlab.engine import noise_floor, stepped

    tokenizer = tiny[1]
    grid = variants(build({"full": {"kind": "full"}, "snapkv": SNAP, "kivi2": VERIFY_METHODS["kivi2"]}), [0.5])
    (sample,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": 1}, tokenizer, 600)
    rows = evaluate_sample(sharp, tokenizer, sample, grid, ["agnostic"], 8)
    full = next(r for r in rows if r["method"] == "full")
    assert all(r["noise_kl"] is None and r["noise_diverged_at"] is None for r in rows if r["method"] != "full")
    base = prefill(sharp, sample.prompt.context)
    caches = [compress(sharp, base, v) for v in grid]
    tail = sample.prompt.question + sample.prompt.suffix
    run = verified_decode(sharp, caches, 0, tail, base.length, 8)
    ((alone, choice),) = stepped(sharp, [(caches[0], tail, run.answers[0], base.length)])
    kl = (run.logp_ref.exp() * (run.logp_ref - alone)).sum(-1).clamp_min(0)
    assert full["noise_kl"] == pytest.approx(float(kl.mean()), abs=1e-12)
    assert full["noise_kl_max"] == pytest.approx(float(kl.max()), abs=1e-12)
    assert 0 <= full["noise_kl"] <= full["noise_kl_max"] < 1e-6 and full["noise_diverged_at"] is None
    assert choice.tolist() == run.answers[0]
    (itself,) = noise_floor(sharp, [(caches[0], tail, run.answers[0], base.length, alone)])
    assert itself["noise_kl"] == 0 and itself["noise_kl_max"] == 0 and itself["noise_diverged_at"] is None
    assert full["noise_diverged_at"] == full["diverged_at"]  # a verified turn: where the one pass leaves the steps


def test_stepped_noise_is_the_noise_floor_of_steps_already_taken():
    """A verified turn's noise columns from its own decoding's logits: the KL against the one pass as noise_floor
    computes it, and the answer change where the one pass's choice leaves the steps' (which are the path)."""
    from kvlab.engine.floors import _against, stepped_noise

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g)
    path = logits.argmax(-1).tolist()  # the steps' own greedy answer
    logp_ref = torch.log_softmax(logits + 0.3 * torch.randn(6, 11, generator=g), -1)
    got = stepped_noise(logp_ref, logits, 4)
    want = _against("noise", logp_ref, torch.log_softmax(logits, -1), logits.argmax(-1), path)
    assert got["noise_kl"] == want["noise_kl"] > 0 and got["noise_kl_max"] == want["noise_kl_max"]
    assert want["noise_diverged_at"] is None and got["noise_diverged_at"] == 4
    assert stepped_noise(logp_ref, logits, None)["noise_diverged_at"] is None


def test_dtype_floor_reads_the_full_path_in_another_dtype(tiny, tiny_dir, sharp):
    """The compute dtype's noise floor: the full rows of the first `other_samples` samples read again in one plain
    forward pass by the model in another dtype. Given the run's own fp32 model, that pass is the engine's up to the
    rounding of another chunking (KL < 1e-6, the same answers), on the first turn of both modes and on the second
    turn (so the tokens fed before each path are the right ones: a missing turn would change the logits); given a
    bf16 copy, the KL is far above that and the rows name the dtype. Other rows, and later samples, stay empty."""

    from kvlab.engine import evaluate_samples

    tokenizer = tiny[1]
    grid = variants(build({"full": {"kind": "full"}, "snapkv": SNAP}), [0.5])
    samples = KINDS["multi_turn"].generate("multi_turn", {"depths": [0.3, 0.7], "samples": 1, "seed": 4}, tokenizer, 600)
    modes = ["agnostic", "aware", "multi_turn"]
    columns = ["noise_dtype", "dtype_noise_kl", "dtype_noise_kl_max", "dtype_noise_diverged_at", "dtype_noise_s"]
    same = pd.DataFrame(evaluate_samples(sharp, tokenizer, samples, grid, modes, 8, Reading(noise_samples=0, other=sharp, other_samples=1)))
    measured = same[same["dtype_noise_kl"].notna()]
    assert set(measured["method"]) == {"full"} and set(measured["sample_id"]) == {samples[0].sample_id}
    assert sorted(zip(measured["question_mode"], measured["turn"])) == [("agnostic", 1), ("agnostic", 2), ("aware", 1), ("multi_turn", 2)]
    assert (measured["dtype_noise_kl_max"] < 1e-6).all() and measured["dtype_noise_diverged_at"].isna().all()
    assert set(measured["noise_dtype"]) == {"float32"}
    assert same.drop(measured.index)[columns].isna().all().all()
    half = sharpened(tiny_dir, torch.bfloat16)
    other = pd.DataFrame(evaluate_samples(sharp, tokenizer, samples, grid, modes, 8, Reading(noise_samples=0, other=half, other_samples=2)))
    full = other[other["method"] == "full"]
    assert full["dtype_noise_kl"].notna().all() and set(full["noise_dtype"]) == {"bfloat16"}
    assert (full["dtype_noise_kl"] > 1e-4).all() and (full["dtype_noise_kl"] <= full["dtype_noise_kl_max"]).all()
    pd.testing.assert_frame_equal(same.drop(columns=columns + ["prefill_s", "compress_s", "decode_s", "teacher_forced_s"]),
                                  other.drop(columns=columns + ["prefill_s", "compress_s", "decode_s", "teacher_forced_s"]))


def test_stepped_prompts_in_one_batch_equal_each_alone(tiny, sharp):
    """`stepped` feeds prompts of different lengths, tails and path lengths as one right-padded batch at their own
    positions: each row's log-probabilities equal its prompt stepped alone (padding is masked; fp32 rounding only),
    and equal the one teacher-forced pass along the same path."""
    from kvlab.engine import stepped

    tokenizer = tiny[1]
    samples = KINDS["niah"].generate("niah_single", {"depths": [0.2, 0.8], "samples": 1, "seed": 6}, tokenizer, 500)
    short = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": 7}, tokenizer, 300)
    requests = []
    for n, s in enumerate(samples + short):
        base = prefill(sharp, s.prompt.context)
        path = (s.prompt.question * 2)[: 5 + 3 * n]  # any known tokens: 5, 8 and 11 of them
        requests.append((base.cache, s.prompt.question + s.prompt.suffix, path, base.length))
    assert len({r[3] for r in requests}) > 1
    together = stepped(sharp, requests)
    for request, (logp, choice) in zip(requests, together):
        ((alone, alone_choice),) = stepped(sharp, [request])
        one_pass, _ = teacher_forced(sharp, [request[0]], request[1], request[2], request[3])
        assert logp.shape == (len(request[2]), alone.shape[-1])
        torch.testing.assert_close(logp, alone, rtol=0, atol=1e-4)
        torch.testing.assert_close(logp, one_pass[0], rtol=0, atol=1e-4)
        assert choice.tolist() == alone_choice.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_is_argmax_ties_included(dtype):
    """The engine's greedy choice is argmax's: the first maximum where several positions tie."""
    from kvlab.engine.greedy import greedy

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (4, 9, 1000), generator=g).to(dtype)  # many ties at the maximum
    logits[0, 0, 5] = logits[0, 0, 999] = 7  # a tie far apart
    assert torch.equal(greedy(logits), logits.argmax(-1)) and greedy(logits)[0, 0] == 5


def test_groups_of_several_prompts_and_kinds_decode_as_one_batch(tiny, sharp):
    """decode_groups: groups of caches of different prompts (lengths, tails, positions, caps) and of every kind a
    batch keeps (dense, evicted, re-rotated, masked per head, quantized, two copies of one quantized cache stacked,
    H2O, cross-layer sharing, block-sparse reads), split out of their groups' batches and decoded as one batch, give
    each group's answers as decoding the group alone does."""
    from kvlab.engine import decode_groups

    tokenizer = tiny[1]
    int8 = {"scheme": "int8", "bits": 8, "group": 16, "residual": 0, "key_axis": "channel", "value_axis": "token"}
    kinds = [Variant("full", "full", 1.0), Variant("snap", "kvpress", 0.5, SNAP),
             Variant("rerot", "kvpress", 0.25, {**STREAM, "wrapper": "KeyRerotationPress"}),
             Variant("ada", "kvpress", 0.25, {**SNAP, "wrapper": "AdaKVPress"}),
             Variant("kivi2", "quant", 1.0, VERIFY_METHODS["kivi2"]), Variant("int8", "quant", 1.0, int8),
             Variant("h2o", "h2o", 0.25, {"recent": 0.5}), Variant("cla2", "cross_layer", 1.0, {"every": 2}),
             Variant("moba", "block_sparse", 0.25, {"selector": "moba", "block": 16})]
    groups = []
    for seed, ctx, pick, cap in ((1, 500, [1, 2, 3], 9), (2, 620, [4, 5, 5, 0], 12), (3, 560, [6, 7, 8, 3], 5)):
        (s,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": seed}, tokenizer, ctx)
        base = prefill(sharp, s.prompt.context)
        made = {i: compress(sharp, base, kinds[i]) for i in set(pick)}
        groups.append(([made[i] for i in pick], s.prompt.question + s.prompt.suffix, base.length, cap))
    alone = [greedy_decode(sharp, caches, tail, start, cap) for caches, tail, start, cap in groups]
    assert decode_groups(sharp, groups) == alone
    assert len({tuple(a) for answers in alone for a in answers}) > 3 and max(map(len, alone[1])) > 5
    assert all(len(a) <= cap for (_, _, _, cap), answers in zip(groups, alone) for a in answers)


def test_forced_divergence_is_divergence_of_the_teacher_forced_pass(tiny, sharp):
    """forced_divergence gives bitwise the KL and NLL columns, reference log-probabilities and greedy choices of
    teacher_forced then divergence, for rows fed each way (dense, streamed quantized, H2O step by step) and a
    reference that is not the first row, without building the (B, T, vocabulary) block."""
    from kvlab.engine import forced_divergence

    grid = variants(build(VERIFY_METHODS), [0.5])
    (sample,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": 2}, tiny[1], 600)
    base = prefill(sharp, sample.prompt.context)
    caches = [compress(sharp, base, v) for v in grid][::-1]  # the full row last
    tail, ref = sample.prompt.question + sample.prompt.suffix, len(caches) - 1
    path = greedy_decode(sharp, [caches[ref]], tail, base.length, 10)[0]
    logp, choice = teacher_forced(sharp, caches, tail, path, base.length)
    rows, logp_ref, chosen = forced_divergence(sharp, caches, tail, path, base.length, ref)
    assert rows == divergence(logp, path, ref) and torch.equal(logp_ref, logp[ref]) and torch.equal(chosen, choice)
    assert rows[ref]["kl_vs_full"] == 0 and sum(r["kl_vs_full"] > 1e-3 for r in rows) >= 3


def test_a_split_row_cut_back_is_the_row_fed_less(tiny, sharp, sample):
    """Batch.split(rows, fed): a row cut back to the first k tokens fed since stacking is that row's cache fed only
    those k (the same keys and values, and the same logits for the next token, fp32); quantized rows cannot be cut."""
    grid = [Variant("full", "full", 1.0), Variant("snap", "kvpress", 0.5, SNAP), Variant("stream", "kvpress", 0.25, STREAM)]
    base = prefill(sharp, sample.prompt.context)
    caches = [compress(sharp, base, v) for v in grid]
    tail, extra = sample.prompt.question + sample.prompt.suffix, [5, 6, 7, 8]
    fed = Batch(sharp, caches)
    fed.forward(torch.tensor([tail + extra] * 3), base.length)
    for (i, k), row in zip(((2, 1), (0, 3)), fed.split([2, 0], [len(tail) + 1, len(tail) + 3])):
        short = Batch(sharp, [caches[i]])
        short.forward(torch.tensor([tail + extra[:k]]), base.length)
        (alone,) = short.split()
        for mine, theirs in zip(row.layers, alone.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-5)
        nxt = []
        for cache in (row, alone):
            one = Batch(sharp, [cache])
            one.shift = torch.tensor([base.length + len(tail) + k])
            nxt.append(one.forward(torch.tensor([[extra[k]]]), 0)[0, -1])
        torch.testing.assert_close(nxt[0], nxt[1], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="keeps 0 to"):
        fed.split([0], [len(tail) + len(extra) + 1])
    kivi = Batch(sharp, [compress(sharp, base, Variant("kivi2", "quant", 1.0, VERIFY_METHODS["kivi2"]))])
    kivi.forward(torch.tensor([tail]), base.length)
    with pytest.raises(ValueError, match="cannot keep fewer"):
        kivi.split([0], [len(tail) - 1])


@pytest.mark.parametrize("buckets", [False, True])
def test_verified_dense_rows_resume_where_they_left_the_answer(tiny, sharp, monkeypatch, buckets):
    """verify: a dense row that leaves the reference's answer at d resumes from the teacher-forced pass, fed only the
    token it chose there, at position start + len(tail) + d (no tail fed again); a quantized row is fed the tail, then
    the answer's first d tokens streamed in one pass; every row's answer is the one decoding it step by step gives.
    Where the pass cannot be split into rows (sliding-window models), the dense rows are fed the shared prefix from
    the tail instead, and where rows cannot stream in one pass they are fed one token per pass: the same answers.
    With `buckets`, every dense length is teacher-forced in a batch of its own (`length_buckets`), each row resuming
    from its own batch."""
    from kvlab.engine import verify
    from kvlab.engine.verify import decode_diverged

    if buckets:
        tuned(monkeypatch, sharp, pass_pairs=0, bucket_tokens=1)
    methods = {name: VERIFY_METHODS[name] for name in ("full", "snapkv", "streaming", "kivi2")}
    resumed, streamed = 0, 0
    for seed in (1, 2, 3):
        grid = variants(build(methods), [0.5, 0.1])
        (s,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": seed}, tiny[1], 600)
        base = prefill(sharp, s.prompt.context)
        caches = [compress(sharp, base, v) for v in grid]
        tail = s.prompt.question + s.prompt.suffix
        every = greedy_decode(sharp, caches, tail, base.length, 12)
        run = verify(sharp, caches, 0, tail, base.length, 12)
        for part in run.diverged:
            if part.stepwise:
                assert part.group.tail == tail and part.group.start == base.length
                assert all(list(part.group.streamed) == part.prefix == every[i][: run.first[i]] for i in part.rows)
                assert part.group.cap == 12 - len(part.prefix)
                streamed += len(part.prefix) > 0
                continue
            (i,) = part.rows
            d = run.first[i]
            assert part.prefix == every[i][: d + 1] and part.group[1] == [every[i][d]]
            assert part.group[2] == base.length + len(tail) + d and part.group[3] == 12 - d - 1
            resumed += 1
        decode_diverged(sharp, [run])
        assert run.answers == every
        with monkeypatch.context() as m:
            m.setattr(Batch, "splittable", lambda self: False)
            fallback = verify(sharp, caches, 0, tail, base.length, 12)
            dense = [part for part in fallback.diverged if not part.stepwise]
            assert all(part.group.tail == tail + part.prefix for part in dense)
            m.setattr(Batch, "streamable", lambda self: False)  # the streamed tokens one per pass
            decode_diverged(sharp, [fallback])
        assert fallback.answers == every
    assert resumed >= 2 and streamed >= 1


def test_groups_with_tails_of_one_length_are_fed_in_one_pass(tiny, sharp, monkeypatch):
    """decode_groups feeds the tails of groups of one length in one pass (each row at its own positions), and splits
    and joins rows only across lengths; the answers are each group's alone either way."""
    from kvlab.engine import decode_groups

    tokenizer, groups = tiny[1], []
    for seed, ctx in ((1, 500), (2, 620), (3, 560)):
        (s,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": seed}, tokenizer, ctx)
        base = prefill(sharp, s.prompt.context)
        caches = [base.cache, compress(sharp, base, Variant("snap", "kvpress", 0.5, SNAP))]
        groups.append((caches, (s.prompt.question + s.prompt.suffix)[-6:], base.length, 8))
    alone = [greedy_decode(sharp, caches, tail, start, cap) for caches, tail, start, cap in groups]
    passes = []
    forward = Batch.forward
    monkeypatch.setattr(Batch, "forward", lambda self, ids, *a, **k: passes.append(ids.shape) or forward(self, ids, *a, **k))
    assert decode_groups(sharp, groups) == alone
    assert passes[0] == (6, 6) and all(shape[1] == 1 for shape in passes[1:])
    mixed = [groups[0], (groups[1][0], groups[1][1][-4:], groups[1][2] + 2, 8), groups[2]]
    expected = [greedy_decode(sharp, c, t, s, cap) for c, t, s, cap in mixed]
    passes.clear()
    assert decode_groups(sharp, mixed) == expected
    assert sorted(passes[:2]) == [(2, 4), (4, 6)] and all(shape[1] == 1 for shape in passes[2:])


def test_lookup_drafts_what_followed_the_longest_suffix_seen_before():
    """Lookup: the tokens after the latest earlier occurrence of the longest suffix (<= 3 tokens) that occurred before;
    nothing for a token never seen; the row's own new tokens are looked up too."""
    from kvlab.engine.drafts import Lookup

    seen = Lookup([1, 2, 3, 4, 9, 3, 5, 6, 7, 2, 3])
    assert seen.draft(3) == [4, 9, 3]  # (2, 3) last occurred before at 1-2, followed by 4; (3,) alone would give 5
    assert seen.draft(0) == [] and seen.draft(9) == [4, 9, 3, 5, 6, 7, 2, 3]
    seen.extend([8])
    assert seen.draft(4) == []
    seen.extend([3])
    assert seen.draft(2) == [8, 3]  # (8, 3) never before; 3's latest earlier occurrence was followed by 8
    copy = seen.copy()
    copy.extend([5])
    assert copy.draft(2) == [6, 7] and seen.draft(2) == [8, 3]


def test_drafted_decoding_gives_the_stepwise_answers_in_fewer_passes(tiny, sharp, monkeypatch):
    """Groups with a `source` decode with drafts looked up in it (`_drafted`): rows of different prompts, compressions
    (evicted, re-rotated, masked per head, cross-layer shared) and positions, fed drafts that are right, wrong or
    absent, each take back what they reject (`Batch.reject`) and answer as one-token steps do; right drafts save
    passes. PerRowLayer of quantized caches and kept logits get no drafts."""
    from kvlab.engine import decode_groups
    from kvlab.engine.greedy import Group, decode_references

    tokenizer, groups, bases = tiny[1], [], []
    for seed, ctx in ((1, 500), (2, 620), (3, 560)):
        (s,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": seed}, tokenizer, ctx)
        bases.append(base := prefill(sharp, s.prompt.context))
        caches = [base.cache] + [compress(sharp, base, v) for v in (
            Variant("snap", "kvpress", 0.5, SNAP), Variant("rerot", "kvpress", 0.25, {**STREAM, "wrapper": "KeyRerotationPress"}),
            Variant("ada", "kvpress", 0.25, {**SNAP, "wrapper": "AdaKVPress"}), Variant("cla2", "cross_layer", 1.0, {"every": 2}))]
        groups.append(Group(caches, s.prompt.question + s.prompt.suffix, base.length, 12))
    alone = [greedy_decode(sharp, g.caches, g.tail, g.start, g.cap) for g in groups]
    assert max(len(a) for answers in alone for a in answers) == 12
    passes = []
    forward = Batch.forward
    monkeypatch.setattr(Batch, "forward", lambda self, ids, *a, **k: passes.append(ids.shape) or forward(self, ids, *a, **k))
    assert decode_groups(sharp, groups) == alone
    # a source in which each group's tail is followed by its first row's answer: that row's drafts are its answer, the
    # other rows' are right as far as their answers agree with it; the second group's drafts are all wrong
    right = [g._replace(source=[*g.tail, *a[0]]) for g, a in zip(groups, alone)]
    wrong = groups[1]._replace(source=[*groups[1].tail, *[(t + 1) % 259 for t in alone[1][0]]])
    for drafted in ([right[0], wrong, right[2]], right):
        passes.clear()
        assert decode_groups(sharp, drafted) == alone
        assert max(shape[1] for shape in passes) > 1
    passes.clear()  # the first rows alone: every draft right, 12 tokens in the tails' passes and two with drafts
    assert decode_groups(sharp, [g._replace(caches=g.caches[:1]) for g in right]) == [a[:1] for a in alone]
    assert sorted(shape[1] for shape in passes[:-2]) == sorted({len(g.tail) for g in groups})
    assert [shape[1] for shape in passes[-2:]] == [1 + 8, 1 + 1]  # 1 + 9 + 2 = 12
    quantized = Variant("int8", "quant", 1.0, {"scheme": "int8", "bits": 8, "group": 16, "residual": 0, "key_axis": "channel",
                                                "value_axis": "token"})
    mixed = right[0]._replace(caches=[right[0].caches[0], compress(sharp, bases[0], quantized)])
    expected = [greedy_decode(sharp, mixed.caches, mixed.tail, mixed.start, mixed.cap)]
    passes.clear()
    assert decode_groups(sharp, [mixed]) == expected
    assert all(shape[1] == 1 for shape in passes[1:])  # a quantized row cannot take tokens back: one-token steps
    passes.clear()
    references = [(g.caches[0], g.tail, g.start) for g in right]
    assert decode_references(sharp, references, 12, keep={1}, sources=[g.source for g in right])[0] == [a[0] for a in alone]
    assert all(shape[1] == 1 for shape in passes[len({len(g.tail) for g in groups}):])  # logits kept: one-token steps


@pytest.mark.parametrize("press", ["SnapKVPress", "PyramidKVPress", "KnormPress", "TOVAPress", "ExpectedAttentionPress"])
def test_a_prefill_scores_each_layer_once_for_every_budget(tiny, sample, press, monkeypatch):
    """A ratio-free kvpress scorer (compress.RATIO_FREE_SCORERS) scores each layer of a prefill once for all its
    budgets, and every budget's cache is bitwise the one compressing a fresh prefill alone gives (scores anew)."""
    import kvpress

    from kvlab.engine.compress import RATIO_FREE_SCORERS

    assert press in RATIO_FREE_SCORERS
    model = tiny[0]
    kwargs = {"window_size": 16} if press in ("SnapKVPress", "PyramidKVPress") else {}
    grid = [Variant(press, "kvpress", b, {"kind": "kvpress", "press": press, "kwargs": kwargs}) for b in (0.75, 0.5, 0.25)]
    alone = [compress(model, prefill(model, sample.prompt.context), v) for v in grid]
    calls, own = [], getattr(kvpress, press).score
    monkeypatch.setattr(getattr(kvpress, press), "score", lambda self, *args: calls.append(1) or own(self, *args))
    base = prefill(model, sample.prompt.context)
    together = [compress(model, base, v) for v in grid]
    assert len(calls) == len(base.cache.layers)
    for mine, theirs in zip(together, alone):
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(mine.layers, theirs.layers))
    assert len({sum(layer.keys.shape[-2] for layer in mine.layers) for mine in together}) == 3


def test_layers_compressed_alike_share_one_mask(tiny, sample):
    """Batch.same_mask_as: layers whose rows hold the same lengths share one mask per pass (every layer of a uniform press),
    layers of per-layer budgets (PyramidKV) where lengths differ and layers masked per head (AdaKV) keep their own,
    and each layer's shared mask is bitwise its own; dropping rows regroups them."""
    model = tiny[0]
    base = prefill(model, sample.prompt.context)
    uniform = Batch(model, [compress(model, base, Variant("s", "kvpress", 0.5, SNAP)),
                            compress(model, base, Variant("t", "kvpress", 0.25, STREAM))])
    assert set(uniform.same_mask_as()) == {0}
    pyramid = Variant("p", "kvpress", 0.5, {"kind": "kvpress", "press": "PyramidKVPress", "kwargs": {"window_size": 16}})
    ada = Variant("a", "kvpress", 0.5, {**SNAP, "wrapper": "AdaKVPress"})
    caches = [compress(model, base, v) for v in (pyramid, Variant("s", "kvpress", 0.5, SNAP), ada)]
    lengths = [layer.keys.shape[-2] for layer in caches[0].layers]
    assert len(set(lengths)) > 1
    def shared_masks_are_their_own(batch):
        first = [idx if batch.masked[idx] is not None else next(
            j for j in range(idx + 1) if batch.masked[j] is None and batch.padded[j] == batch.padded[idx]
            and torch.equal(batch.lengths[j], batch.lengths[idx])) for idx in range(len(batch.padded))]
        assert batch.same_mask_as() == first
        for n in (1, 3):
            for idx, same in enumerate(batch.same_mask_as()):
                mine, shared = batch.full_mask(idx, n, model.dtype), batch.full_mask(same, n, model.dtype)
                assert (mine is None and shared is None) or torch.equal(mine, shared)

    for batch, distinct in ((Batch(model, caches[:2]), len(set(lengths))), (Batch(model, caches), len(lengths))):
        assert len(set(batch.same_mask_as())) == distinct
        shared_masks_are_their_own(batch)
        batch.keep([0])  # fewer rows: masks of one row, regrouped
        shared_masks_are_their_own(batch)


def test_a_chunk_after_per_layer_budgets_stays_causal(tiny, sample):
    """After a press that keeps a different number of tokens per layer (PyramidKV), the question fed as one chunk
    gives the logits that feeding it one token at a time gives (fp32): each layer's mask is its own, so no question
    token sees a later one in a layer shorter than the first (as a mask built from the first layer's length would)."""
    model = tiny[0]
    base = prefill(model, sample.prompt.context)
    pyramid = Variant("p", "kvpress", 0.5, {"kind": "kvpress", "press": "PyramidKVPress", "kwargs": {"window_size": 16}})
    cache = compress(model, base, pyramid)
    assert len({layer.keys.shape[-2] for layer in cache.layers}) > 1
    tail = sample.prompt.question + sample.prompt.suffix
    chunk = Batch(model, [cache]).forward(torch.tensor([tail]), base.length, logits_to_keep=len(tail))[0]
    steps = Batch(model, [cache])
    one = torch.cat([steps.forward(torch.tensor([[t]]), base.length + i)[0] for i, t in enumerate(tail)])
    torch.testing.assert_close(chunk, one, rtol=0, atol=1e-4)


def test_length_buckets_are_the_cheapest_contiguous_split():
    """length_buckets: over rows sorted longest first, the split into contiguous batches of least padded attention
    plus per-pass cost (checked against every split), each batch feeding at least the minimum tokens; a cache at
    budgets 1.0 to 0.1 splits where the padding outweighs a pass, and one length or a short feed stays one batch."""
    import itertools
    import random

    from kvlab.engine.teacher import length_buckets

    def cost(batches, held, fed, pass_pairs):
        return sum(len(b) * fed * (max(held[i] for i in b) + fed) + pass_pairs for b in batches)

    rng = random.Random(0)
    for _ in range(200):
        held = [rng.choice([50, 107, 268, 535, 1070, rng.randint(1, 2000)]) for _ in range(rng.randint(1, 7))]
        fed, pass_pairs, least = rng.randint(1, 80), rng.choice([0, 25_000, 200_000]), rng.choice([1, 64, 128])
        got = length_buckets(held, fed, pass_pairs, least)
        order = sorted(range(len(held)), key=lambda i: -held[i])
        assert [i for b in got for i in b] == order
        splits = [[order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
                  for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k)]
        allowed = [s for s in splits if all(len(b) * fed >= least for b in s)] or [[order]]
        assert len(got) == 1 or all(len(b) * fed >= least for b in got)
        assert cost(got, held, fed, pass_pairs) == pytest.approx(min(cost(s, held, fed, pass_pairs) for s in allowed))
    assert length_buckets([1070, 535, 535, 268, 268, 107, 107], 60, 25_000, 128) == [[0, 1, 2], [3, 4, 5, 6]]
    assert length_buckets([1070, 535, 535, 268, 268, 107, 107], 20, 25_000, 128) == [list(range(7))]
    assert length_buckets([600, 600, 600], 60, 0, 1) == [[0, 1, 2]]


def test_teacher_forcing_in_length_buckets_equals_one_batch(tiny, sharp, monkeypatch):
    """Dense rows teacher-forced in batches of their own lengths give the KL, NLL, reference log-probabilities and
    greedy choices of one padded batch (fp32: the padding was masked, so only the kernel's summation order moves)."""
    from kvlab.engine.teacher import forced_divergence, stepwise

    (s,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": 5}, tiny[1], 600)
    base = prefill(sharp, s.prompt.context)
    grid = variants(build({name: VERIFY_METHODS[name] for name in ("full", "snapkv", "streaming", "kivi2")}), [0.5, 0.25, 0.1])
    caches = [compress(sharp, base, v) for v in grid]
    tail, path = s.prompt.question + s.prompt.suffix, s.prompt.question[:9]
    one_batch, passes = [], []
    tuned(monkeypatch, sharp, bucket_tokens=10 ** 9)  # no batch feeds that many: all rows in one
    one = forced_divergence(sharp, caches, tail, path, base.length, 0, resume=one_batch)
    tuned(monkeypatch, sharp, pass_pairs=0, bucket_tokens=1)
    split = forced_divergence(sharp, caches, tail, path, base.length, 0, resume=passes)
    assert len(one_batch) == 1 and len(passes) == len({round(sum(x.keys.shape[-2] for x in c.layers)) for c in caches
                                                            if not stepwise(c)}) > 2
    assert sorted(i for group, _ in passes for i in group) == sorted(one_batch[0][0])
    for a, b in zip(one[0], split[0]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), (k, a[k], b[k])
    torch.testing.assert_close(one[1], split[1], rtol=0, atol=1e-5)
    assert torch.equal(one[2], split[2])
