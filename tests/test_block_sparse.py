"""Decode-time block-sparse reads (kvlab.kernels.block_sparse, kind block_sparse): the block selection against a
brute-force reference, the read count by hand, and the engine reading exactly the selected blocks."""

import math

import pytest
import torch

from conftest import decode_steps, needle_prompt
from kvlab.engine import cache_stats, compress, prefill
from kvlab.kernels.block_sparse import read_tokens, selected
from kvlab.methods import Variant


def brute_force(query, keys, block, top_k, selector):
    """Loop by loop: per batch row, KV head and query, score each complete past block, keep the best."""
    b, hkv, t, d = keys.shape
    n, g = query.shape[2], query.shape[1] // hkv
    out = torch.zeros(b, hkv, n, t, dtype=torch.bool)
    for r in range(b):
        for h in range(hkv):
            for i in range(n):
                pos = t - n + i
                cur = pos // block
                out[r, h, i, cur * block : pos + 1] = True
                scores = []
                for c in range(cur):
                    ks = keys[r, h, c * block : (c + 1) * block].double()
                    total = 0.0
                    for qh in range(h * g, (h + 1) * g):
                        q = query[r, qh, i].double()
                        if selector == "moba":
                            total += float(q @ ks.mean(0))
                        else:
                            total += float(torch.maximum(q * ks.min(0).values, q * ks.max(0).values).sum())
                    scores.append((total, c))
                for _, c in sorted(scores, reverse=True)[: top_k - 1]:
                    out[r, h, i, c * block : (c + 1) * block] = True
    return out


@pytest.mark.parametrize("selector", ["moba", "quest"])
@pytest.mark.parametrize("n, top_k", [(1, 3), (4, 2), (1, 1), (3, 20)])
def test_selection_equals_brute_force(selector, n, top_k):
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(2, 2, 45, 8, generator=g)
    query = torch.randn(2, 6, n, 8, generator=g)
    got = selected(query, keys, 8, top_k, selector)
    want = brute_force(query, keys, 8, top_k, selector)
    assert torch.equal(got, want)
    reads = got[..., -1, :].sum(-1)  # the last query: current block (45 - 40 = 5 tokens) + min(top_k - 1, 5) blocks
    assert (reads == 5 + 8 * min(top_k - 1, 5)).all()


def test_read_count_by_hand():
    # 1000 held + 1 new = 1001 tokens, blocks of 64: 15 complete past blocks, the current holds 41
    assert read_tokens(1000, 64, 4, "moba") == 41 + 3 * 64 + 15 * 0.5
    assert read_tokens(1000, 64, 4, "quest") == 41 + 3 * 64 + 15
    assert read_tokens(1000, 64, 16, "moba") == 1001  # every block: nothing scored
    with pytest.raises(ValueError, match="selector 'nsa' is not one of moba, quest"):
        read_tokens(1000, 64, 4, "nsa")




def test_every_block_read_equals_full_attention_bit_for_bit(tiny):
    """With top_k covering every block, the block-sparse row gives the full row's logits exactly (fp32, the same row
    of the same batch shape: rows of one batch can differ in their last bit on the CPU); at a quarter of the
    blocks, it does not, and its rows count what a step reads."""
    model, tokenizer = tiny
    p = needle_prompt(tokenizer)
    base = prefill(model, p.context)
    params = {"selector": "moba", "block": 16}
    every = compress(model, base, Variant("moba", "block_sparse", 4.0, params))
    quarter = compress(model, base, Variant("moba", "block_sparse", 0.25, params))
    full = compress(model, base, Variant("full", "full", 1.0))
    tail = torch.tensor([p.question + p.suffix])
    ours, ref = decode_steps(model, [every, quarter], tail, base.length), decode_steps(model, [full, quarter], tail, base.length)
    assert torch.equal(ours[0], ref[0])
    assert not torch.allclose(ref[1, 1:], ref[0, 1:], atol=1e-3)  # decode steps read a quarter of the blocks
    torch.testing.assert_close(ref[1, 0], ref[0, 0])  # the tail is read in full, as a prefill
    stats = cache_stats(quarter, Variant("moba", "block_sparse", 0.25, params), base.length)
    t = base.length
    k = max(1, round(0.25 * t / 16))
    assert stats["kv_read_mean"] == read_tokens(t, 16, k, "moba")
    assert math.isclose(stats["kv_read_fraction"], read_tokens(t, 16, k, "moba") / t)
    assert stats["kv_tokens_mean"] == t and stats["compression_vs_bf16"] == 1.0
    assert cache_stats(full, Variant("full", "full", 1.0), t)["kv_read_fraction"] == 1.0


def test_attention_reads_only_the_selected_blocks(tiny):
    """sdpa_gqa over a block-sparse layer equals softmax attention over exactly the brute-force selection."""
    from types import SimpleNamespace

    from kvlab.engine import attention_layers, sdpa_gqa
    from kvlab.engine.attention import reading
    from kvlab.kernels.block_sparse import BlockSparseLayer

    model, _ = tiny
    module = attention_layers(model)[1]
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 2, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g)
    query = torch.randn(1, 4, 1, 16, generator=g)
    layer = BlockSparseLayer(keys[:, :, :-1], values[:, :, :-1], 8, 3, "quest")
    layer.update(keys[:, :, -1:], values[:, :, -1:])
    with reading(SimpleNamespace(layers=[None, layer])):
        ours, _ = sdpa_gqa(module, query, keys, values, None, scaling=0.25)
    allowed = brute_force(query, keys, 8, 3, "quest").repeat_interleave(2, dim=1)
    assert allowed[0, 0, 0].sum() == 6 + 2 * 8  # the current block (64…69) and two past blocks
    logits = (query.double() @ keys.repeat_interleave(2, dim=1).double().transpose(-1, -2) * 0.25).masked_fill(~allowed, float("-inf"))
    want = (logits.softmax(-1) @ values.repeat_interleave(2, dim=1).double()).transpose(1, 2)
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)


def test_teacher_forcing_streams_block_sparse_rows_as_steps(tiny):
    """A known path fed in one streamed pass reads, at each position, the blocks its own decode step would: the
    log-probabilities equal those of feeding it one token at a time."""
    from kvlab.engine import stepwise, teacher_forced
    from kvlab.engine.teacher import streams

    model, tokenizer = tiny
    p = needle_prompt(tokenizer)
    base = prefill(model, p.context)
    caches = [compress(model, base, Variant(s, "block_sparse", 0.25, {"selector": s, "block": 16})) for s in ("moba", "quest")]
    assert all(stepwise(c) and streams(c) for c in caches)
    tail, path = p.question + p.suffix, p.context[40:60]
    streamed, _ = teacher_forced(model, caches, tail, path, base.length)
    steps, _ = teacher_forced(model, caches, tail, path, base.length, stream=False)
    torch.testing.assert_close(streamed, steps, rtol=1e-4, atol=1e-4)
    full = compress(model, base, Variant("full", "full", 1.0))
    dense, _ = teacher_forced(model, [full], tail, path, base.length)
    assert not torch.allclose(streamed[0], dense[0], atol=1e-3)
