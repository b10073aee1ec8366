"""Triton kernels of the KV quantizers: the same functions, signatures and codes as the plain-torch references
in ``kvlab.kernels.quant`` (read that module for the formats); tests/test_triton_quant.py checks bit-exact
equality under ``TRITON_INTERPRET=1`` on the CPU, and on CUDA when present.

Every wrapper validates like its reference, allocates the outputs and launches one kernel over tiles of
``BLOCK_N`` rows × ``BLOCK_L`` (next power of two of the row length, at least 8) values. A program walks the packed bytes
of its rows: code ``j`` of each byte is value ``byte * per + j`` of the row (``per = 8 // bits``).
Exactness: divisions use ``div_rn`` (IEEE, like torch) and launches pass ``enable_fp_fusion=False`` so no
multiply-add is contracted into an FMA; fp16 and E4M3 rounding is done on bit patterns, as torch does it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels import quant

_TILE = 4096  # values per program (BLOCK_N * BLOCK_L, at least one row)


def _launch(kernel, n: int, length: int, *tensors: torch.Tensor, **constexprs) -> None:
    """Run ``kernel(*tensors, n, length, **constexprs, BLOCK_N=…, BLOCK_L=…)`` over tiles of rows."""
    block_l = triton.next_power_of_2(max(length, 8))
    block_n = min(triton.next_power_of_2(n), max(1, _TILE // block_l))
    if n:
        grid = (triton.cdiv(n, block_n),)
        kernel[grid](*tensors, n, length, **constexprs, BLOCK_N=block_n, BLOCK_L=block_l, enable_fp_fusion=False)


@triton.jit
def _tile(N, L, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    """Row indices (BLOCK_N, 1), byte indices (1, BLOCK_L // per) and the mask of this program's packed tile."""
    PER: tl.constexpr = 8 // BITS
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N))[:, None].to(tl.int64)  # no int32 overflow
    cols = tl.arange(0, BLOCK_L // PER)[None, :]
    return rows, cols, (rows < N) & (cols < L // PER)


@triton.jit
def _fp16_step(h, UP: tl.constexpr):
    """The next fp16 above (UP) or below ``h``: ``quant._fp16_step`` on the int16 pattern."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32)
    if UP:
        nxt = tl.where(b >= 0, b + 1, tl.where(b == -32768, 1, b - 1))
    else:
        nxt = tl.where(b > 0, b - 1, tl.where(b == 0, -32767, b + 1))
    return nxt.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _affine_quantize_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, N, L, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_L: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    rows, cols, mask = _tile(N, L, BITS, BLOCK_N, BLOCK_L)
    lo = tl.full((BLOCK_N,), float("inf"), tl.float32)
    hi = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for j in tl.static_range(PER):
        x = tl.load(x_ptr + rows * L + cols * PER + j, mask=mask).to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(mask, x, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(mask, x, float("-inf")), axis=1))
    h = lo.to(tl.float16)  # zero: the row minimum rounded down to fp16
    zero = tl.where(h.to(tl.float32) > lo, _fp16_step(h, False), h).to(tl.float32)
    s = tl.math.div_rn(hi - zero, float((1 << BITS) - 1))
    h = s.to(tl.float16)  # scale: rounded up to fp16
    scale = tl.where(h.to(tl.float32) < s, _fp16_step(h, True), h)
    safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)[:, None]
    packed = tl.zeros((BLOCK_N, BLOCK_L // PER), tl.int32)
    for j in tl.static_range(PER):
        x = tl.load(x_ptr + rows * L + cols * PER + j, mask=mask).to(tl.float32)
        q = tl.floor(tl.math.div_rn(x - zero[:, None], safe) + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), float((1 << BITS) - 1))
        packed |= q.to(tl.int32) << (BITS * j)
    tl.store(q_ptr + rows * (L // PER) + cols, packed.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + rows, scale[:, None], mask=rows < N)
    tl.store(zero_ptr + rows, zero.to(tl.float16)[:, None], mask=rows < N)


@triton.jit
def _affine_dequantize_kernel(q_ptr, scale_ptr, zero_ptr, out_ptr, N, L, BITS: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    rows, cols, mask = _tile(N, L, BITS, BLOCK_N, BLOCK_L)
    packed = tl.load(q_ptr + rows * (L // PER) + cols, mask=mask).to(tl.int32)
    scale = tl.load(scale_ptr + rows, mask=rows < N).to(tl.float32)
    zero = tl.load(zero_ptr + rows, mask=rows < N).to(tl.float32)
    for j in tl.static_range(PER):
        code = ((packed >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32)
        tl.store(out_ptr + rows * L + cols * PER + j, code * scale + zero, mask=mask)


@triton.jit
def _fp8_quantize_kernel(x_ptr, scale_ptr, out_ptr, N, L, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    rows, cols, mask = _tile(N, L, 8, BLOCK_N, BLOCK_L)
    x = tl.load(x_ptr + rows * L + cols, mask=mask).to(tl.float32)
    y = tl.math.div_rn(x, tl.load(scale_ptr + rows, mask=rows < N, other=1.0).to(tl.float32))
    b = y.to(tl.int32, bitcast=True)
    mag = b & 0x7FFFFFFF
    a = tl.minimum(mag, 0x43E00000)  # |y| clamped to 448 (patterns of non-negative floats order like them)
    # c10's fp8e4m3fn_from_fp32_value: below 2^-6 round onto multiples of 2^-9 by adding 2^14 in fp32,
    # otherwise rebias the exponent and round the mantissa to 3 bits, ties to even
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    nrm = (a + ((7 - 127) << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    code = tl.where(a < (121 << 23), sub, nrm)
    code = tl.where(mag > 0x7F800000, 0x7F, code) | ((b >> 24) & 0x80)  # NaN stays NaN; the sign bit
    tl.store(out_ptr + rows * L + cols, code.to(tl.uint8), mask=mask)


@triton.jit
def e4m3_to_float(c):
    """E4M3 codes (int32 holding a byte) → float32, exactly as torch's float8_e4m3fn → float32."""
    mag = c & 0x7F  # exponent (bias 7) in bits 3-6, mantissa in bits 0-2
    nrm = tl.where(mag == 0x7F, 0x7FF00000, (mag << 20) + (120 << 23))  # fp32 pattern; NaN as c10 decodes it
    v = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, nrm.to(tl.float32, bitcast=True))  # subnormal: m·2^-9
    return tl.where(c >= 0x80, -v, v)


@triton.jit
def _fp8_dequantize_kernel(c_ptr, scale_ptr, out_ptr, N, L, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    rows, cols, mask = _tile(N, L, 8, BLOCK_N, BLOCK_L)
    v = e4m3_to_float(tl.load(c_ptr + rows * L + cols, mask=mask).to(tl.int32))
    tl.store(out_ptr + rows * L + cols, v * tl.load(scale_ptr + rows, mask=rows < N).to(tl.float32), mask=mask)


@triton.jit
def _grid_quantize_kernel(x_ptr, levels_ptr, q_ptr, N, L, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_L: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    rows, cols, mask = _tile(N, L, BITS, BLOCK_N, BLOCK_L)
    packed = tl.zeros((BLOCK_N, BLOCK_L // PER), tl.int32)
    for j in tl.static_range(PER):
        x = tl.load(x_ptr + rows * L + cols * PER + j, mask=mask).to(tl.float32)
        code = tl.zeros((BLOCK_N, BLOCK_L // PER), tl.int32)
        for k in range((1 << BITS) - 1):  # count the midpoints strictly below x
            mid = (tl.load(levels_ptr + k).to(tl.float32) + tl.load(levels_ptr + k + 1).to(tl.float32)) * 0.5
            code += (x > mid).to(tl.int32)
        packed |= code << (BITS * j)
    tl.store(q_ptr + rows * (L // PER) + cols, packed.to(tl.uint8), mask=mask)


@triton.jit
def _grid_dequantize_kernel(q_ptr, levels_ptr, out_ptr, N, L, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_L: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    rows, cols, mask = _tile(N, L, BITS, BLOCK_N, BLOCK_L)
    packed = tl.load(q_ptr + rows * (L // PER) + cols, mask=mask).to(tl.int32)
    for j in tl.static_range(PER):
        code = (packed >> (BITS * j)) & ((1 << BITS) - 1)
        level = tl.load(levels_ptr + code, mask=mask).to(tl.float32)
        tl.store(out_ptr + rows * L + cols * PER + j, level, mask=mask)


# --------------------------------------------------------------------------- #
# Wrappers (same names, signatures and checks as the references)
# --------------------------------------------------------------------------- #


def affine_quantize(rows: torch.Tensor, bits: int, checked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (N, L) → (packed codes (N, L*bits/8) uint8, scale (N,) fp16, zero (N,) fp16). The NaN/Inf and range
    check (not run when ``checked``, see ``quant.affine_quantize``) waits for the data, so it is skipped while a
    CUDA graph is captured."""
    quant.check_bits(bits)
    if not checked:  # skipped by check_input itself while a CUDA graph is captured
        quant.check_input(("affine quantization rows", rows, True))
    n, length = rows.shape
    quant.check_length(length, bits)
    packed = torch.empty(n, length * bits // 8, dtype=torch.uint8, device=rows.device)
    scale = torch.empty(n, dtype=torch.float16, device=rows.device)
    zero = torch.empty_like(scale)
    _launch(_affine_quantize_kernel, n, length, rows.contiguous(), packed, scale, zero, BITS=bits)
    return packed, scale, zero


def affine_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`affine_quantize`: (N, L) float32."""
    n, length = packed.shape[0], packed.shape[1] * 8 // bits
    out = torch.empty(n, length, dtype=torch.float32, device=packed.device)
    _launch(_affine_dequantize_kernel, n, length, packed.contiguous(), scale.contiguous(), zero.contiguous(), out,
            BITS=bits)
    return out


def fp8_quantize(rows: torch.Tensor, scale: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Rows (N, L) and one float32 scale per row (N,) → E4M3 codes of ``x / scale`` as uint8 (N, L), saturating.
    Checks as ``quant.fp8_quantize`` unless ``checked``."""
    if not checked:
        quant.check_fp8_input(rows, scale)
    out = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
    _launch(_fp8_quantize_kernel, *rows.shape, rows.contiguous(), scale.contiguous(), out)
    return out


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: (N, L) float32."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _launch(_fp8_dequantize_kernel, *codes.shape, codes.contiguous(), scale.contiguous(), out)
    return out


def grid_quantize(rows: torch.Tensor, levels: torch.Tensor, bits: int, checked: bool = False) -> torch.Tensor:
    """Rows (N, L) of normalized values → packed indices of the nearest level (N, L*bits/8) uint8. Checks as
    ``quant.grid_quantize`` unless ``checked``."""
    quant.check_bits(bits)
    if not checked:
        quant.check_input(("grid quantization rows", rows, False), ("grid quantization levels", levels, False))
    if levels.numel() != 2**bits:
        raise ValueError(f"grid quantization: {levels.numel()} levels given, {bits} bits need {2**bits}")
    if bool((levels[1:] < levels[:-1]).any()):
        raise ValueError("grid quantization: levels must be sorted ascending")
    n, length = rows.shape
    quant.check_length(length, bits)
    packed = torch.empty(n, length * bits // 8, dtype=torch.uint8, device=rows.device)
    _launch(_grid_quantize_kernel, n, length, rows.contiguous(), levels.contiguous(), packed, BITS=bits)
    return packed


def grid_dequantize(packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`grid_quantize`: (N, L) float32 levels."""
    n, length = packed.shape[0], packed.shape[1] * 8 // bits
    out = torch.empty(n, length, dtype=torch.float32, device=packed.device)
    _launch(_grid_dequantize_kernel, n, length, packed.contiguous(), levels.contiguous(), out, BITS=bits)
    return out
