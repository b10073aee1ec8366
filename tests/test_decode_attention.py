"""Decode attention over quantized cache layers (kvlab.kernels.decode_attention): the torch reference equals dense
attention over the dequantized cache, and the Triton kernel that reads the packed codes equals the reference —
under TRITON_INTERPRET=1 on the CPU (conftest.py), compiled on CUDA when present. Odd token counts, GQA with
7 query heads per KV head, several splits of the token axis, every code format the kernel reads."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.kernels import decode_attention as da
from kvlab.kernels import codecs, kvcache

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] * INTERPRETED + ["cuda"] * torch.cuda.is_available()
HEADS, REP, DIM = 2, 7, 64


def spec_for(name: str) -> kvcache.LayerSpec:
    if name == "fp8-static":
        scales = torch.tensor([0.01, 0.02])
        return kvcache.LayerSpec(codecs.FP8Codec(scales), codecs.FP8Codec(scales * 0.5), group=1, residual=5)
    if name == "fp8-dynamic":
        return kvcache.LayerSpec(codecs.FP8Codec(), codecs.FP8Codec(), group=1, residual=5)
    if name == "int8-token":
        codec = codecs.AffineCodec(8, DIM, "token")
        return kvcache.LayerSpec(codec, codec, group=1, residual=3)
    if name in ("kivi4-keys-by-token", "kivi4-values-by-channel"):  # the other axis for keys or for values
        key_axis, value_axis = ("token", "token") if name == "kivi4-keys-by-token" else ("channel", "channel")
        return kvcache.LayerSpec(codecs.AffineCodec(4, 32, key_axis), codecs.AffineCodec(4, 32, value_axis),
                                 group=32, residual=7, sink_tokens=3)
    if name in ("kivi4-policy", "kivi4-swapped-policy"):  # KIVI's own streaming: more keys than values in codes
        key_axis, value_axis = ("channel", "token") if name == "kivi4-policy" else ("token", "channel")
        return kvcache.LayerSpec(codecs.AffineCodec(4, 32, key_axis), codecs.AffineCodec(4, 32, value_axis),
                                 group=32, residual=32, policy="kivi")
    bits, group = {"kivi2": (2, 32), "kivi4": (4, 32), "kivi4-g64": (4, 64), "kivi4-g16": (4, 16), "kivi8": (8, 32)}[name]
    return kvcache.LayerSpec(codecs.AffineCodec(bits, group, "channel"), codecs.AffineCodec(bits, group, "token"),
                             group=group, residual=7, sink_tokens=3)


FORMATS = ["kivi2", "kivi4", "kivi4-g64", "kivi8", "kivi4-keys-by-token", "kivi4-values-by-channel", "kivi4-policy",
           "kivi4-swapped-policy", "int8-token", "fp8-static", "fp8-dynamic"]


def layer_and_query(name: str, tokens: int, batch: int = 2, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, HEADS, tokens, DIM, generator=g) * 2
    keys[..., 5] += 8  # an outlier channel, as real keys have
    values = torch.randn(batch, HEADS, tokens, DIM, generator=g)
    layer = kvcache.layer_from_dense(keys.to(device), values.to(device), spec_for(name))
    q = torch.randn(batch, HEADS * REP, DIM, generator=g).to(device)
    new_k = torch.randn(batch, HEADS, 1, DIM, generator=g).to(device)
    new_v = torch.randn(batch, HEADS, 1, DIM, generator=g).to(device)
    return layer, q, new_k, new_v


def dense_attention(q, k, v, scaling):
    """Plain softmax attention of one query per sequence over dense (B, H, n, D), GQA by repeating heads."""
    k, v = (x.float().repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    w = torch.softmax(torch.einsum("bhd,bhnd->bhn", q.float(), k) * scaling, dim=-1)
    return torch.einsum("bhn,bhnd->bhd", w, v)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("tokens", [1, 45, 203])
def test_reference_equals_dense_attention_over_the_dequantized_cache(name, tokens):
    layer, q, new_k, new_v = layer_and_query(name, tokens)
    k, v = layer.full(new_k, new_v)
    want = dense_attention(q, k, v, 0.125)
    got = da.decode_attention(q, layer, new_k, new_v, 0.125, fused=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("tokens, splits, block_t", [(3, None, 32), (45, None, 32), (203, 1, 32), (203, 3, 64), (333, None, 128), (333, 2, 32)])
def test_triton_kernel_equals_the_reference(device, name, tokens, splits, block_t):
    """Codes in 1 or more splits plus the dense tokens (sinks, residual, new) in one launch, merged in a second;
    3 tokens: nothing quantized yet, the dense program alone. Tiles of 1 to 4 key groups, the last one partial
    (333 tokens hold 10 groups of 32)."""
    from kvlab.kernels import triton_decode

    layer, q, new_k, new_v = layer_and_query(name, tokens, device=device, seed=tokens)
    assert da.supported(layer) and (layer.quantized > 0) == (tokens > (100 if name == "kivi4-g64" else 10))
    dense_k, dense_v = da.dense_tokens(layer, new_k, new_v)
    got = triton_decode.attend(q, layer, da.supported(layer), dense_k, dense_v, 0.125, splits=splits, block_t=block_t)
    want = da.decode_attention(q, layer, new_k, new_v, 0.125, fused=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(da.decode_attention(q, layer, new_k, new_v, 0.125, fused=True), want, rtol=1e-5, atol=1e-5)


# fp16 runs in Triton's CPU interpreter too; it has no bf16 arithmetic.
SIXTEEN_BITS = [("cpu", torch.float16)] * INTERPRETED + [("cuda", torch.float16), ("cuda", torch.bfloat16)] * torch.cuda.is_available()


def model_dtype_case(name: str, device: str, dtype: torch.dtype, tokens: int = 4000, q_gain: float = 4.0):
    """A layer quantized from keys and values already in a model's dtype, and queries (×`q_gain`) in it too."""
    layer, q, new_k, new_v = layer_and_query(name, tokens, device=device, seed=4)
    layer = kvcache.layer_from_dense(*(x.to(dtype) for x in layer.full()), layer.spec)
    return layer, (q * q_gain).to(dtype), new_k.to(dtype), new_v.to(dtype)


@pytest.mark.parametrize("device, dtype", SIXTEEN_BITS)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_kernel_in_16_bits_is_within_rounding_of_the_reference(device, dtype, name):
    """A model's dtype: the kernel's code dots run in fp16 (dequantized in fp16), the dense segment's in the
    query's dtype. Emulating rounding in torch on these inputs (dequantized keys and values, then the softmax
    weights, rounded to the dtype) gives 5e-4 to 9e-4 relative error for fp16, 3.4e-3 to 7.4e-3 for bf16. The
    interpreter, which rounds fp16 at every step where a GPU fuses the dequantizing multiply-add, measured
    1.3e-5 (FP8, exact codes) to 3.2e-3 (INT8, whose 255·scale partly cancels the zero point). The bounds
    leave about 2x."""
    from kvlab.kernels import triton_decode

    layer, q, new_k, new_v = model_dtype_case(name, device, dtype)
    dense_k, dense_v = da.dense_tokens(layer, new_k, new_v)
    got = triton_decode.attend(q, layer, da.supported(layer), dense_k, dense_v, 0.125)
    want = da.decode_attention(q, layer, new_k, new_v, 0.125, fused=False)
    assert got.isfinite().all()
    assert float((got - want).norm() / want.norm()) < {torch.float16: 6e-3, torch.bfloat16: 1.5e-2}[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 queries need a GPU: Triton's CPU interpreter has no bf16 arithmetic")
@pytest.mark.parametrize("name", ["kivi4", "fp8-static"])
def test_bf16_queries_beyond_fp16_range_are_scaled_into_it(name):
    """Query entries of up to about 1e5 (fp16 ends at 65504) give finite scores through the fp16 code dots."""
    from kvlab.kernels import triton_decode

    layer, q, new_k, new_v = model_dtype_case(name, "cuda", torch.bfloat16, q_gain=4.0 * 2**13)
    assert q.abs().max() > 65504
    dense_k, dense_v = da.dense_tokens(layer, new_k, new_v)
    got = triton_decode.attend(q, layer, da.supported(layer), dense_k, dense_v, 0.125)
    want = da.decode_attention(q, layer, new_k, new_v, 0.125, fused=False)
    assert got.isfinite().all()
    assert float((got - want).norm() / want.norm()) < 1.5e-2


def test_merge_of_segments_equals_attention_over_their_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 14, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    parts = [da.dense_segment(q, k[:, :, a:b], v[:, :, a:b], 0.3) for a, b in ((0, 17), (17, 17), (17, 50))]
    torch.testing.assert_close(da.merge(parts), dense_attention(q, k, v, 0.3), rtol=1e-5, atol=1e-6)


def test_layouts_the_tiles_do_not_fit_take_the_dequantizing_path():
    """16-token key groups (wrong in bf16 on an H200, see decode_attention.tileable), head dims that are not a
    power of two, channel-axis keys and values of other bits, and token-axis groups short of a 32-bit word are
    left to the torch path, which still gives the reference output."""
    layer, q, new_k, new_v = layer_and_query("kivi4-g16", 45)
    assert layer.quantized and da.supported(layer) is None
    want = da.decode_attention(q, layer, new_k, new_v, 0.125, fused=False)
    torch.testing.assert_close(da.decode_attention(q, layer, new_k, new_v, 0.125), want)
    odd = kvcache.layer_from_dense(torch.randn(1, HEADS, 60, 96), torch.randn(1, HEADS, 60, 96), spec_for("kivi4"))
    assert odd.quantized and da.supported(odd) is None
    # keys and values both by channel but of other bits (their tiles would order tokens differently), and
    # INT2 values in groups of 8 channels (16 bits, less than the kernel's 32-bit loads)
    for value in (codecs.AffineCodec(2, 32, "channel"), codecs.AffineCodec(2, 8, "token")):
        spec = kvcache.LayerSpec(codecs.AffineCodec(4, 32, "channel"), value, group=32, residual=7)
        layer = kvcache.layer_from_dense(*layer_and_query("kivi4", 45)[0].full(), spec)
        assert layer.quantized and da.supported(layer) is None
        torch.testing.assert_close(da.decode_attention(q, layer, new_k, new_v, 0.125),
                                   dense_attention(q, *layer.full(new_k, new_v), 0.125), rtol=1e-5, atol=1e-5)


def test_fp8_codes_are_read_from_sm89_on():
    """Triton has E4M3 conversions from Ada/Hopper on; on an A100 (sm_80) FP8 caches take the dequantizing path."""
    assert da.fp8_readable(None) and da.fp8_readable((8, 9)) and da.fp8_readable((9, 0))
    assert not da.fp8_readable((8, 0)) and not da.fp8_readable((8, 6))


def test_layers_the_kernel_cannot_read_are_refused_by_name():
    levels = torch.linspace(-1, 1, 16)
    lo, hi = -torch.ones(HEADS, DIM), torch.ones(HEADS, DIM)
    spec = kvcache.LayerSpec(codecs.GridKeyCodec(4, levels, lo, hi), codecs.AffineCodec(4, 32, "token"), group=32,
                             residual=4, rope=True)
    layer = kvcache.QuantizedKVLayer(spec)
    assert da.supported(layer) is None
    q = torch.zeros(1, HEADS * REP, DIM)
    with pytest.raises(ValueError, match="no fused decode kernel for keys GridKeyCodec"):
        da.decode_attention(q, layer, torch.zeros(1, HEADS, 1, DIM), torch.zeros(1, HEADS, 1, DIM), 1.0, fused=True)
    with pytest.raises(ValueError, match=r"one query token per sequence: q \(B, H_q, D\), got \(1, 14, 2, 64\)"):
        da.decode_attention(q[:, :, None].expand(1, 14, 2, DIM), layer, q, q, 1.0)


QUANT_SPECS = {
    "kivi4": {"kind": "quant", "scheme": "kivi", "bits": 4, "group": 32, "residual": 32, "key_axis": "channel", "value_axis": "token"},
    "kivi2": {"kind": "quant", "scheme": "kivi", "bits": 2, "group": 32, "residual": 0, "key_axis": "channel", "value_axis": "token",
              "policy": "together"},
    "fp8": {"kind": "quant", "scheme": "fp8", "bits": 8, "group": 1, "scales": "dynamic", "key_axis": "token", "value_axis": "token"},
    "lmdeploy4": {"kind": "quant", "scheme": "lmdeploy", "bits": 4, "group": 32, "key_axis": "channel", "value_axis": "token"},
}


@pytest.mark.parametrize("name", sorted(QUANT_SPECS))
def test_generation_through_the_kernel_decodes_as_the_dequantizing_path(tiny, monkeypatch, name):
    """The engine's decode steps over quantized rows run the Triton kernel on the codes (forced here on the CPU,
    where it is interpreted) and give the dequantizing path's logits, step after step, while groups flush into
    codes; a batch of two quantized rows too. Those steps build no attention mask."""
    from kvlab.engine import Batch, PerRowLayer, compress, prefill
    from kvlab.methods import Variant

    model, tokenizer = tiny
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"][:61]
    base = prefill(model, ids)
    other = compress(model, base, Variant("kivi4", "quant", 1.0, QUANT_SPECS["kivi4"]))
    caches = [compress(model, base, Variant(name, "quant", 1.0, QUANT_SPECS[name])), other]
    calls = []
    real = da.decode_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("fused"))
        return real(*args, **kwargs)

    monkeypatch.setattr(da, "decode_attention", counted)
    masks = {False: 0, True: 0}  # per-row masks built, by path: the kernel covers each row exactly, needs none
    real_mask = PerRowLayer.mask

    def counted_mask(self, *args, **kwargs):
        masks[da.FUSED] += 1
        return real_mask(self, *args, **kwargs)

    monkeypatch.setattr(PerRowLayer, "mask", counted_mask)
    logits = {}
    for fused in (False, True):
        monkeypatch.setattr(da, "FUSED", fused)
        batch = Batch(model, caches)
        x, steps = torch.tensor([[ids[-1]]] * 2), []
        for step in range(20):  # crosses a group boundary: tokens leave the residual for the codes
            out = batch.forward(x, len(ids) + step)[:, -1]
            steps.append(out)
            x = out.argmax(-1, keepdim=True)
        logits[fused] = torch.stack(steps)
    assert calls and all(calls) and len(calls) == 20 * 2 * model.config.num_hidden_layers  # every step, row, layer
    assert masks == {False: 20 * model.config.num_hidden_layers, True: 0}
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
