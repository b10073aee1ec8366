"""KV quantizers: plain-torch references of every code format kvlab stores, plus the layouts that map a
cache tensor onto them. The Triton kernels in ``kvlab.kernels.triton_quant`` compute exactly the same
codes (tests/test_triton_quant.py checks equality under ``TRITON_INTERPRET=1`` on the CPU, and on CUDA when present).

Every quantizer works on *rows*: a 2-D float tensor (N, L) whose rows are the quantization groups.
  - affine: asymmetric min–max with ``bits`` ∈ {2, 4, 8}; per row one fp16 scale and one fp16 zero point.
    The zero is the row minimum rounded *down* to fp16 and the scale ``(max - zero) / (2^bits - 1)`` rounded
    *up*, so the grid always covers the row and the error is at most half a step (no clamping).
  - fp8: E4M3 (``float8_e4m3fn``, round to nearest even) of ``x / scale``, saturated at ±448.
  - grid: the nearest of ``2^bits`` sorted levels (a non-uniform grid, KVQuant-style), found by counting the
    midpoints below the value (ties go to the lower level).
Codes narrower than a byte are packed little-end first: code j of a byte sits at bits ``[bits*j, bits*(j+1))``.

Layouts (a cache tensor is (B, H, T, D)):
  - ``channel``: per channel, in groups of G consecutive tokens (KIVI's keys) — rows are (channel, token group);
  - ``token``: per token, in groups of G channels (KIVI's values, and per-token INT8 with G = D).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0  # largest finite E4M3 value
# Smallest peak |x| a dynamic FP8 scale is set from: fp16's smallest normal number. Below it a prefill carries no
# magnitude to scale by (all zero, or underflowed), and peak / 448 would saturate every later token.
FP8_MIN_PEAK = 2.0**-14
FP16_MAX = 65504.0
PACKABLE_BITS = (2, 4, 8)


# --------------------------------------------------------------------------- #
# Checks
# --------------------------------------------------------------------------- #


def check_float(x: torch.Tensor, what: str) -> None:
    if not torch.is_floating_point(x):
        raise TypeError(f"{what}: expected a floating-point tensor, got {x.dtype}")


def capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on x's device: nothing may wait for data then."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_input(*checks: tuple[str, torch.Tensor, bool],
                entered: tuple[tuple[str, torch.Tensor, tuple[torch.Tensor, ...]], ...] = ()) -> list[float] | None:
    """A clear one-line error for tensors no quantizer can encode: each check is (what, tensor, fp16 metadata);
    NaN/Inf is refused, and where the tensor's codes get fp16 scales and zero points (affine), |x| beyond
    ``FP16_MAX / 2``. ``entered``: (what, device scalar, tensors holding it) for earlier calls that did not read:
    the scalar is not finite when a NaN/Inf entered full precision then (see ``QuantizedKVLayer.append``); it is
    read in the same wait, and the first `what` whose tensors hold a NaN/Inf is named. On a GPU
    this waits for the data once for all of them (one peak |x| each: NaN and Inf show in it), so callers check
    what they are about to quantize, together, not every token they see. Returns the peaks (None when nothing
    was read). While a CUDA graph is being captured nothing can wait for data: only the dtypes are checked then."""
    for what, x, _ in checks:
        check_float(x, what)
    checks = tuple(c for c in checks if c[1].numel())
    tensors = [x for _, x, _ in checks] + [flag for _, flag, _ in entered]
    if not tensors or capturing(tensors[0]):
        return None
    read = torch.stack([x.detach().abs().amax().float() for _, x, _ in checks] + [flag.float() for _, flag, _ in entered]).tolist()
    peaks = read[: len(checks)]
    for (what, x, fp16_metadata), peak in zip(checks, peaks):
        if not math.isfinite(peak):
            bad = int((~torch.isfinite(x)).sum())
            raise ValueError(f"{what}: {bad} NaN/Inf value(s); KV entries must be finite")
        if fp16_metadata:
            check_fp16_range(peak, what)
    for (what, _, held), flag in zip(entered, read[len(checks):]):
        # the held tensors decide: a flag may also be set by what left them since (or, in bf16, a sum overflowing)
        if not math.isfinite(flag) and (bad := sum(int((~torch.isfinite(t)).sum()) for t in held)):
            raise ValueError(f"{what}: {bad} NaN/Inf value(s) entered full precision in an earlier one-token append "
                             "(refused at this append's read of the data); KV entries must be finite")
    return peaks


def check_fp16_range(peak: float, what: str) -> None:
    """Affine codes keep fp16 scales and zero points: |x| must stay within ``FP16_MAX / 2``."""
    if peak > FP16_MAX / 2:
        raise ValueError(f"{what}: |x| up to {peak:.3g} exceeds what fp16 scales and zero points can describe "
                         f"(|x| ≤ {FP16_MAX / 2:g})")


def check_fp8_input(rows: torch.Tensor, scale: torch.Tensor) -> None:
    """FP8 rows must be finite and their scales finite and positive (a zero scale makes x / scale NaN or ±448)."""
    check_float(rows, "fp8 quantization rows")
    check_float(scale, "fp8 quantization scale")
    if not rows.numel() or capturing(rows):
        return
    peak, smallest, largest = torch.stack([rows.detach().abs().amax().float(), scale.detach().amin().float(),
                                           scale.detach().abs().amax().float()]).tolist()
    if not math.isfinite(peak):
        bad = int((~torch.isfinite(rows)).sum())
        raise ValueError(f"fp8 quantization rows: {bad} NaN/Inf value(s); KV entries must be finite")
    if not (math.isfinite(largest) and smallest > 0):
        raise ValueError(f"fp8 quantization scale: scales must be finite and > 0, got values from {smallest:.3g} to {largest:.3g}")


def check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS} (codes are packed whole into bytes), got {bits}")


# --------------------------------------------------------------------------- #
# Bit packing
# --------------------------------------------------------------------------- #


def check_length(length: int, bits: int) -> None:
    """Rows are packed whole: their length must fill whole bytes."""
    per = 8 // bits
    if length % per:
        raise ValueError(f"pack: row length {length} is not a multiple of {per} ({bits}-bit codes per byte)")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, L) integer codes < 2^bits → (N, L * bits / 8) uint8."""
    per = 8 // bits
    n, length = codes.shape
    check_length(length, bits)
    c = codes.to(torch.int32).view(n, length // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, C) uint8 → (N, C * 8 / bits) uint8 codes (inverse of :func:`pack`)."""
    per = 8 // bits
    shifts = (torch.arange(per, device=packed.device) * bits).to(torch.uint8)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


# --------------------------------------------------------------------------- #
# fp16 metadata with directed rounding
# --------------------------------------------------------------------------- #


def _fp16_step(h: torch.Tensor, up: bool) -> torch.Tensor:
    """The next fp16 value above (`up`) or below ``h`` (finite inputs, result as fp16)."""
    bits = h.view(torch.int16).to(torch.int32)  # sign-magnitude: negative floats are negative ints
    if up:  # +x grows in magnitude, -x shrinks; -0 (0x8000) steps to the smallest positive subnormal
        nxt = torch.where(bits >= 0, bits + 1, torch.where(bits == -32768, 1, bits - 1))
    else:  # +x shrinks (+0 steps to 0x8001, the smallest negative subnormal), -x grows
        nxt = torch.where(bits > 0, bits - 1, torch.where(bits == 0, -32767, bits + 1))
    return nxt.to(torch.int16).view(torch.float16)


def fp16_down(x: torch.Tensor) -> torch.Tensor:
    """Largest fp16 ≤ x (x float32)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, _fp16_step(h, up=False), h)


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 ≥ x (x float32)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, _fp16_step(h, up=True), h)


# --------------------------------------------------------------------------- #
# Row quantizers (the references)
# --------------------------------------------------------------------------- #


def affine_quantize(rows: torch.Tensor, bits: int, checked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (N, L) → (packed codes (N, L*bits/8) uint8, scale (N,) fp16, zero (N,) fp16). NaN/Inf and |x| beyond
    fp16 metadata's range are refused (one read of the data), unless ``checked``: the caller has run
    ``check_input`` on these values, so they are not checked again."""
    check_bits(bits)
    x = rows.float()
    if not checked:
        check_input(("affine quantization rows", rows, True))
    zero = fp16_down(x.amin(1))
    levels = 2**bits - 1
    span = x.amax(1) - zero.float()
    # An elementwise divisor, not the int: on CUDA torch divides by a scalar as a multiply by its reciprocal,
    # which is not IEEE division (seen on an H200: 11130 / 15 gave 742.00004, rounded up to an fp16 scale of
    # 742.5 where the exact 742 is representable), so scales would depend on the device and miss the kernels'.
    scale = fp16_up(span / torch.full_like(span, levels))
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.floor((x - zero.float()[:, None]) / safe[:, None] + 0.5).clamp_(0, levels)
    return pack(q.to(torch.uint8), bits), scale, zero


def affine_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`affine_quantize`: (N, L) float32."""
    return unpack(packed, bits).float() * scale.float()[:, None] + zero.float()[:, None]


def fp8_quantize(rows: torch.Tensor, scale: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Rows (N, L) and one float32 scale per row (N,) → E4M3 codes of ``x / scale`` as uint8 (N, L), saturating.
    NaN/Inf rows and scales that are not finite and positive are refused (one read), unless ``checked``."""
    if not checked:
        check_fp8_input(rows, scale)
    y = (rows.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: (N, L) float32."""
    return codes.view(torch.float8_e4m3fn).float() * scale.float()[:, None]


def grid_midpoints(levels: torch.Tensor) -> torch.Tensor:
    """Decision boundaries between sorted levels (float32)."""
    lv = levels.float()
    return (lv[1:] + lv[:-1]) * 0.5


def grid_quantize(rows: torch.Tensor, levels: torch.Tensor, bits: int, checked: bool = False) -> torch.Tensor:
    """Rows (N, L) of normalized values → packed indices of the nearest level (N, L*bits/8) uint8. NaN/Inf rows
    (which would take the top level) are refused, unless ``checked``."""
    check_bits(bits)
    if not checked:
        check_input(("grid quantization rows", rows, False), ("grid quantization levels", levels, False))
    if levels.numel() != 2**bits:
        raise ValueError(f"grid quantization: {levels.numel()} levels given, {bits} bits need {2**bits}")
    if bool((levels[1:] < levels[:-1]).any()):
        raise ValueError("grid quantization: levels must be sorted ascending")
    mids = grid_midpoints(levels)
    q = (rows.float()[..., None] > mids).sum(-1)
    return pack(q.to(torch.uint8), bits)


def grid_dequantize(packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    return levels.float()[unpack(packed, bits).long()]


# --------------------------------------------------------------------------- #
# Layouts: cache tensors (B, H, T, D) ↔ rows
# --------------------------------------------------------------------------- #


def value_group(group: int, head_dim: int) -> int:
    """Channels per per-token group: G, or the whole head when it is narrower than G."""
    g = min(group, head_dim)
    if head_dim % g:
        raise ValueError(f"group {group} does not divide head_dim {head_dim}; pick a divisor of {head_dim}")
    return g


def to_rows(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """(B, H, T, D) → rows. ``channel``: T must be a multiple of ``group``; ``token``: see :func:`value_group`."""
    b, h, t, d = x.shape
    if axis == "channel":
        if t % group:
            raise ValueError(f"per-channel groups need a multiple of {group} tokens, got {t}")
        return x.reshape(b, h, t // group, group, d).transpose(-1, -2).reshape(-1, group)
    if axis == "token":
        g = value_group(group, d)
        return x.reshape(-1, g)
    raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")


def from_rows(rows: torch.Tensor, axis: str, group: int, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Inverse of :func:`to_rows`."""
    b, h, t, d = shape
    if axis == "channel":
        return rows.reshape(b, h, t // group, d, group).transpose(-1, -2).reshape(b, h, t, d)
    return rows.reshape(b, h, t, d)
