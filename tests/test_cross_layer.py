"""Cross-layer sharing post hoc (kind cross_layer, kvlab.kernels.cross_layer): a sharing layer holds its source's
keys and values through the prompt and every decode step, stores no bytes, and with sharing off nothing changes."""

import pytest
import torch

from kvlab.engine import Batch, cache_stats, compress, prefill, teacher_forced
from kvlab.engine.teacher import stepwise, streams
from kvlab.kernels.cross_layer import SharedLayer
from kvlab.kernels.kvcache import layer_nbytes
from kvlab.methods import Variant
from kvlab.tasks import KINDS


@pytest.fixture(scope="module")
def prompt(tiny):
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}
    return KINDS["niah"].generate("niah_single", spec, tiny[1], 300)[0].prompt


def cla(every: int) -> Variant:
    return Variant(f"cla{every}", "cross_layer", 1.0, {"every": every})


def _steps(model, caches, tail, start, steps=4):
    batch = Batch(model, caches)
    out = [batch.forward(tail.expand(len(caches), -1), start)[:, -1]]
    for i in range(steps):
        out.append(batch.forward(out[-1].argmax(-1, keepdim=True), start + tail.shape[1] + i)[:, -1])
    return batch, torch.stack(out, 1)


def test_sharing_off_is_the_full_cache(tiny, prompt):
    model, _ = tiny
    base = prefill(model, prompt.context)
    off = compress(model, base, cla(1))
    assert not any(isinstance(layer, SharedLayer) for layer in off.layers)
    full = compress(model, base, Variant("full", "full", 1.0))
    tail = torch.tensor([prompt.question + prompt.suffix])
    assert torch.equal(_steps(model, [off], tail, base.length)[1], _steps(model, [full], tail, base.length)[1])


def test_a_shared_layer_holds_its_source_and_stores_nothing(tiny, prompt):
    """CLA-2 on 2 layers: layer 1 holds layer 0's K/V (the prompt's, then each new token's), the cache's bytes
    halve, and the answers' logits move away from the full cache's."""
    model, _ = tiny
    base = prefill(model, prompt.context)
    two = compress(model, base, cla(2))
    shared = two.layers[1]
    assert isinstance(shared, SharedLayer) and shared.shares == 0 and shared.keys is two.layers[0].keys
    assert layer_nbytes(shared) == 0
    full = compress(model, base, Variant("full", "full", 1.0))
    stats, ref = cache_stats(two, cla(2), base.length), cache_stats(full, Variant("full", "full", 1.0), base.length)
    assert stats["kv_bytes"] * 2 == ref["kv_bytes"] and stats["compression_vs_bf16"] == 2.0
    tail = torch.tensor([prompt.question + prompt.suffix])
    batch, logits = _steps(model, [two, full], tail, base.length)
    source, rows = batch.cache.layers[0], batch.cache.layers[1]
    held = rows.rows[0].keys
    assert held.shape[-2] == base.length + tail.shape[1] + 4
    assert torch.equal(held, source.keys[:1, :, : held.shape[-2]]) and torch.equal(rows.rows[0].values, source.values[:1, :, : held.shape[-2]])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)


def test_shared_rows_stream_in_teacher_forcing(tiny, prompt):
    model, _ = tiny
    base = prefill(model, prompt.context)
    two = compress(model, base, cla(2))
    assert stepwise(two) and streams(two)
    tail, path = prompt.question + prompt.suffix, prompt.context[40:60]
    streamed, _ = teacher_forced(model, [two], tail, path, base.length)
    steps, _ = teacher_forced(model, [two], tail, path, base.length, stream=False)
    torch.testing.assert_close(streamed, steps, rtol=1e-4, atol=1e-4)


def test_a_shared_layer_outside_the_engine_batch_says_what_it_needs():
    keys = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="needs that layer's new keys and values first"):
        SharedLayer(0, keys, keys).update(keys[:, :, :1], keys[:, :, :1], {})
