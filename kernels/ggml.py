"""llama.cpp's KV cache types in plain torch: ggml's q8_0 and q4_0 blocks, bit for bit, and the Hadamard rotation
llama.cpp applies to K and V before it stores them in a quantized cache (the ``ggml`` scheme of ``kind: quant``).

Read from llama.cpp's sources (ggml-org/llama.cpp, as vendored by llama-cpp-python 0.3.36); nothing here is their
code. A block is 32 consecutive values of a row; a KV cache row is one token's K (or V) of one layer, all KV heads
one after another, so with a head_dim that is a multiple of 32 the blocks run along each head's channels.

- ``ggml/src/ggml-common.h``: ``block_q8_0`` is an fp16 scale ``d`` then 32 int8 ``qs`` (34 bytes); ``block_q4_0``
  an fp16 ``d`` then 16 bytes ``qs`` whose low nibble holds value j and high nibble value j + 16 (18 bytes).
- ``ggml/src/ggml-quants.c``, ``quantize_row_q8_0_ref``: amax = max |x|, d = amax / 127 (float32), id = 1 / d (0
  when d is 0), q = roundf(x · id) (ties away from zero); the block stores fp16(d). ``dequantize_row_q8_0``: q · d.
- ``ggml/src/ggml-quants.c``, ``quantize_row_q4_0_ref``: ``max`` is the signed value of the largest magnitude (the
  first such, strictly larger |x| replacing it; 0 for an all-zero block), d = max / −8, id = 1 / d (0 when d is 0),
  q = min(15, (int8_t)(x · id + 8.5)) (truncation, in float32); fp16(d) stored. ``dequantize_row_q4_0``: (q − 8) · d.
  The value of largest magnitude is coded exactly as −8 · d; values of the other sign beyond 7.5 |d| clamp to 7 d.
  An all-zero block stores d = −0 (0 / −8) and codes 8.
- The rows written into the cache: ``ggml/src/ggml-cpu/ops.cpp`` ``ggml_compute_forward_set_rows`` calls the CPU
  type's ``from_float`` (``ggml/src/ggml-cpu/ggml-cpu.c`` ``type_traits_cpu``). For q4_0 that is the reference
  (``ggml/src/ggml-cpu/quants.c`` ``quantize_row_q4_0``). For q8_0 on an AVX or AVX2 x86 build it is
  ``ggml/src/ggml-cpu/arch/x86/quants.c`` ``quantize_row_q8_0``, which differs from the reference: id = 127 / amax
  and ``_mm256_round_ps(…, _MM_ROUND_NEAREST)``, ties to even (measured on this project's AVX2 build: 14 of 6.4
  million codes of random normal data differ, the scales never). ``rounding="x86"`` gives those codes,
  ``rounding="ref"`` the reference's (which ``ggml_quantize_chunk``, i.e. GGUF files, uses).
- The rotation: ``src/llama-kv-cache.cpp`` sets ``attn_rot_k`` when the K cache type is quantized and the head
  dim is a multiple of 64, ``attn_rot_v`` likewise for V (``LLAMA_ATTN_ROT_DISABLE=1`` turns both off; PR #21038,
  "llama : rotate activations for better quantization", merged 2026-04-01). ``src/llama-graph.cpp``
  ``build_attn`` then multiplies Q and K (post-RoPE) by the orthonormal Sylvester Hadamard matrix H_n / √n
  (``ggml_gen_hadamard``; symmetric, its own inverse) in chunks of n channels before K is stored, V likewise, and
  the attention output by H again. n for K is the largest power of two from 64 up that divides the head dim
  (``build_input_k_rot``); for V it is 64 (``build_input_v_rot``). On the CPU the product is a fast Walsh–Hadamard
  transform (``ggml/src/ggml-cpu/ops.cpp`` ``ggml_compute_forward_fwht``: x · 1/√n, then butterflies u + v, u − v
  for strides 1, 2, 4, …), which :func:`hadamard` computes in the same order in float32, so the same values.

Codes for blocks whose float32 scale underflows (|x| below about 2^−120, where 1 / d overflows) are not modeled:
kvlab codes them as an all-zero block; their fp16 scale is 0 in both, so every value decodes to 0 either way.
"""

from __future__ import annotations

import numpy as np
import torch

QK = 32  # values per block (QK8_0, QK4_0)
TYPES = ("f16", "q8_0", "q4_0")  # the KV cache types kvlab models (llama.cpp's --cache-type-k / --cache-type-v)
QUANTIZED = ("q8_0", "q4_0")
BITS = {"f16": 16, "q8_0": 8, "q4_0": 4}  # bits per value's code
BLOCK_BYTES = {"f16": (1, 2), "q8_0": (QK, 34), "q4_0": (QK, 18)}  # (values, bytes) per block, as ggml-common.h
ROUNDINGS = ("x86", "ref")


def row_bytes(ggml_type: str, values: int) -> int:
    """Bytes of `values` consecutive values of one row in `ggml_type` blocks."""
    per, size = BLOCK_BYTES[ggml_type]
    if values % per:
        raise ValueError(f"ggml type {ggml_type} packs {per} values per block; a row of {values} does not divide")
    return values // per * size


def _div(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """a / b as IEEE float32 division, elementwise (a scalar divisor may become a multiply by its reciprocal)."""
    return a / (torch.full_like(a, b) if not torch.is_tensor(b) else b)


def _inverse(d: torch.Tensor, top: float = 1.0) -> torch.Tensor:
    """top / d where d is nonzero and the quotient finite, else 0 (float32)."""
    inv = _div(torch.full_like(d, top), torch.where(d != 0, d, torch.ones_like(d)))
    return torch.where((d != 0) & torch.isfinite(inv), inv, torch.zeros_like(inv))


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, ties away from zero (exact: a float's fraction is representable)."""
    t = torch.trunc(y)
    return torch.where((y - t).abs() >= 0.5, t + torch.sign(y), t)


def q8_0_quantize(rows: torch.Tensor, rounding: str = "x86") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (N, 32) → (qs (N, 32) int8 codes as uint8 bytes, d (N,) fp16), as llama.cpp stores a q8_0 row."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"q8_0 rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    x = rows.float()
    amax = x.abs().amax(1)
    d = _div(amax, 127.0)
    if rounding == "ref":
        q = _round_half_away(x * _inverse(d)[:, None])
    else:
        q = torch.round(x * _inverse(amax, 127.0)[:, None])  # torch.round: ties to even, as _MM_ROUND_NEAREST
    return q.to(torch.int8).view(torch.uint8), d.to(torch.float16)


def q4_0_quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (N, 32) → (qs (N, 16) uint8: value j in the low nibble, j + 16 in the high one; d (N,) fp16)."""
    x = rows.float()
    amax, first = x.abs().max(1)  # torch.max returns the first index of the maximum, as the strict < of ggml's loop
    peak = torch.where(amax > 0, x.gather(1, first[:, None])[:, 0], torch.zeros_like(amax))
    d = _div(peak, -8.0)
    q = torch.trunc(x * _inverse(d)[:, None] + 8.5).clamp_(0, 15).to(torch.uint8)
    return q[:, : QK // 2] | (q[:, QK // 2 :] << 4), d.to(torch.float16)


def quantize(rows: torch.Tensor, ggml_type: str, rounding: str = "x86") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (N, 32) → (qs, d) of `ggml_type` (q8_0 or q4_0)."""
    if rows.shape[-1] != QK:
        raise ValueError(f"ggml blocks hold {QK} values, got rows of {rows.shape[-1]}")
    if ggml_type == "q8_0":
        return q8_0_quantize(rows, rounding)
    if ggml_type == "q4_0":
        return q4_0_quantize(rows)
    raise ValueError(f"ggml type must be one of {', '.join(QUANTIZED)}, got {ggml_type!r}")


def dequantize(qs: torch.Tensor, d: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Inverse of :func:`quantize`: (N, 32) float32, as ``dequantize_row_q8_0`` / ``dequantize_row_q4_0``."""
    scale = d.float()[:, None]
    if ggml_type == "q8_0":
        return qs.view(torch.int8).float() * scale
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float() - 8
    return q * scale


def block_bytes(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The bytes ggml stores for these blocks (N, 34 or 18) uint8: fp16 d (little-endian) then qs."""
    return torch.cat([d.contiguous().view(torch.uint8).view(-1, 2), qs], dim=1)


# --------------------------------------------------------------------------- #
# The rotation (llama.cpp's attn_rot_k / attn_rot_v)
# --------------------------------------------------------------------------- #


def k_rotation(head_dim: int) -> int | None:
    """n of llama.cpp's K rotation for this head dim: the largest power of two from 64 up dividing it; None below."""
    if head_dim % 64:
        return None
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def v_rotation(head_dim: int) -> int | None:
    """n of llama.cpp's V rotation: 64 where the head dim is a multiple of 64, else none."""
    return 64 if head_dim % 64 == 0 else None


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., D) float32 with each run of `n` channels multiplied by H_n / √n (Sylvester order), computed as ggml's
    CPU transform: scaled by float32 1/√n first, then butterflies (u + v, u − v) at strides 1, 2, …, n/2. H_n / √n is
    symmetric and orthonormal: applied twice it gives x back (up to float32 rounding)."""
    if n & (n - 1) or x.shape[-1] % n:
        raise ValueError(f"a Hadamard rotation of {n} channels needs a power of two dividing the last dim {x.shape[-1]}")
    scale = float(np.float32(1.0) / np.sqrt(np.float32(n)))
    y = x.float().reshape(-1, n) * scale
    length = 1
    while length < n:
        pairs = y.view(-1, n // (2 * length), 2, length)
        u, v = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([u + v, u - v], dim=2).view(-1, n)
        length *= 2
    return y.view(x.shape)
