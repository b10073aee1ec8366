"""Quantized cache layers (kvlab.kernels.kvcache) and quantized methods in the engine, on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import Cache

from kvlab.engine import Batch, cache_stats, compress, evaluate_sample, prefill
from kvlab.kernels import codecs, kvcache, layouts, quant
from kvlab.methods import Variant, build, kind_of, variants

H, D = 2, 16
QDEFAULTS = {"bits": 4, "group": 8, "residual": 8, "key_axis": "channel", "value_axis": "token",
             "scales": "dynamic", "outliers": 0.0, "sink_tokens": 0}


def qspec(scheme: str, **kw) -> dict:
    """A quant method entry as the schema fills it (fp8, int8 and lmdeploy leave `residual` to its default, 0)."""
    spec = {"kind": "quant", "scheme": scheme, **QDEFAULTS, **kw}
    if scheme in ("fp8", "int8", "lmdeploy") and "residual" not in kw:
        del spec["residual"]
    return spec


def random_kv(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H, t, D, generator=g)
    keys[..., 3] *= 20  # an outlier channel, as real keys have
    return keys, torch.randn(1, H, t, D, generator=g)


def rope_tables(t: int, start: int = 0):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.arange(start, start + t).float()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)[None]
    return emb.cos(), emb.sin()


def kvquant_spec(bits=4, outliers=0.0, sink_tokens=0) -> kvcache.LayerSpec:
    levels = torch.linspace(-1, 1, 2**bits)
    hi = torch.full((H, D), 3.0)
    hi[:, 3] = 60.0
    key = codecs.GridKeyCodec(bits, levels, -hi, hi, kvcache.outliers_per_vector(outliers, D))
    return kvcache.LayerSpec(key, codecs.AffineCodec(bits, 8, "token"), group=8, residual=8, sink_tokens=sink_tokens, rope=True)


SPECS = {
    "kivi4": lambda: kind_of(qspec("kivi")).scheme.layer_spec(0, H, D),
    "kivi4_together": lambda: kind_of(qspec("kivi", policy="together")).scheme.layer_spec(0, H, D),
    "kivi2_swapped": lambda: kind_of(qspec("kivi", bits=2, key_axis="token", value_axis="channel")).scheme.layer_spec(0, H, D),
    "int8": lambda: kind_of(qspec("int8")).scheme.layer_spec(0, H, D),
    "lmdeploy4": lambda: kind_of(qspec("lmdeploy")).scheme.layer_spec(0, H, D),
    "fp8_dynamic": lambda: kind_of(qspec("fp8")).scheme.layer_spec(0, H, D),
    "fp8_static": lambda: kvcache.LayerSpec(codecs.FP8Codec(torch.full((H,), 0.05)), codecs.FP8Codec(torch.full((H,), 0.01)), 1, 0),
    "kvquant": lambda: kvquant_spec(outliers=0.05, sink_tokens=2),
}
LAYOUTS = {
    "kivi4": kind_of(qspec("kivi")).layouts(D),
    "kivi4_together": kind_of(qspec("kivi", policy="together")).layouts(D),
    "kivi2_swapped": kind_of(qspec("kivi", bits=2, key_axis="token", value_axis="channel")).layouts(D),
    "int8": kind_of(qspec("int8")).layouts(D),
    "lmdeploy4": kind_of(qspec("lmdeploy")).layouts(D),
    "fp8_dynamic": kind_of(qspec("fp8")).layouts(D),
    "fp8_static": kind_of(qspec("fp8", scales="calibrated")).layouts(D),
    "kvquant": (layouts.TensorCodes(4, "static", outliers=1), layouts.TensorCodes(4, "token", 8)),
}


def feed(layer, keys, values, start, chunk):
    """Append keys[start:] to `layer` `chunk` tokens at a time (with their RoPE tables)."""
    for i in range(start, keys.shape[-2], chunk):
        cos, sin = rope_tables(min(chunk, keys.shape[-2] - i), i)
        layer.update(keys[..., i : i + chunk, :], values[..., i : i + chunk, :], {"cos": cos, "sin": sin})


@pytest.mark.parametrize("name", list(SPECS))
def test_streaming_gives_the_codes_of_quantizing_at_once(name):
    """Tokens appended one at a time are stored exactly as a prefill of the same tokens: groups are quantized
    once, when complete, and never re-quantized. (A dynamic FP8 scale is set by the prefill and kept.)"""
    keys, values = random_kv(61)
    cos, sin = rope_tables(61)
    streamed = kvcache.layer_from_dense(keys[..., :5, :], values[..., :5, :], SPECS[name](), cos[:, :5], sin[:, :5])
    spec = SPECS[name]()
    if name == "fp8_dynamic":
        spec.key.dynamic, spec.value.dynamic = streamed.spec.key.dynamic, streamed.spec.value.dynamic
    at_once = kvcache.layer_from_dense(keys, values, spec, cos, sin)
    before = {t: {k: v.clone() for k, v in d.items()} for t, d in streamed.stored.items()}
    feed(streamed, keys, values, 5, 1)
    assert streamed.counts() == at_once.counts()
    for tensor in ("key", "value"):
        for part, codes in at_once.stored[tensor].items():
            assert torch.equal(streamed.stored[tensor][part], codes), (tensor, part)
            old = before[tensor].get(part)
            if old is not None:  # what was stored earlier is a prefix, untouched
                assert torch.equal(streamed.stored[tensor][part][:, :, : old.shape[2]], old)
    assert torch.equal(streamed.keys, at_once.keys)  # the residual


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("t", [1, 7, 8, 16, 33, 100])
def test_measured_bytes_equal_the_formula(name, t):
    keys, values = random_kv(t)
    cos, sin = rope_tables(t)
    layer = kvcache.layer_from_dense(keys, values, SPECS[name](), cos, sin)
    n = layer.counts()
    key, value = LAYOUTS[name]
    dense = n["sink_tokens"] + n["residual_keys"], n["sink_tokens"] + n["residual_values"]
    coded = n["quantized_keys"], n["quantized_values"]
    assert layer.nbytes() == layouts.stored_layer_bytes(key, value, H, D, coded, dense, 4)
    assert sum(coded) + sum(dense) == 2 * t == 2 * layer.get_seq_length()


@pytest.mark.parametrize("name", list(SPECS))
def test_a_quantized_layer_holds_only_what_it_stores(name):
    """Built from a prefill, a layer keeps no full-precision view and no slice of the prefill's tensors: the memory its
    tensors hold is the bytes it counts (the prefill's K/V freed with it; issue 53's 3x at 16K)."""
    keys, values = random_kv(100)
    cos, sin = rope_tables(100)
    layer = kvcache.layer_from_dense(keys, values, SPECS[name](), cos, sin)
    assert layer._view is None
    held = [t for t in (layer.keys, layer.values, layer.sink_keys, layer.sink_values) if t is not None]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in held)
    assert all(t.untyped_storage().data_ptr() != keys.untyped_storage().data_ptr() for t in held if t.numel())


@pytest.mark.parametrize("scheme", ["fp8", "int8", "lmdeploy"])
def test_fp8_int8_and_lmdeploy_quantize_every_token_unless_given_a_residual(scheme):
    keys, values = random_kv(20)
    every = kvcache.layer_from_dense(keys, values, kind_of(qspec(scheme)).scheme.layer_spec(0, H, D))
    assert every.counts() == counts(0, 20, 20, 0, 0)
    every.update(*random_kv(1, seed=1))
    assert every.coded == (21, 21)  # a decoded token is stored quantized at once
    window = kvcache.layer_from_dense(keys, values, kind_of(qspec(scheme, residual=8)).scheme.layer_spec(0, H, D))
    assert window.counts() == counts(0, 12, 12, 8, 8)


def counts(sinks: int, coded_keys: int, coded_values: int, residual_keys: int, residual_values: int) -> dict:
    return {"sink_tokens": sinks, "quantized_keys": coded_keys, "quantized_values": coded_values,
            "residual_keys": residual_keys, "residual_values": residual_values}


def test_kivi_streams_as_kivis_own_cache():
    """KIVI's policy (jy-yuan/KIVI, models/llama_kivi.py): a prefill of T tokens stores T − T mod R keys and
    T − R values as codes; then keys flush all R of their full-precision tokens at once when R are held, and
    values quantize the oldest single one beyond R. After a 100-token prefill and 70 appends at R = 32, 0–31
    keys and exactly 32 values are in full precision. The new token is always exact in the view."""
    spec = kind_of(qspec("kivi", group=32, residual=32)).scheme.layer_spec(0, H, D)
    keys, values = random_kv(170)
    layer = kvcache.layer_from_dense(keys[..., :100, :], values[..., :100, :], spec)
    assert layer.counts() == counts(0, 96, 68, 4, 32)
    for t in range(100, 170):
        out_k, out_v = layer.update(keys[..., t : t + 1, :], values[..., t : t + 1, :])
        assert torch.equal(out_k[..., -1:, :], keys[..., t : t + 1, :]) and torch.equal(out_v[..., -1:, :], values[..., t : t + 1, :])
        held = t + 1
        assert layer.counts() == counts(0, held // 32 * 32, held - 32, held % 32, 32)
    assert torch.equal(layer.values, values[..., -32:, :]) and torch.equal(layer.keys, keys[..., 160:, :])
    # the split a prefill of all 170 gives: the same codes as streaming them
    at_once = kvcache.layer_from_dense(keys, values, spec)
    assert at_once.counts() == layer.counts()
    for part in ("key", "value"):
        for name, codes in at_once.stored[part].items():
            assert torch.equal(layer.stored[part][name], codes), (part, name)


def test_kivi_refuses_a_residual_its_keys_cannot_flush_in_whole_groups():
    for residual in (0, 12):
        with pytest.raises(ValueError, match=f"residual must be a positive multiple of group 8, got {residual}"):
            kind_of(qspec("kivi", residual=residual)).scheme.layer_spec(0, H, D)
        kind_of(qspec("kivi", residual=residual, policy="together")).scheme.layer_spec(0, H, D)  # its own rule


def test_kivi_together_keeps_the_last_residual_tokens_exact_and_quantizes_whole_groups():
    keys, values = random_kv(8)
    layer = kvcache.layer_from_dense(keys, values, SPECS["kivi4_together"]())
    for t in range(8, 60):
        n = layer.counts()
        assert n["residual_keys"] == n["residual_values"] and n["quantized_keys"] == n["quantized_values"]
        n = {"residual_tokens": n["residual_keys"], "quantized_tokens": n["quantized_keys"]}
        assert 8 <= n["residual_tokens"] < 16 and n["quantized_tokens"] % 8 == 0
        k, v = random_kv(1, seed=t)
        out_k, out_v = layer.update(k, v)
        assert torch.equal(out_k[..., -1:, :], k) and torch.equal(out_v[..., -1:, :], v)  # the new token, exact
        assert torch.equal(out_k[..., -9:-1, :], layer.keys[..., -9:-1, :]) or n["residual_tokens"] == 15


@pytest.mark.parametrize("name", [n for n in SPECS if n != "kivi2_swapped"])
def test_dequantized_view_is_close_to_the_input(name):
    keys, values = random_kv(64)
    cos, sin = rope_tables(64)
    layer = kvcache.layer_from_dense(keys, values, SPECS[name](), cos, sin)
    k, v = layer.full()
    assert k.shape == keys.shape
    assert (k - keys).abs().mean() < 0.15 * keys.abs().mean()
    assert (v - values).abs().mean() < 0.15 * values.abs().mean()


def test_two_bit_keys_with_an_outlier_channel_need_per_channel_groups():
    """The KIVI ablation in miniature: a channel 20x larger than the rest swamps per-token groups."""
    keys, values = random_kv(64)
    layers = {axis: kvcache.layer_from_dense(keys, values, kind_of(qspec("kivi", bits=2, key_axis=axis)).scheme.layer_spec(0, H, D))
              for axis in ("channel", "token")}
    coded = min(layer.coded_keys for layer in layers.values())  # keys both store as codes (KIVI's policy: 64, 56)
    normal = [c for c in range(D) if c != 3]
    err = {axis: float((layer.full()[0] - keys)[..., :coded, normal].abs().mean()) for axis, layer in layers.items()}
    assert err["token"] > 3 * err["channel"]


def test_kvquant_quantizes_keys_before_rope():
    """With a grid holding exactly the pre-RoPE values, codes are lossless: rotation is undone and redone."""
    t = 24
    levels = torch.tensor([-2.0, -1.0, 0.0, 1.0])
    pre = levels[torch.randint(0, 4, (1, H, t, D), generator=torch.Generator().manual_seed(0))]
    cos, sin = rope_tables(t)
    keys = codecs.rotate(pre, cos[:, None], sin[:, None])
    # range [-2, 2] per channel: normalized values are the key values / 2
    codec = codecs.GridKeyCodec(2, levels / 2, torch.full((H, D), -2.0), torch.full((H, D), 2.0))
    back = codec.decode(codec.encode(keys, cos, sin), keys.shape, cos, sin)
    torch.testing.assert_close(back, keys, atol=1e-5, rtol=0)
    # quantizing the rotated keys directly on that grid would not be lossless
    assert (quant.grid_dequantize(quant.grid_quantize(keys.reshape(-1, D), levels, 2), levels, 2).view_as(keys) - keys).abs().max() > 0.1


def test_kvquant_outliers_and_sinks_are_kept_in_full_precision():
    keys, values = random_kv(40)
    cos, sin = rope_tables(40)
    layer = kvcache.layer_from_dense(keys, values, kvquant_spec(bits=2, outliers=0.05, sink_tokens=2), cos, sin)
    k, _ = layer.full()
    assert torch.equal(k[..., :2, :], keys[..., :2, :])  # sinks
    pre = codecs.unrotate(keys, cos[:, None], sin[:, None])
    back = codecs.unrotate(k, cos[:, None], sin[:, None])
    worst = (pre - back).abs()[..., 2:24, :].argmax(-1)  # within quantized tokens
    biggest = (pre / layer.spec.key.hi[None, :, None]).abs()[..., 2:24, :].argmax(-1)  # symmetric ranges here
    assert not bool((worst == biggest).any())  # the largest entry of every vector is never the worst one


@pytest.mark.parametrize("which,bad,message", [("keys", float("nan"), "keys: 1 NaN/Inf"),
                                               ("values", 4e4, "values: .* exceeds what fp16 scales")])
def test_bad_values_are_refused_before_storing(which, bad, message):
    layer = kvcache.QuantizedKVLayer(SPECS["kivi4"]())
    keys, values = random_kv(20)
    {"keys": keys, "values": values}[which][0, 0, 3, 3] = bad
    with pytest.raises(ValueError, match=message):
        layer.update(keys, values)
    assert layer.quantized == 0 and layer.get_seq_length() == 0


def test_fp16_metadata_range_binds_affine_codes_only():
    """FP8 codes keep a float32 scale: values beyond fp16 metadata's range are theirs to encode (saturating)."""
    keys, values = random_kv(20)
    values[0, 0, 3, 3] = 4e4
    layer = kvcache.layer_from_dense(keys, values, SPECS["fp8_dynamic"]())
    assert layer.quantized == 20


def test_a_bad_decoded_token_is_refused_at_the_next_read():
    """A one-token append that quantizes nothing reads nothing (decoding does not wait for the GPU at every
    token): it only records on the device that its token was not finite; the next append that reads (the next
    quantizing one) refuses it, and nothing of that call is stored. (Under KIVI's own policy nearly every step
    quantizes a value, so it reads: see the next test.)"""
    spec = SPECS["kivi4_together"]()
    layer = kvcache.QuantizedKVLayer(spec)
    keys, values = random_kv(spec.residual + spec.group)
    keys[0, 0, spec.residual, 3] = float("inf")  # the first decoded token: held until R + G tokens are
    layer.update(keys[..., : spec.residual, :], values[..., : spec.residual, :])
    for t in range(spec.residual, spec.residual + spec.group - 1):
        layer.append(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    assert layer.quantized == 0 and not bool(torch.isfinite(layer.keys).all())
    with pytest.raises(ValueError, match="quantized cache layer keys: 1 NaN/Inf"):
        layer.append(keys[..., -1:, :], values[..., -1:, :])
    assert layer.quantized == 0 and layer.get_seq_length() == spec.residual + spec.group - 1


def test_under_kivis_policy_a_bad_decoded_token_is_refused_by_the_step_that_quantizes_a_value():
    """Once R values are held, every step quantizes the oldest one, so it reads its data: a NaN/Inf decoded token
    is refused at its own append, and nothing of it is stored."""
    spec = SPECS["kivi4"]()
    layer = kvcache.QuantizedKVLayer(spec)
    keys, values = random_kv(spec.residual + 1)
    keys[0, 0, spec.residual, 3] = float("inf")
    layer.update(keys[..., : spec.residual, :], values[..., : spec.residual, :])
    assert layer.coded == (spec.residual, 0)
    with pytest.raises(ValueError, match="quantized cache layer keys entering full precision .*: 1 NaN/Inf"):
        layer.append(keys[..., -1:, :], values[..., -1:, :])
    assert layer.coded == (spec.residual, 0) and layer.get_seq_length() == spec.residual


@pytest.mark.parametrize("name", ["kivi4", "kvquant"])
@pytest.mark.parametrize("where", ["residual", "sinks"])
def test_a_bad_prefill_token_kept_in_full_precision_is_refused_when_it_enters(name, where):
    """A prefill reads its data once anyway: every token is checked then, not only the ones it quantizes, so a NaN
    bound for the residual (or the sinks) is refused at once rather than when its group is quantized later."""
    spec = SPECS[name]()
    if not {"sinks": spec.sink_tokens, "residual": spec.residual}[where]:
        pytest.skip(f"no {where}")
    t = spec.sink_tokens + 2 * spec.group + spec.residual  # quantizes two groups, keeps the last `residual` tokens
    keys, values = random_kv(t)
    values[0, 1, 0 if where == "sinks" else t - 1, 5] = float("nan")
    layer = kvcache.QuantizedKVLayer(spec)
    cos, sin = rope_tables(t)
    with pytest.raises(ValueError, match=r"^quantized cache layer values entering full precision \(sinks or residual\): "
                                         r"1 NaN/Inf value\(s\); KV entries must be finite$"):
        layer.update(keys, values, {"cos": cos, "sin": sin})
    assert layer.quantized == 0 and layer.get_seq_length() == 0


def test_a_short_prefill_that_quantizes_nothing_is_checked_too():
    spec = SPECS["kivi4"]()
    keys, values = random_kv(spec.residual - 1)  # R keys would be flushed at once under KIVI's policy
    keys[0, 0, 2, 1] = float("-inf")
    layer = kvcache.QuantizedKVLayer(spec)
    with pytest.raises(ValueError, match="keys entering full precision .*: 1 NaN/Inf"):
        layer.update(keys, values)
    assert layer.get_seq_length() == 0


def test_a_bad_decoded_value_survives_stacking_and_is_named():
    """The device flag of one-token appends travels with stack_layers (copies decoded as one batch), and the
    refusal names the tensor that holds the NaN (the together policy, whose one-token appends read nothing
    until a group flushes)."""
    spec = SPECS["kivi4_together"]()
    keys, values = random_kv(spec.residual + spec.group)
    layers = []
    for poisoned in (False, True):
        layer = kvcache.QuantizedKVLayer(spec)
        layer.update(keys[..., : spec.residual, :], values[..., : spec.residual, :])
        v = values[..., spec.residual : spec.residual + 1, :].clone()
        if poisoned:
            v[0, 1, 0, 2] = float("nan")
        layer.append(keys[..., spec.residual : spec.residual + 1, :], v)
        layers.append(layer)
    stacked = kvcache.stack_layers(layers)
    for t in range(spec.residual + 1, spec.residual + spec.group - 1):
        stacked.append(torch.cat([keys[..., t : t + 1, :]] * 2), torch.cat([values[..., t : t + 1, :]] * 2))
    with pytest.raises(ValueError, match=r"^quantized cache layer values: 1 NaN/Inf value\(s\) entered full precision in an earlier one-token append"):
        stacked.append(torch.cat([keys[..., -1:, :]] * 2), torch.cat([values[..., -1:, :]] * 2))


def test_fp8_dynamic_scale_refuses_an_all_zero_prefill():
    """peak / 448 of an all-zero prefill was clamped to 1e-12: every later token then saturated at ±4.5e-10."""
    layer = kvcache.QuantizedKVLayer(SPECS["fp8_dynamic"]())
    keys, values = random_kv(24)
    zeros = torch.zeros_like(keys[..., :16, :])
    with pytest.raises(ValueError, match=r"^quantized cache layer keys: fp8 dynamic scale: "
                                         r"the first tokens quantized peak at \|x\| = 0 .*use scales: calibrated$"):
        layer.update(zeros, values[..., :16, :])
    assert layer.get_seq_length() == 0 and layer.spec.key.dynamic is None
    # a prefill with content sets the scale; later tokens then round-trip within E4M3's precision
    layer.update(keys[..., :16, :], values[..., :16, :])
    for i in range(16, 24):
        layer.update(keys[..., i : i + 1, :], values[..., i : i + 1, :])
    k, _ = layer.full()
    assert torch.allclose(k[..., 16:, :], keys[..., 16:, :], rtol=2**-4, atol=float(layer.spec.key.dynamic) * 2**-6)


def test_fp8_dynamic_scale_floor_keeps_later_tokens_when_no_read_could_check():
    """Where the first peak cannot be read (a CUDA graph capture) the scale's floor still leaves later tokens of
    |x| ≤ FP8_MIN_PEAK representable; the old 1e-12 floor reduced them all to about zero."""
    codec = codecs.FP8Codec()
    codec.encode(torch.zeros(1, H, 4, D))
    assert float(codec.dynamic) == pytest.approx(quant.FP8_MIN_PEAK / quant.FP8_MAX)
    x = torch.full((1, H, 1, D), quant.FP8_MIN_PEAK / 2)
    back = codec.decode(codec.encode(x), x.shape)
    assert torch.allclose(back, x, rtol=2**-4)


def test_fp8_counts_the_entries_it_clamps_per_row_through_forks_stacks_and_row_selection():
    """The probe's silent case: a constant 1e4 under scale 1 came back as 448 (relative error 0.96) and no row said
    so. Entries beyond half a step above ±448 × scale are counted per tensor and batch row; entries that round to
    448 anyway are not."""
    spec = kvcache.LayerSpec(codecs.FP8Codec(torch.ones(H)), codecs.FP8Codec(torch.ones(H)), 1, 0)
    keys, values = torch.full((1, H, 4, D), 100.0), torch.full((1, H, 4, D), 100.0)
    keys[0, 0, 1, :3] = 1e4  # 3 clamped keys
    values[0, 1, 2, 5] = -470.0  # 1 clamped value: past 464, E4M3 without a clamp would round it to -480
    values[0, 1, 3, 6] = 460.0  # rounds to 448 with or without the clamp: not counted
    layer = kvcache.QuantizedKVLayer(spec)
    layer.update(keys, values)
    assert layer.saturated_share("key") == (3, 4 * H * D) and layer.saturated_share("value") == (1, 4 * H * D)
    assert layer.full()[0][0, 0, 1, 0].item() == 448.0  # what the count reports: the clamp
    fork = layer.fork()
    fork.append(torch.full((1, H, 1, D), 1e4), torch.zeros(1, H, 1, D))  # a decoded token: every key entry clamps
    assert fork.saturated_share("key") == (3 + H * D, 5 * H * D) and layer.saturated_share("key") == (3, 4 * H * D)
    clean = kvcache.QuantizedKVLayer(spec)
    clean.update(torch.ones(1, H, 4, D), torch.ones(1, H, 4, D))
    both = kvcache.stack_layers([clean, layer])
    assert both.saturated_share("key") == (3, 2 * 4 * H * D)
    assert kvcache.select_rows(both, [1]).saturated_share("key") == (3, 4 * H * D)
    assert kvcache.select_rows(both, [0]).saturated_share("value") == (0, 4 * H * D)
    affine = kvcache.QuantizedKVLayer(SPECS["int8"]())
    affine.update(keys, values)
    assert affine.saturated_share("key") is None  # min-max codes cover every finite input


def test_fp8_saturation_reaches_the_rows_and_max_saturated_refuses_past_it(tiny, sample, monkeypatch):
    """The engine's rows carry the shares; an entry's max_saturated stops with one line naming the method. Static
    scales of 1e-4 make the tiny model's keys and values exceed ±448 × scale wherever |x| > 0.0448."""
    from kvlab.methods.schemes.fp8 import FP8

    model, tokenizer = tiny
    base = prefill(model, sample.prompt.context)

    def stats(name: str, **params):
        variant = Variant(name, "quant", 1.0, {k: v for k, v in qspec(**params).items() if k != "kind"})
        return cache_stats(compress(model, base, variant), variant, base.length)

    dynamic = stats("fp8", scheme="fp8")
    assert dynamic["kv_saturated_keys"] == 0 == dynamic["kv_saturated_values"]  # its scale: the prefill's peak
    assert math.isnan(stats("kivi4", scheme="kivi")["kv_saturated_keys"])  # min-max codes clamp nothing
    monkeypatch.setattr(FP8, "layer_spec", lambda self, layer, heads, head_dim: kvcache.LayerSpec(
        codecs.FP8Codec(torch.full((heads,), 1e-4)), codecs.FP8Codec(torch.full((heads,), 1e-4)), 1, 0))
    clamped = stats("fp8_tiny_scales", scheme="fp8")
    assert 0.5 < clamped["kv_saturated_keys"] <= 1 and 0.5 < clamped["kv_saturated_values"] <= 1
    with pytest.raises(ValueError, match=r"^method fp8_strict: \d+\.\d+% of the context's quantized keys saturated at "
                                         r"±448 × scale \(max_saturated 1\.000%\); calibrate the scales"):
        stats("fp8_strict", scheme="fp8", max_saturated=0.01)


@pytest.mark.parametrize("name", ["kivi4", "kivi4_together", "int8"])
def test_an_append_reads_the_device_once_whatever_it_quantizes(name, monkeypatch):
    """The checks of what an append quantizes (finite keys and values, within fp16 metadata's range) read the
    data back once for both tensors: on a GPU each read is a wait that stops the host from queueing the next
    launches. An append that quantizes nothing reads nothing."""
    reads = []
    for method in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda t, *a, _f=original, _m=method: reads.append(_m) or _f(t, *a))
    spec = SPECS[name]()
    layer = kvcache.QuantizedKVLayer(spec)
    keys, values = random_kv(8 + 16)
    layer.update(keys[..., :8, :], values[..., :8, :])
    per_append = []  # (whether it quantized, reads)
    for t in range(8, 24):
        before, coded = len(reads), layer.coded
        layer.append(keys[..., t : t + 1, :], values[..., t : t + 1, :])
        per_append.append((layer.coded != coded, len(reads) - before))
    # KIVI's policy: every append quantizes the oldest value beyond R = 8; together: a group of 8 at a time;
    # INT8: every token
    assert sum(flushed for flushed, _ in per_append) == (16 if spec.policy == "kivi" else 16 // spec.group)
    assert {n for flushed, n in per_append if flushed} == {1}
    assert {n for flushed, n in per_append if not flushed} <= {0}


@pytest.fixture(scope="module")
def sample(tiny):
    from kvlab.tasks import KINDS

    _, tokenizer = tiny
    spec = {"kind": "continuation", "samples": 1, "seed": 0, "continuation_tokens": 40}
    return KINDS["continuation"].generate("prose", spec, tokenizer, 200)[0]


METHODS = {
    "full": {"kind": "full"},
    "kivi4": qspec("kivi", group=16, residual=16),
    "kivi2": qspec("kivi", bits=2, group=16, residual=16),
    "int8": qspec("int8"),
    "fp8": qspec("fp8"),
    "hf4": {"kind": "hf_quantized", "bits": 4, "group": 16, "residual": 16},
    "snap_kivi4": {**qspec("kivi", group=16, residual=16), "press": "SnapKVPress", "kwargs": {"window_size": 16}},
}


def test_every_quantized_method_runs_in_the_engine_with_honest_bytes(tiny, sample):
    model, tokenizer = tiny
    grid = variants(build(METHODS), [0.5])
    rows = {r["method"]: r for r in evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], 4)}
    assert rows["full"]["kl_vs_full"] == 0
    for name in METHODS:
        r = rows[name]
        assert r["kl_vs_full"] >= 0 and r["tf_tokens"] == 40
        if name != "hf4":
            assert r["kv_bytes"] == r["kv_bytes_formula"], name
    assert rows["kivi4"]["kl_vs_full"] < rows["kivi2"]["kl_vs_full"]
    assert rows["int8"]["kl_vs_full"] < rows["kivi4"]["kl_vs_full"]
    assert rows["snap_kivi4"]["kv_bytes"] < rows["kivi4"]["kv_bytes"] < rows["full"]["kv_bytes"]
    assert rows["snap_kivi4"]["budget"] == 0.5 and rows["kivi4"]["budget"] == 1.0


def test_composition_stores_codes_for_exactly_the_kept_tokens(tiny, sample):
    model, _ = tiny
    base = prefill(model, sample.prompt.context)
    spec = METHODS["snap_kivi4"]
    evicted = compress(model, base, Variant("snap", "kvpress", 0.5, {"press": spec["press"], "kwargs": spec["kwargs"]}))
    composed = compress(model, base, Variant("snap_kivi4", "quant", 0.5, {k: v for k, v in spec.items() if k != "kind"}))
    for dense, q in zip(evicted.layers, composed.layers):
        n = q.counts()
        for part in ("keys", "values"):
            assert n[f"quantized_{part}"] + n[f"residual_{part}"] == dense.keys.shape[-2]
        k, v = q.full()
        for got, kept, part in ((k, dense.keys, "keys"), (v, dense.values, "values")):
            if n[f"residual_{part}"]:  # the newest kept tokens, exact
                torch.testing.assert_close(got[..., -n[f"residual_{part}"]:, :], kept[..., -n[f"residual_{part}"]:, :])


def test_batched_quantized_rows_decode_as_if_alone(tiny, sample):
    """A quantized row batched with dense ones gives the logits it gives alone, and its cache is not changed."""
    model, _ = tiny
    p = sample.prompt
    base = prefill(model, p.context)
    q = compress(model, base, variants(build({"k": METHODS["kivi2"]}), [1.0])[0])
    full = compress(model, base, Variant("full", "full", 1.0))
    held = q.layers[0].counts()
    tail = torch.tensor([p.suffix + sample.prompt.reference[:20]])
    alone = Batch(model, [q]).forward(tail, base.length, logits_to_keep=tail.shape[1])
    together = Batch(model, [full, q]).forward(tail.expand(2, -1), base.length, logits_to_keep=tail.shape[1])
    torch.testing.assert_close(together[1], alone[0], rtol=1e-4, atol=1e-4)
    dense = Batch(model, [full]).forward(tail, base.length, logits_to_keep=tail.shape[1])
    torch.testing.assert_close(together[0], dense[0], rtol=1e-5, atol=1e-5)  # dense rows unchanged by the mix
    assert q.layers[0].counts() == held  # the batch forked the rows


def tiny_decoder(architecture: str, **extra):
    cfg = AutoConfig.for_model(
        architecture, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=H, head_dim=D, **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


DECODERS = {
    "qwen2": lambda: tiny_decoder("qwen2"),
    "llama": lambda: tiny_decoder("llama"),
    "gemma3": lambda: tiny_decoder("gemma3_text", sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("architecture", list(DECODERS))
def test_generate_runs_with_each_quantized_cache(architecture):
    """transformers' own generate() with kvlab's layers (sliding-window layers left as transformers' own)."""
    model = DECODERS[architecture]()
    ids = torch.randint(3, 250, (1, 50), generator=torch.Generator().manual_seed(0))
    for name in ("kivi", "int8", "fp8", "lmdeploy"):
        cache = kind_of(qspec(name)).empty_cache(model)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.shape[1] == 62
        quantized = [layer for layer in cache.layers if isinstance(layer, kvcache.QuantizedKVLayer)]
        assert len(quantized) == (1 if architecture == "gemma3" else 2)
        assert all(layer.get_seq_length() == 61 and layer.quantized > 0 for layer in quantized)
    if architecture != "gemma3":  # pre-RoPE keys: the RoPE tables come from the model's attention via cache_kwargs
        cache = Cache(layers=[kvcache.QuantizedKVLayer(kvquant_spec(outliers=0.05, sink_tokens=1)) for _ in range(2)])
        assert model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape[1] == 54


def test_hybrid_model_rows_decode_as_if_alone():
    """Gemma-style sliding layers (equal in every row) batch with a quantized full layer: each row's logits
    equal the ones it gives alone, and the sliding layers hold no padding."""
    model = DECODERS["gemma3"]()
    base = prefill(model, list(range(3, 83)))
    q = compress(model, base, variants(build({"k": qspec("kivi")}), [1.0])[0])
    full = compress(model, base, Variant("full", "full", 1.0))
    tail = torch.tensor([[90, 91, 92, 93]])
    alone = [Batch(model, [c]).forward(tail, base.length, logits_to_keep=4)[0] for c in (full, q)]
    batch = Batch(model, [full, q])
    together = batch.forward(tail.expand(2, -1), base.length, logits_to_keep=4)
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[1], alone[1], rtol=1e-4, atol=1e-4)
    assert batch.cache.layers[0].keys.shape[-2] < 32  # within the sliding window: no padding


def test_sliding_layers_of_a_hybrid_model_are_left_alone():
    model = DECODERS["gemma3"]()
    base = prefill(model, list(range(3, 83)))
    cache = compress(model, base, variants(build({"k": qspec("kivi")}), [1.0])[0])
    assert cache.layers[0] is not base.cache.layers[0] and type(cache.layers[0]) is type(base.cache.layers[0])
    assert torch.equal(cache.layers[0].keys, base.cache.layers[0].keys)
    assert isinstance(cache.layers[1], kvcache.QuantizedKVLayer)
    stats = cache_stats(cache, variants(build({"k": qspec("kivi")}), [1.0])[0], base.length)
    assert stats["kv_bytes"] == stats["kv_bytes_formula"]
