"""H2O (kvlab.kernels.h2o): scores equal eager attention, eviction keeps the budget and the recent window,
and H2O rows batch with others in the engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvlab.engine import Batch, compress, evaluate_sample, prefill, queries
from kvlab.kernels.h2o import H2OLayer, keep_heavy_and_recent, received_attention
from kvlab.methods import Variant, build, variants
from kvlab.tasks import KINDS

H2O = {"kind": "h2o", "recent": 0.5}


@pytest.fixture(scope="module")
def sample(tiny):
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}
    return KINDS["niah"].generate("niah_single", spec, tiny[1], 400)[0]


def test_prefill_scores_equal_eager_attention(tiny_dir, tiny):
    """The attention each key receives, summed over causal queries and a KV group's query heads, equals the
    sum of the weights transformers' eager attention returns."""
    model, _ = tiny
    eager = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = eager(input_ids=ids, output_attentions=True, use_cache=True)
    base = prefill(model, ids[0].tolist())
    for idx, module in enumerate(eager.model.layers):
        cap = base.captures[idx]
        keys = base.cache.layers[idx].keys
        got = received_attention(queries(module.self_attn, cap.hidden_states, cap.cos, cap.sin), keys, module.self_attn.scaling, chunk=7)
        weights = out.attentions[idx]  # (1, Hq, T, T)
        want = weights.sum(2).view(1, keys.shape[1], -1, keys.shape[-2]).sum(2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_eviction_keeps_the_budget_the_recent_window_and_the_heaviest():
    scores = torch.tensor([[[5.0, 0.1, 3.0, 0.2, 9.0, 0.0, 0.0, 0.0]]])
    index = keep_heavy_and_recent(scores, capacity=5, recent=2)
    assert index.tolist() == [[[0, 2, 4, 6, 7]]]
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    layer = H2OLayer(keys, values, torch.rand(1, 2, 20, generator=g), capacity=10, recent=4, scaling=8**-0.5)
    for step in range(6):
        k = torch.randn(1, 2, 1, 8, generator=g)
        layer.pending_query = torch.randn(1, 4, 1, 8, generator=g)
        full_k, _ = layer.update(k, torch.randn(1, 2, 1, 8, generator=g))
        assert full_k.shape[-2] == 11 and torch.equal(full_k[..., -1:, :], k)  # attention reads 10 + the new token
        assert layer.keys.shape[-2] == 10  # one evicted per step, per head
        assert torch.equal(layer.keys[..., -4:, :], full_k[..., -4:, :])  # the recent window is never evicted


def test_decode_scores_add_each_new_querys_attention():
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 1, 6, 4, generator=g), torch.randn(1, 1, 6, 4, generator=g)
    layer = H2OLayer(keys, values, torch.zeros(1, 1, 6), capacity=10, recent=2, scaling=0.5)
    q, k = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 1, 1, 4, generator=g)
    layer.pending_query = q
    all_keys, _ = layer.update(k, torch.randn(1, 1, 1, 4, generator=g))
    expected = torch.softmax((q @ all_keys.transpose(-1, -2)) * 0.5, dim=-1).sum(1)[:, None, 0]  # 2 query heads, 1 KV head
    torch.testing.assert_close(layer.scores, expected)


def test_h2o_rows_decode_as_if_alone_while_their_length_changes(tiny, sample):
    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    (h2o,) = variants(build({"h": H2O}), [0.25])
    cache = compress(model, base, h2o)
    full = compress(model, base, Variant("full", "full", 1.0))
    assert all(layer.keys.shape[-2] == int(base.length * 0.25) for layer in cache.layers)
    tail = p.question + p.suffix
    batches = [Batch(model, [cache]), Batch(model, [full, cache])]
    x = [torch.tensor([tail]), torch.tensor([tail, tail])]
    pos = base.length
    for _ in range(5):  # decode greedily; the H2O row evicts at every step
        alone = batches[0].forward(x[0], pos)[0, -1]
        together = batches[1].forward(x[1], pos)[1, -1]
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
        pos += x[0].shape[1]
        token = int(alone.argmax())
        x = [torch.tensor([[token]]), torch.tensor([[token], [token]])]
    assert cache.layers[0].keys.shape[-2] == int(base.length * 0.25)  # the batch forked the rows


def test_h2o_in_the_engine_keeps_its_budget(tiny, sample):
    model, tokenizer = tiny
    grid = variants(build({"full": {"kind": "full"}, "h2o": H2O}), [0.5, 0.25])
    rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 4)
    by = {(r["method"], r["budget"]): r for r in rows}
    assert by["h2o", 0.25]["kv_tokens_mean"] == int(len(sample.prompt.context) * 0.25)
    assert by["h2o", 0.25]["kv_bytes"] < by["h2o", 0.5]["kv_bytes"] < by["full", 1.0]["kv_bytes"]
    assert all(r["kl_vs_full"] >= 0 for r in rows)


def test_prefill_scores_computed_once_are_every_budgets(tiny, sample):
    """The prefill's scores are computed once per prefill and shared by every budget: each budget's layers equal
    those compressed from a prefill of its own."""
    model, _ = tiny
    shared = prefill(model, sample.prompt.context)
    for h2o in variants(build({"h": H2O}), [0.5, 0.25, 0.1]):
        one = compress(model, shared, h2o)
        alone = compress(model, prefill(model, sample.prompt.context), h2o)
        for a, b in zip(one.layers, alone.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.scores, b.scores)
    assert sum(key[0] == "h2o_scores" for key in shared.shared) == len(shared.cache.layers)
