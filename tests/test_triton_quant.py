"""The Triton kernels of ``kvlab.kernels.triton_quant`` against the torch references of ``quant``: bit-exact.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by conftest.py before
anything imports triton); with CUDA they are compiled and checked on CUDA tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.kernels import quant
from kvlab.kernels import triton_quant as tq

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# CPU tensors run only in the interpreter; compiled kernels need CUDA tensors
DEVICES = ["cpu"] * INTERPRETED + ["cuda"] * torch.cuda.is_available()
ROW_SHAPES = [(n, length) for n in (1, 63, 97, 130) for length in (16, 32, 64, 256, 24)]  # (rows, values per row) quantized
BITS = (2, 4, 8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (so -0.0 ≠ 0.0), except that any NaN equals any NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        a, b = a.masked_fill(nan, 0).view(ints), b.masked_fill(nan, 0).view(ints)
    return torch.equal(a, b)


def kv_rows(n: int, length: int, seed: int) -> torch.Tensor:
    """Rows cycling through: randn at scales 1e-3…1e3, all zero, constant, one ±1e4 outlier, negative only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, generator=g) * 10 ** (torch.rand(n, 1, generator=g) * 6 - 3)
    kind = torch.arange(n) % 5
    x[kind == 1] = 0.0
    x[kind == 2] = torch.randn(int((kind == 2).sum()), 1, generator=g).expand(-1, length) * 7
    outlier = (kind == 3).nonzero().flatten()
    x[outlier, torch.randint(length, (len(outlier),), generator=g)] = 1e4 * torch.sign(torch.randn(len(outlier)))
    x[kind == 4] = -x[kind == 4].abs() - 3.0
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_affine(shape, bits, device):
    x = kv_rows(*shape, seed=shape[0] * 1000 + shape[1] + bits).to(device)
    ref = quant.affine_quantize(x, bits)
    got = tq.affine_quantize(x, bits)
    for r, t in zip(ref, got):
        assert same(r, t)
    assert same(quant.affine_dequantize(*ref, bits), tq.affine_dequantize(*ref, bits))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_affine_input_dtypes_and_strides(dtype, device):
    x = kv_rows(48, 40, seed=7).clamp(-3e4, 3e4).to(device, dtype).t()  # (40, 48), not contiguous
    for bits in BITS:
        for r, t in zip(quant.affine_quantize(x, bits), tq.affine_quantize(x, bits)):
            assert same(r, t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_fp8_quantize(shape, device):
    n, length = shape
    g = torch.Generator().manual_seed(n + length)
    # magnitudes 2^-14 … 2^11: below the subnormals, through them, the normals and beyond the 448 saturation
    x = torch.randn(n, length, generator=g).sign() * 2 ** (torch.rand(n, length, generator=g) * 25 - 14)
    scale = torch.where(torch.arange(n) % 2 == 0, 1.0, torch.rand(n, generator=g) * 4 + 0.01)
    ref = quant.fp8_quantize(x.to(device), scale.to(device))
    assert same(ref, tq.fp8_quantize(x.to(device), scale.to(device)))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_ties_and_specials(device):
    normal = torch.tensor([2.0**e * (1 + m / 8) for e in range(-6, 9) for m in range(8)])
    normal = normal[normal <= 448]
    sub = torch.arange(16) * 2.0**-10  # odd multiples of 2^-10 tie between subnormals (and 0 / 2^-6)
    ties = (normal[1:] + normal[:-1]) / 2  # halfway between neighbouring normals
    special = torch.tensor([0.0, -0.0, 448.0, 456.0, 464.0, 479.0, 480.0, 1e30, float("inf"), float("nan")])
    x = torch.cat([normal, sub, ties, special, torch.nextafter(ties, torch.tensor(0.0))])
    x = torch.cat([x, -x])
    x = torch.cat([x, x.new_zeros(-len(x) % 64)]).view(-1, 64)
    # checked=True: the codes of inputs the public functions refuse (NaN, Inf, a zero scale) must agree too
    scale = torch.ones(len(x))
    assert same(quant.fp8_quantize(x.to(device), scale.to(device), checked=True), tq.fp8_quantize(x.to(device), scale.to(device), checked=True))
    scale = torch.full((len(x),), 0.0)  # x / 0: ±inf saturates, 0 / 0 is NaN
    assert same(quant.fp8_quantize(x.to(device), scale.to(device), checked=True), tq.fp8_quantize(x.to(device), scale.to(device), checked=True))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_dequantize_every_code(device):
    codes = torch.arange(256, dtype=torch.uint8).repeat(5, 1).to(device)
    scale = torch.tensor([1.0, 0.5, 3.7, 1e-3, 2.0**-20], device=device)
    assert same(quant.fp8_dequantize(codes, scale), tq.fp8_dequantize(codes, scale))


def levels_for(bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lv = torch.sort(torch.randn(2**bits, generator=g)).values
    lv[1] = lv[0]  # a repeated level (sorted, not strictly) is allowed
    return lv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_grid(shape, bits, device):
    n, length = shape
    levels = levels_for(bits, seed=bits)
    g = torch.Generator().manual_seed(n * length + bits)
    x = torch.randn(n, length, generator=g) * 1.5
    # values exactly at the midpoints (ties go to the lower level), on the levels, and far outside
    special = torch.cat([quant.grid_midpoints(levels), levels, torch.tensor([-1e9, 1e9])])
    pick = torch.rand(n, length, generator=g) < 0.5
    x[pick] = special[torch.randint(len(special), (int(pick.sum()),), generator=g)]
    x, levels = x.to(device), levels.to(device)
    ref = quant.grid_quantize(x, levels, bits)
    assert same(ref, tq.grid_quantize(x, levels, bits))
    assert same(quant.grid_dequantize(ref, levels, bits), tq.grid_dequantize(ref, levels, bits))


@pytest.mark.parametrize("device", DEVICES)
def test_grid_fp16_levels(device):
    levels = levels_for(4, seed=3).half().to(device)
    x = torch.cat([quant.grid_midpoints(levels), levels.float()]).repeat(8, 2).to(device)
    ref = quant.grid_quantize(x, levels, 4)
    assert same(ref, tq.grid_quantize(x, levels, 4))
    assert same(quant.grid_dequantize(ref, levels, 4), tq.grid_dequantize(ref, levels, 4))


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.affine_quantize(torch.zeros(2, 8), 3),
        lambda m: m.affine_quantize(torch.full((2, 8), 4e4), 4),
        lambda m: m.affine_quantize(torch.zeros(2, 6), 2),
        lambda m: m.grid_quantize(torch.zeros(2, 8), torch.arange(8.0), 2),
        lambda m: m.grid_quantize(torch.zeros(2, 8), torch.arange(4.0).flip(0), 2),
        lambda m: m.grid_quantize(torch.zeros(2, 6), torch.arange(4.0), 2),
        lambda m: m.affine_quantize(torch.tensor([[0.0, float("nan")] * 4]), 4),
        lambda m: m.fp8_quantize(torch.tensor([[float("inf"), 1.0]]), torch.ones(1)),
        lambda m: m.fp8_quantize(torch.ones(2, 4), torch.tensor([1.0, 0.0])),
        lambda m: m.grid_quantize(torch.tensor([[float("nan"), 0, 0, 0]]), torch.arange(4.0), 2),
    ],
)
def test_same_errors(call):
    with pytest.raises(ValueError) as ref:
        call(quant)
    with pytest.raises(ValueError) as got:
        call(tq)
    assert str(got.value) == str(ref.value)
