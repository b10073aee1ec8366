"""Reference quantizers (kvlab.kernels.quant): packing, error bounds, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.kernels import quant


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trips_bit_exactly(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (37, 64), generator=g, dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (37, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, bits), codes)


def test_pack_layout_is_little_end_first():
    assert quant.pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).item() == 1 | 2 << 2 | 3 << 4
    assert quant.pack(torch.tensor([[0xA, 0x5]], dtype=torch.uint8), 4).item() == 0x5A


def test_fp16_directed_rounding():
    x = torch.randn(10_000) * torch.logspace(-6, 4, 10_000)
    down, up = quant.fp16_down(x), quant.fp16_up(x)
    assert bool((down.float() <= x).all()) and bool((up.float() >= x).all())
    exact = x.half().float() == x
    assert bool((down.float()[~exact] < up.float()[~exact]).all())
    zero = torch.zeros(1)
    assert quant.fp16_down(zero).item() == 0 and quant.fp16_up(-zero).item() == 0


def _check_affine(rows: torch.Tensor, bits: int) -> None:
    packed, scale, zero = quant.affine_quantize(rows, bits)
    out = quant.affine_dequantize(packed, scale, zero, bits)
    assert bool(torch.isfinite(out).all())
    step = scale.float()[:, None]
    # at most half a step, plus the float32 rounding of (x - zero) / step and code * step + zero
    slack = 1e-6 * (rows.abs() + zero.float().abs()[:, None] + 1)
    assert bool(((out - rows).abs() <= step / 2 + slack).all())


finite = st.floats(min_value=-3e4, max_value=3e4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.lists(finite, min_size=8, max_size=8), st.integers(1, 6))
def test_affine_error_is_at_most_half_a_step(bits, row, n):
    _check_affine(torch.tensor([row] * n, dtype=torch.float32), bits)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    "rows",
    [
        torch.zeros(3, 32),  # all zero: scale 0, exact
        torch.full((3, 32), -7.25),  # constant
        torch.cat([torch.zeros(1, 31), torch.full((1, 1), 1e4)], 1),  # a single outlier
        (torch.rand(5, 32) * 2 - 1) * 3e4,  # very large (the fp16 metadata allows |x| ≤ 32752)
    ],
    ids=["zero", "constant", "outlier", "large"],
)
def test_affine_edge_cases(bits, rows):
    _check_affine(rows, bits)


def test_constant_rows_are_exact():
    rows = torch.full((2, 16), 3.0)
    packed, scale, zero = quant.affine_quantize(rows, 2)
    assert torch.equal(quant.affine_dequantize(packed, scale, zero, 2), rows)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused(bad):
    x = torch.randn(1, 2, 4, 8)
    x[0, 1, 2, 3] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        quant.check_input(("keys", x, False))


@pytest.mark.parametrize("call,message", [
    (lambda x: quant.affine_quantize(x, 4), "affine quantization rows: 2 NaN/Inf value(s); KV entries must be finite"),
    (lambda x: quant.fp8_quantize(x, torch.ones(2)), "fp8 quantization rows: 2 NaN/Inf value(s); KV entries must be finite"),
    (lambda x: quant.grid_quantize(x, torch.linspace(-1, 1, 4), 2), "grid quantization rows: 2 NaN/Inf value(s); KV entries must be finite"),
])
def test_public_quantizers_refuse_nan_and_inf_themselves(call, message):
    """Called directly (not through a cache layer that checked first), a quantizer names the tensor it refuses;
    unchecked, NaN codes would decode to a level or a saturated ±448 and pass as data."""
    x = torch.zeros(2, 8)
    x[0, 1], x[1, 7] = float("nan"), float("-inf")
    with pytest.raises(ValueError) as info:
        call(x)
    assert str(info.value) == message


def test_fp8_refuses_a_zero_or_non_finite_scale():
    with pytest.raises(ValueError, match=r"^fp8 quantization scale: scales must be finite and > 0, got values from 0 to 1$"):
        quant.fp8_quantize(torch.ones(2, 4), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="fp8 quantization scale: scales must be finite and > 0"):
        quant.fp8_quantize(torch.ones(2, 4), torch.tensor([1.0, float("inf")]))


def test_out_of_metadata_range_is_refused():
    with pytest.raises(ValueError, match="fp16"):
        quant.affine_quantize(torch.tensor([[1e5, 0.0]]), 8)


def test_bad_bits_are_refused():
    with pytest.raises(ValueError, match="bits must be one of"):
        quant.affine_quantize(torch.zeros(1, 8), 3)


def test_fp8_matches_torch_e4m3_and_saturates():
    x = torch.tensor([[0.0, 1.0, -1.5, 3e-3, 500.0, -1e6]])
    codes = quant.fp8_quantize(x, torch.ones(1))
    back = quant.fp8_dequantize(codes, torch.ones(1))
    assert back[0, :3].tolist() == [0.0, 1.0, -1.5]
    assert back[0, 4].item() == 448.0 and back[0, 5].item() == -448.0  # saturated, not NaN
    # relative error of E4M3 for normal numbers is at most 2^-4
    y = torch.randn(1, 1000)
    scale = y.abs().amax(1) / quant.FP8_MAX
    z = quant.fp8_dequantize(quant.fp8_quantize(y, scale), scale)
    normal = y.abs() > scale * 2**-6
    assert bool(((z - y).abs() <= y.abs() * 2**-4 + 1e-12)[normal].all())


def test_grid_picks_the_nearest_level_and_ties_go_low():
    levels = torch.tensor([-1.0, -0.2, 0.1, 0.9])
    x = torch.tensor([[-2.0, -0.6, -0.05, 0.5, 0.51, 5.0, -0.2, 0.49]])
    got = quant.grid_dequantize(quant.grid_quantize(x, levels, 2), levels, 2)
    assert got[0].tolist() == pytest.approx([-1.0, -1.0, -0.2, 0.1, 0.9, 0.9, -0.2, 0.1])


def test_layouts_round_trip_and_group_the_right_axis():
    x = torch.arange(1 * 2 * 64 * 16, dtype=torch.float32).view(1, 2, 64, 16)
    rows = quant.to_rows(x, "channel", 32)
    assert rows.shape == (2 * 2 * 16, 32)
    assert torch.equal(rows[0], x[0, 0, :32, 0])  # one channel over 32 tokens
    assert torch.equal(quant.from_rows(rows, "channel", 32, x.shape), x)
    rows = quant.to_rows(x, "token", 8)
    assert torch.equal(rows[0], x[0, 0, 0, :8])  # one token over 8 channels
    assert torch.equal(quant.from_rows(rows, "token", 8, x.shape), x)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.to_rows(x[:, :, :63], "channel", 32)
    with pytest.raises(ValueError, match="does not divide head_dim"):
        quant.to_rows(x[..., :12], "token", 8)
