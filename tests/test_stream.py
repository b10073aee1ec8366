"""A chunk fed to a quantized layer in one pass, read as if fed one token at a time (kvlab.kernels.stream):
the same attention at every step, the same stored codes after, and the same teacher-forced log-probabilities
through the engine."""

from __future__ import annotations


import pytest
import torch

from kvlab.engine import compress, prefill, teacher_forced
from kvlab.kernels import kvcache, stream
from kvlab.methods import build, kind_of, variants
from kvlab.tasks import KINDS
from test_kvcache import SPECS, qspec, random_kv, rope_tables

STREAM_SPECS = {
    **SPECS,
    "kivi4_r16_g8": lambda: kind_of(qspec("kivi", residual=16, group=8)).scheme.layer_spec(0, 2, 16),
    "kivi2_swapped_r16_g8": lambda: kind_of(qspec("kivi", bits=2, residual=16, group=8, key_axis="token",
                                                  value_axis="channel")).scheme.layer_spec(0, 2, 16),
    "kivi4_together_r4_g8": lambda: kind_of(qspec("kivi", residual=4, group=8, policy="together")).scheme.layer_spec(0, 2, 16),
    "kivi2_together_r0_g8": lambda: kind_of(qspec("kivi", bits=2, residual=0, group=8, policy="together")).scheme.layer_spec(0, 2, 16),
}


def attend(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("name", sorted(STREAM_SPECS))
@pytest.mark.parametrize("prefilled,n", [(21, 30), (16, 1), (40, 17)])
def test_one_pass_reads_each_token_as_its_own_step_would(name, prefilled, n):
    spec = STREAM_SPECS[name]()
    keys, values = random_kv(prefilled + n, seed=prefilled)
    cos, sin = rope_tables(prefilled + n)
    kw = lambda a, b: {"cos": cos[:, a:b], "sin": sin[:, a:b]} if spec.rope else None  # noqa: E731
    layer = kvcache.layer_from_dense(keys[..., :prefilled, :], values[..., :prefilled, :], spec,
                                     *((cos[:, :prefilled], sin[:, :prefilled]) if spec.rope else ()))
    assert stream.streamable(layer)
    q = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(7))
    stepped, expected = layer.fork(), []
    for i in range(n):  # what decoding does: the view before the append, then the append
        t = slice(prefilled + i, prefilled + i + 1)
        k, v = stepped.update(keys[..., t, :], values[..., t, :], kw(t.start, t.stop))
        expected.append(attend(q[..., i : i + 1, :], k, v, torch.ones(1, k.shape[-2], dtype=torch.bool)))
    streamed = layer.fork()
    allowed = stream.visibility(streamed, n, "cpu")
    k, v = stream.stream_update(streamed, keys[..., prefilled:, :], values[..., prefilled:, :], kw(prefilled, prefilled + n))
    assert allowed.shape == (n, k.shape[-2])
    # the same sums over keys laid out in another order: float32 rounding (a wrong visibility is off by ~0.1)
    torch.testing.assert_close(attend(q, k, v, allowed), torch.cat(expected, dim=-2), rtol=1e-5, atol=1e-5)
    assert streamed.counts() == stepped.counts() and streamed.get_seq_length() == stepped.get_seq_length()
    for part in ("key", "value"):  # the same codes, written once
        for key, t in stepped.stored[part].items():
            assert torch.equal(streamed.stored[part][key], t), (part, key)
    assert torch.equal(streamed.keys, stepped.keys) and torch.equal(streamed.values, stepped.values)


def test_visibility_of_a_per_token_scheme_is_the_quantized_past_and_the_own_token():
    """INT8 (residual 0, every token quantized on entry): query i sees tokens < i quantized, itself in full."""
    layer = kvcache.layer_from_dense(*random_kv(5), STREAM_SPECS["int8"]())
    allowed = stream.visibility(layer, 3, "cpu")  # 5 codes | 3 new (full precision) | 2 quantized copies
    assert allowed.tolist() == [
        [True] * 5 + [True, False, False] + [False, False],
        [True] * 5 + [False, True, False] + [True, False],
        [True] * 5 + [False, False, True] + [True, True],
    ]


def test_visibility_under_kivis_policy_reads_each_key_and_value_as_its_step_would():
    """KIVI's policy at R = G = 8 after a 12-token prefill: keys 0–7 in codes, 8–11 in full precision; values 0–3
    in codes, 4–11 in full precision. Feeding tokens 12…16, step i quantizes the value of token 4 + i, and step 3,
    which brings the 8th full-precision key (token 15), flushes keys 8–15. So a token is read in one of three
    ways: key and value exact, key dequantized only (tokens 4–7 until their values go; 8–15 at step 4), or both
    dequantized; every query reads every token it has once."""
    layer = kvcache.layer_from_dense(*random_kv(12), kind_of(qspec("kivi", residual=8, group=8)).scheme.layer_spec(0, 2, 16))
    assert layer.coded == (8, 4)
    fixed, ways = stream._layout(layer, 5)
    assert fixed == 4  # tokens 0–3: key and value in codes before the first step
    tokens = {(dk, dv): (t + fixed).tolist() for dk, dv, t, _ in ways}
    seen = {(dk, dv): s.tolist() for dk, dv, _, s in ways}
    assert tokens == {(False, False): list(range(8, 17)), (True, False): list(range(4, 16)), (True, True): [4, 5, 6, 7]}
    F, T = False, True
    assert seen[(T, T)] == [[F, F, F, F], [T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]]
    assert seen[(T, F)][0] == [T] * 4 + [F] * 8 and seen[(T, F)][4] == [F] * 4 + [T] * 8
    assert seen[(F, F)][3] == [T] * 8 + [F] and seen[(F, F)][4] == [F] * 8 + [T]
    allowed = stream.visibility(layer, 5, "cpu")
    assert allowed[:, :fixed].all() and allowed.sum(1).tolist() == [13 + i for i in range(5)]


def test_teacher_forcing_in_one_pass_equals_token_by_token(tiny, sharp):
    """Through the engine: quantized rows (KIVI under both policies with flushes inside the path, INT8, FP8,
    SnapKV + KIVI; KVQuant,
    which needs a calibration, is checked layer by layer above) and dense rows teacher-forced in one pass give the log-probabilities and greedy choices of
    feeding the path one token at a time."""
    methods = {
        "full": {"kind": "full"},
        "kivi4": qspec("kivi", residual=8, group=8), "kivi4_together": qspec("kivi", residual=4, group=8, policy="together"),
        "int8": qspec("int8"), "fp8": qspec("fp8"),
        "snap_kivi2": {**qspec("kivi", bits=2, residual=8, group=8), "press": "SnapKVPress", "kwargs": {"window_size": 16}},
    }
    (sample,) = KINDS["niah"].generate("niah_single", {"depths": [0.5], "samples": 1, "seed": 1}, tiny[1], 500)
    base = prefill(sharp, sample.prompt.context)
    caches = [compress(sharp, base, v) for v in variants(build(methods), [0.5])]
    tail = sample.prompt.question + sample.prompt.suffix
    path = list(range(40, 70))  # 30 tokens: several KIVI groups flush inside the path
    one_pass, choice = teacher_forced(sharp, caches, tail, path, base.length)
    steps, step_choice = teacher_forced(sharp, caches, tail, path, base.length, stream=False)
    torch.testing.assert_close(one_pass, steps, rtol=1e-4, atol=1e-4)
    assert torch.equal(choice, step_choice)


@pytest.mark.parametrize("name", sorted(STREAM_SPECS))
def test_codes_decoded_once_equal_decoding_them_all(name):
    """The dequantizing path keeps its view and decodes only codes added since (`_viewed`): after prefill and many
    single-token updates (several flushes), the view is the sinks, every code decoded from scratch and the residual,
    bit for bit."""
    spec = STREAM_SPECS[name]()
    keys, values = random_kv(70, seed=3)
    cos, sin = rope_tables(70)
    kw = lambda a, b: {"cos": cos[:, a:b], "sin": sin[:, a:b]} if spec.rope else None  # noqa: E731
    layer = kvcache.layer_from_dense(keys[..., :20, :], values[..., :20, :], spec, *((cos[:, :20], sin[:, :20]) if spec.rope else ()))
    for t in range(20, 70):
        layer.update(keys[..., t : t + 1, :], values[..., t : t + 1, :], kw(t, t + 1))
    lo = spec.sink_tokens
    view = layer.full()
    for got, part, codec, n, sinks, residual in zip(view, ("key", "value"), (spec.key, spec.value), layer.coded,
                                                     (layer.sink_keys, layer.sink_values), (layer.keys, layer.values)):
        shape = (*layer.keys.shape[:2], n, layer.keys.shape[-1])
        tables = (layer.cos[:, lo : lo + n], layer.sin[:, lo : lo + n]) if spec.rope else (None, None)
        every = codec.decode(layer.stored[part], shape, *tables).to(layer.dtype)  # every code at once, as stored
        parts = [t for t in (sinks, every, residual) if t is not None]
        assert n > 20 and got.shape[-2] == 70 and torch.equal(got, torch.cat(parts, dim=-2)), part
    before = [t.clone() for t in view]
    fork = layer.fork()  # a fork writes its own view: 30 more tokens in it leave the original's as it was
    more_k, more_v = random_kv(30, seed=4)
    rope = dict(zip(("cos", "sin"), rope_tables(100)))
    for t in range(30):
        fork.update(more_k[..., t : t + 1, :], more_v[..., t : t + 1, :],
                    {k: v[:, 70 + t : 71 + t] for k, v in rope.items()} if spec.rope else None)
    assert fork.full()[0].shape[-2] == 100 and all(torch.equal(a, b) for a, b in zip(layer.full(), before))


@pytest.mark.parametrize("prefilled,n", [(21, 30), (40, 17), (8, 9)])
def test_layers_share_a_layout_only_where_they_quantize_alike(prefilled, n):
    """stream._layout keeps one layout per schedule and counts (a row's 24 layers compute it once): asked for every
    spec's layer after every other's, each gets the layout computed for itself."""
    layers = {}
    for name, make in STREAM_SPECS.items():
        spec = make()
        keys, values = random_kv(prefilled, seed=prefilled)
        cos, sin = rope_tables(prefilled)
        layers[name] = kvcache.layer_from_dense(keys, values, spec, *((cos, sin) if spec.rope else ()))
    stream._LAYOUTS.clear()
    shared = [stream._layout(layer, n) for layer in layers.values()]
    for (name, layer), got in zip(layers.items(), shared):
        fixed, ways = stream._plan_layout(layer, n)
        assert got[0] == fixed and len(got[1]) == len(ways), name
        for a, b in zip(got[1], ways):
            assert a[:2] == b[:2] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), name
    assert len(stream._LAYOUTS) < len(layers)  # some specs quantize alike: they shared one
