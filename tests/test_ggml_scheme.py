"""Scheme ggml (kvlab.methods.schemes.ggml, kvlab.kernels.ggml): llama.cpp's q8_0 / q4_0 KV cache blocks bit for bit
against plain per-block references written from the block definitions, their error bounds, llama.cpp's bytes, the
Hadamard rotation, the scheme in a cache layer and in generate, its config entry; and (integration, in the engine's
environment .venv-llamacpp) kvlab's bytes against ggml's own quantize functions."""

from __future__ import annotations

import copy
import json
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from kvlab.kernels import codecs, ggml, kvcache, layouts
from kvlab.methods import kind_of
from kvlab.state.config import ConfigError, resolve

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "config.schema.yaml"
ENGINE_PY = ROOT / ".venv-llamacpp/bin/python"


# --------------------------------------------------------------------------- #
# References: one block at a time, in numpy float32 scalars, as the C loops read
# --------------------------------------------------------------------------- #


def ref_q8_0(block: np.ndarray, rounding: str) -> bytes:
    """ggml-quants.c quantize_row_q8_0_ref (`ref`) or ggml-cpu/arch/x86/quants.c quantize_row_q8_0 (`x86`)."""
    f = np.float32
    amax = f(0)
    for v in block:
        amax = max(amax, abs(f(v)))
    d = f(amax / f(127))
    if rounding == "ref":
        inv = f(f(1) / d) if d != 0 else f(0)
        qs = [int(np.sign(y) * np.floor(abs(float(y)) + 0.5)) for y in (f(f(v) * inv) for v in block)]  # roundf
    else:
        inv = f(f(127) / amax) if amax != 0 else f(0)
        qs = [round(float(f(f(v) * inv))) for v in block]  # Python's round: ties to even
    return np.float16(d).tobytes() + np.array(qs, dtype=np.int8).tobytes()


def ref_q4_0(block: np.ndarray) -> bytes:
    """ggml-quants.c quantize_row_q4_0_ref."""
    f = np.float32
    amax, peak = f(0), f(0)
    for v in block:
        if amax < abs(f(v)):
            amax, peak = abs(f(v)), f(v)
    d = f(peak / f(-8))
    inv = f(f(1) / d) if d != 0 else f(0)
    q = [min(15, int(f(f(f(v) * inv) + f(8.5)))) for v in block]  # int(): truncation, as the (int8_t) cast
    return np.float16(d).tobytes() + bytes(q[j] | q[j + 16] << 4 for j in range(16))


def blocks() -> np.ndarray:
    """Random blocks at several scales, bf16-rounded ones (a model's K/V), exact ties, ± peaks of equal size, all-zero
    and −0 blocks, one nonzero value."""
    g = np.random.default_rng(0)
    rows = [g.standard_normal((300, 32)) * s for s in (1e-3, 1.0, 40.0)]
    rows.append(torch.from_numpy(g.standard_normal((200, 32)) * 3).to(torch.bfloat16).float().numpy())
    ties8 = np.concatenate([[127.0], np.arange(31) - 15.5])  # d = 1: x · id = k + 1/2 exactly
    ties4 = np.concatenate([[-8.0], np.arange(31) / 2 - 7.5])  # d = 1: x + 8.5 lands on integers and halves
    opposite = np.where(np.arange(32) % 2, 3.0, -3.0)  # the first of the largest |x| gives d's sign
    zero, negzero, one = np.zeros(32), np.full(32, -0.0), np.zeros(32)
    one[5] = -2.5
    rows.append(np.stack([ties8, -ties8, ties4, -ties4, opposite, -opposite, zero, negzero, one]))
    return np.concatenate(rows).astype(np.float32)


def ours(x: np.ndarray, ggml_type: str, rounding: str = "x86") -> list[bytes]:
    qs, d = ggml.quantize(torch.from_numpy(x), ggml_type, rounding)
    return [bytes(r) for r in ggml.block_bytes(qs, d).numpy()]


@pytest.mark.parametrize("rounding", ["x86", "ref"])
def test_q8_0_codes_equal_the_block_definition_bit_for_bit(rounding):
    x = blocks()
    assert ours(x, "q8_0", rounding) == [ref_q8_0(b, rounding) for b in x]


def test_q4_0_codes_equal_the_block_definition_bit_for_bit():
    x = blocks()
    assert ours(x, "q4_0") == [ref_q4_0(b) for b in x]


def test_the_two_q8_0_roundings_differ_by_one_at_ties():
    """Same scales; codes one apart where x · id is a tie or within an ulp of one: none of the first 900 random
    float32 blocks, but bf16 values (a model's K and V as kvlab reads them) have few mantissa bits and tie often."""
    x = blocks()
    (a, da), (b, db) = (ggml.quantize(torch.from_numpy(x), "q8_0", r) for r in ggml.ROUNDINGS)
    assert torch.equal(da, db)
    step = (a.view(torch.int8).int() - b.view(torch.int8).int()).abs()
    assert step.max() == 1 and torch.equal(a[:900], b[:900])
    assert step[900:1100].sum() > 0 and step[-9:-7].sum() == 32  # bf16 blocks; exact ties: the 16 of each block whose floor is even


def test_zero_blocks_and_the_bytes_layout():
    zero = torch.zeros(2, 32)
    zero[1] = -0.0
    assert ours(zero.numpy(), "q8_0") == [bytes(34)] * 2
    assert ours(zero.numpy(), "q4_0") == [b"\x00\x80" + b"\x88" * 16] * 2  # d = 0 / −8 = −0, codes 8
    x = torch.arange(32, dtype=torch.float32) - 16  # max −16: d = 2, q = x/2 + 8 → 0…15
    qs, d = ggml.quantize(x[None], "q4_0")
    assert d.item() == 2 and qs[0, 0].item() == 0 | 8 << 4  # value 0 low nibble, value 16 high nibble
    torch.testing.assert_close(ggml.dequantize(qs, d, "q4_0")[0], torch.where(x < 15, torch.floor(x / 2 + 0.5) * 2, 14.0), rtol=0, atol=0)


def test_dequantized_error_bounds_per_block():
    """q8_0: codes are |x − q·d| ≤ d/2 off the float32 scale d; stored as fp16(d), the values are off by at most
    d/2 + 127·|d − fp16(d)| (so a little more than d/2). q4_0: ≤ |d|/2 where x/d ≤ 7.5, ≤ |d| for the values of
    the other sign clamped at 7·d; plus 8·|d − fp16(d)|. The largest |x| of a q4_0 block is −8·d exactly."""
    x = torch.from_numpy(blocks())
    amax = x.abs().amax(1)
    for rounding in ggml.ROUNDINGS:
        qs, d16 = ggml.quantize(x, "q8_0", rounding)
        d32, q = amax / 127, qs.view(torch.int8).float()
        assert ((x - q * d32[:, None]).abs() <= d32[:, None] / 2 * (1 + 1e-5)).all()
        err = (x - ggml.dequantize(qs, d16, "q8_0")).abs()
        assert (err <= (d32 / 2 * (1 + 1e-5) + 127 * (d32 - d16.float()).abs())[:, None]).all()
        assert (err > d16.float().abs()[:, None] / 2).any()  # the fp16 scale's rounding shows: d/2 alone is no bound
    qs, d16 = ggml.quantize(x, "q4_0")
    peak = x.gather(1, x.abs().argmax(1, keepdim=True))[:, 0]
    d32 = peak / -8
    slack = (8 * (d32 - d16.float()).abs())[:, None]
    err = (x - ggml.dequantize(qs, d16, "q4_0")).abs()
    ratio = torch.where(d32[:, None] != 0, x / d32[:, None], torch.zeros_like(x))
    inside = ratio <= 7.5
    assert (err[inside] <= (d32.abs()[:, None] / 2 * (1 + 1e-5) + slack).expand_as(x)[inside]).all()
    assert (err <= d32.abs()[:, None] * (1 + 1e-5) + slack).all() and (~inside).any()
    largest = x.abs().argmax(1, keepdim=True)
    assert torch.equal(ggml.dequantize(qs, d16, "q4_0").gather(1, largest)[:, 0], -8 * d16.float())


# --------------------------------------------------------------------------- #
# Bytes, rotation, the cache layer
# --------------------------------------------------------------------------- #


def scheme(**kw) -> dict:
    return {"kind": "quant", "scheme": "ggml", **kw}


@pytest.mark.parametrize("k,v,engine", [("f16", "f16", 50_331_648), ("q8_0", "q8_0", 26_738_688), ("q4_0", "q4_0", 14_155_776),
                                        ("q4_0", "q8_0", 20_447_232)])
def test_bytes_are_llama_cpps_for_qwen2_5_0_5b_at_4096_cells(k, v, engine):
    """llama.cpp's `llama_kv_cache: size` at n_ctx 4096 for Qwen2.5-0.5B (24 layers, 2 KV heads, head_dim 64):
    48.00, 25.50, 13.50 and 19.50 MiB. q8_0 is 34 bytes per 32 values, q4_0 18, f16 2 per value."""
    cells, layers, heads, d = 4096, 24, 2, 64
    assert layers * cells * heads * (ggml.row_bytes(k, d) + ggml.row_bytes(v, d)) == engine
    if (k, v) != ("f16", "f16"):
        key, value = kind_of(scheme(cache_type_k=k, cache_type_v=v)).layouts(d)
        assert layers * layouts.stored_layer_bytes(key, value, heads, d, (cells, cells), (0, 0), 2) == engine
        layer = kvcache.layer_from_dense(torch.randn(1, heads, 100, d), torch.randn(1, heads, 100, d),
                                         kind_of(scheme(cache_type_k=k, cache_type_v=v)).scheme.layer_spec(0, heads, d))
        assert layer.counts()["quantized_keys"] == layer.counts()["quantized_values"] == 100  # every token, no residual
        assert layers * layer.nbytes() * cells == engine * 100


def test_the_rotation_is_the_orthonormal_hadamard_matrix():
    for n in (64, 128):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        x = torch.randn(5, 2 * n)
        want = (x.double().view(5, 2, n) @ (h / n**0.5)).view(5, 2 * n)
        torch.testing.assert_close(ggml.hadamard(x, n).double(), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ggml.hadamard(ggml.hadamard(x, n), n), x, rtol=0, atol=1e-5)
    assert [ggml.k_rotation(d) for d in (32, 64, 80, 128, 192, 256)] == [None, 64, None, 128, 64, 256]
    assert [ggml.v_rotation(d) for d in (32, 64, 128, 256)] == [None, 64, 64, 64]


def test_the_codec_stores_the_rotated_blocks_and_decodes_back():
    x = torch.randn(1, 2, 7, 128)
    x[..., 3] *= 30  # an outlier channel: the rotation spreads it over the 128
    spec = kind_of(scheme(cache_type_k="q4_0", cache_type_v="q8_0")).scheme.layer_spec(0, 2, 128)
    assert (spec.key.rotation, spec.value.rotation) == (128, 64)
    stored = spec.key.encode(x)
    qs, d = ggml.quantize(ggml.hadamard(x, 128).reshape(-1, 32), "q4_0")
    assert torch.equal(stored["codes"].reshape(-1, 16), qs) and torch.equal(stored["scale"].reshape(-1), d)
    rotated = (spec.key.decode(stored, x.shape) - x).square().mean()
    plain = codecs.GGMLCodec("q4_0")
    assert rotated < (plain.decode(plain.encode(x), x.shape) - x).square().mean()  # what llama.cpp rotates for
    off = kind_of(scheme(cache_type_k="q4_0", attn_rot=False)).scheme.layer_spec(0, 2, 128)
    assert (off.key.rotation, off.value.rotation, off.value.ggml_type) == (None, None, "f16")
    f16 = off.value.encode(x)
    assert torch.equal(off.value.decode(f16, x.shape), x.half().float())


def test_streaming_stores_what_a_prefill_stores():
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    spec = kind_of(scheme(cache_type_k="q4_0", cache_type_v="q8_0")).scheme.layer_spec(0, 2, 64)
    at_once = kvcache.layer_from_dense(keys, values, spec)
    streamed = kvcache.layer_from_dense(keys[..., :5, :], values[..., :5, :], spec)
    for i in range(5, 40):
        streamed.update(keys[..., i : i + 1, :], values[..., i : i + 1, :])
    for part in ("key", "value"):
        for name, t in at_once.stored[part].items():
            assert torch.equal(streamed.stored[part][name], t), (part, name)


def test_generate_runs_with_the_scheme():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = kind_of(scheme(cache_type_k="q4_0", cache_type_v="q8_0")).empty_cache(model)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape[1] == 26
    assert all(layer.get_seq_length() == 25 and layer.coded == (25, 25) for layer in cache.layers)


# --------------------------------------------------------------------------- #
# The config entry
# --------------------------------------------------------------------------- #


@pytest.fixture
def config():
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_a_ggml_entry_validates(config):
    config["methods"]["llamacpp_q4q8"] = scheme(cache_type_k="q4_0", cache_type_v="q8_0")
    entry = resolve(config, SCHEMA)["methods"]["llamacpp_q4q8"]
    assert entry["cache_type_k"] == "q4_0" and entry["cache_type_v"] == "q8_0" and "attn_rot" not in entry
    impl = kind_of(entry)
    assert impl.problem() is None and impl.storage == {"scheme": "ggml", "bits": 8, "key_axis": "token", "value_axis": "token", "policy": None}


@pytest.mark.parametrize("entry,message", [
    (scheme(cache_type_k="q5_0"), "key 'methods.bad.cache_type_k': 'q5_0' is not allowed; allowed: f16, q8_0, q4_0"),
    (scheme(), "key 'methods.bad.cache_type_k': scheme ggml needs a quantized cache_type_k or cache_type_v (q8_0, q4_0)"),
    (scheme(cache_type_k="q8_0", residual=32), "key 'methods.bad.residual': llama.cpp quantizes every token as it is written"),
    ({"kind": "quant", "scheme": "int8", "cache_type_v": "q8_0"}, "key 'methods.bad.cache_type_v': cache_type_v applies to scheme ggml only"),
    (scheme(cache_type_k="q8_0", attn_rot="yes"), "key 'methods.bad.attn_rot': expected boolean"),
])
def test_a_bad_ggml_entry_is_one_line(config, entry, message):
    config["methods"]["bad"] = copy.deepcopy(entry)
    with pytest.raises(ConfigError) as info:
        resolve(config, SCHEMA)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


# --------------------------------------------------------------------------- #
# Against ggml itself (the engine's environment)
# --------------------------------------------------------------------------- #

GGML_SCRIPT = r"""
import ctypes, json, pathlib, sys
import numpy as np
import llama_cpp

lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
base, cpu = ctypes.CDLL(str(lib / "libggml-base.so")), ctypes.CDLL(str(lib / "libggml-cpu.so"))
x = np.fromfile(sys.argv[1], dtype=np.float32)
out = {}
for name, fn, size in (("q8_0_ref", base.quantize_row_q8_0_ref, 34), ("q4_0_ref", base.quantize_row_q4_0_ref, 18),
                       ("q8_0_cpu", cpu.quantize_row_q8_0, 34), ("q4_0_cpu", cpu.quantize_row_q4_0, 18)):
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    y = np.zeros(x.size // 32 * size, np.uint8)
    fn(x.ctypes.data, y.ctypes.data, x.size)
    out[name] = y.tobytes().hex()
chunk = base.ggml_quantize_chunk
chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
chunk.restype = ctypes.c_size_t
for name, t, size in (("q8_0_chunk", llama_cpp.GGML_TYPE_Q8_0, 34), ("q4_0_chunk", llama_cpp.GGML_TYPE_Q4_0, 18)):
    y = np.zeros(x.size // 32 * size, np.uint8)
    assert chunk(t, x.ctypes.data, y.ctypes.data, 0, x.size // 32, 32, None) == y.size
    out[name] = y.tobytes().hex()
print(json.dumps(out))
"""


def avx() -> bool:
    """Whether llama.cpp's CPU backend here writes q8_0 with its AVX code (an x86 CPU with AVX; a native build)."""
    try:
        return platform.machine() in ("x86_64", "AMD64") and " avx" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.slow  # a program in a subprocess
@pytest.mark.skipif(not ENGINE_PY.exists(), reason="needs the engine's environment: make llamacpp-env")
def test_kvlab_codes_equal_ggmls_own_bytes(tmp_path):
    """ggml's reference quantizers and ggml_quantize_chunk (GGUF files) give kvlab's `ref` bytes; the CPU backend's
    (what set_rows writes into a q4_0 / q8_0 KV cache) give kvlab's `x86` bytes, the scheme's."""
    g = np.random.default_rng(1)
    x = np.concatenate([blocks(), (g.standard_normal((20_000, 32)) * 2).astype(np.float32)])
    (tmp_path / "x.f32").write_bytes(x.tobytes())
    (tmp_path / "ggml_bytes.py").write_text(GGML_SCRIPT)
    run = subprocess.run([str(ENGINE_PY), str(tmp_path / "ggml_bytes.py"), str(tmp_path / "x.f32")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = {k: bytes.fromhex(v) for k, v in json.loads(run.stdout).items()}
    mine = {f"{t}_{r}": b"".join(ours(x, t, r)) for t in ggml.QUANTIZED for r in ggml.ROUNDINGS}
    assert mine["q8_0_ref"] == theirs["q8_0_ref"] == theirs["q8_0_chunk"]
    assert mine["q4_0_x86"] == mine["q4_0_ref"] == theirs["q4_0_ref"] == theirs["q4_0_chunk"] == theirs["q4_0_cpu"]
    if avx():
        assert mine["q8_0_x86"] == theirs["q8_0_cpu"]
        assert theirs["q8_0_cpu"] != theirs["q8_0_ref"]  # the ties
