"""MiKV-style mixed precision (kvlab.methods.mikv) on the tiny model: the full-precision tokens are the ones SnapKV
keeps, the others are codes, the bytes are the formula's, and a budget of 1 is the full cache."""

import pytest
import torch

from conftest import decode_steps, needle_prompt
from kvlab.engine import cache_stats, compress, prefill
from kvlab.kernels.kvcache import QuantizedKVLayer
from kvlab.kernels.layouts import stored_layer_bytes
from kvlab.methods import Variant, kind_of

SNAP = {"window_size": 16, "kernel_size": 5}
PARAMS = kind_of({"kind": "mikv", "scorer": "SnapKVPress", "kwargs": SNAP, "bits": 2, "group": 16, "residual": 16}).params



def _by_vector(x: torch.Tensor) -> torch.Tensor:
    """The token vectors of each (batch, head) in a canonical order (by their sum), to compare token sets."""
    return x.gather(2, x.sum(-1).argsort(-1).unsqueeze(-1).expand_as(x))


def test_kept_tokens_are_snapkvs_in_full_precision_and_the_rest_are_codes(tiny):
    model, tokenizer = tiny
    base = prefill(model, needle_prompt(tokenizer).context)
    t = base.length
    mikv = compress(model, base, Variant("mikv2", "mikv", 0.25, PARAMS))
    snap = compress(model, base, Variant("snapkv", "kvpress", 0.25, {"press": "SnapKVPress", "kwargs": SNAP}))
    kept = int(t * 0.25)
    for layer, evicted in zip(mikv.layers, snap.layers):
        assert isinstance(layer, QuantizedKVLayer) and layer.sink_keys.shape[-2] == kept == evicted.keys.shape[-2]
        torch.testing.assert_close(_by_vector(layer.sink_keys), _by_vector(evicted.keys), rtol=0, atol=0)
        torch.testing.assert_close(_by_vector(layer.sink_values), _by_vector(evicted.values), rtol=0, atol=0)
        n = layer.counts()
        assert n["sink_tokens"] + n["quantized_keys"] + n["residual_keys"] == t  # no token dropped
        # the evicted tokens as KIVI stores them: keys (per channel) in whole runs of R, values (per token) all but the newest R
        evicted, r = t - kept, PARAMS["residual"]
        assert (n["quantized_keys"], n["quantized_values"]) == (evicted // r * r, evicted - r)
    stats = cache_stats(mikv, Variant("mikv2", "mikv", 0.25, PARAMS), t)
    assert stats["kv_tokens_mean"] == t and stats["kv_bytes"] == stats["kv_bytes_formula"]
    layer = mikv.layers[0]
    heads, d = layer.sink_keys.shape[1], layer.sink_keys.shape[-1]
    key, value = kind_of({"kind": "mikv", **PARAMS}).layouts(d)
    n = layer.counts()
    dense = n["sink_tokens"] + n["residual_keys"], n["sink_tokens"] + n["residual_values"]
    one = stored_layer_bytes(key, value, heads, d, (n["quantized_keys"], n["quantized_values"]), dense, 4)
    assert stats["kv_bytes"] == one * len(mikv.layers)  # fp32 run: 4 bytes per dense entry
    full_bytes = cache_stats(compress(model, base, Variant("full", "full", 1.0)), Variant("full", "full", 1.0), t)["kv_bytes"]
    snap_bytes = cache_stats(snap, Variant("snapkv", "kvpress", 0.25, {"press": "SnapKVPress", "kwargs": SNAP}), t)["kv_bytes"]
    assert snap_bytes < stats["kv_bytes"] < full_bytes



def test_a_budget_of_one_is_the_full_cache_and_a_quarter_beats_dropping(tiny):
    """Every token in full precision (budget 1, reordered per head; a residual of 256 holds the 116-token question and the
    decoded tokens unquantized) gives the full cache's logits (attention over a set does not depend on its order;
    fp32 sums in another order: close, not equal). At a quarter, keeping the evicted tokens as 2-bit codes stays
    closer to the full cache than SnapKV, which drops them."""
    model, tokenizer = tiny
    params = {**PARAMS, "residual": 256}
    p = needle_prompt(tokenizer)
    base = prefill(model, p.context)
    tail = torch.tensor([p.question + p.suffix])
    full = compress(model, base, Variant("full", "full", 1.0))
    whole = compress(model, base, Variant("mikv2", "mikv", 1.0, params))
    quarter = compress(model, base, Variant("mikv2", "mikv", 0.25, params))
    snap = compress(model, base, Variant("snapkv", "kvpress", 0.25, {"press": "SnapKVPress", "kwargs": SNAP}))
    logits = decode_steps(model, [full, whole, quarter, snap], tail, base.length).log_softmax(-1)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)

    def kl(row):
        return (logits[0].exp() * (logits[0] - logits[row])).sum(-1).mean()

    assert kl(2) < kl(3)


@pytest.mark.parametrize("entry, message", [
    ({"scorer": "SnapKV"}, "scorer"),
    ({"scorer": "SnapKVPress", "kwargs": {"window": 3}}, "kwargs.window"),
])
def test_a_bad_scorer_is_named(entry, message):
    problem = kind_of({"kind": "mikv", "bits": 2, "group": 32, "residual": 32, **entry}).problem()
    assert problem is not None and problem[0] == message
