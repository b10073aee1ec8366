"""Codecs of the quantized cache layers (``kvlab.kernels.kvcache``): one per tensor, (B, H, n, D) float ↔ a
dict of storage tensors whose dim 2 grows with tokens.

:class:`AffineCodec` (KIVI INT2/4/8 on a ``channel`` or ``token`` axis, per-token INT8 and LMDeploy-style
INT4/INT8), :class:`FP8Codec` (E4M3, static per-head scales from calibration or one dynamic per-tensor scale),
:class:`GridKeyCodec` (KVQuant-style: pre-RoPE keys, per-channel calibrated range, non-uniform grid, optional
per-vector sparse outliers), :class:`GGMLCodec` (llama.cpp's KV cache types q8_0, q4_0, f16, Hadamard-rotated as
llama.cpp does: ``kvlab.kernels.ggml``). On CUDA the Triton kernels of ``triton_quant`` run; elsewhere the torch
references of ``quant`` (equal codes); the GGML codec is plain torch everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.kernels import ggml, quant


def ops(x: torch.Tensor):
    """The Triton kernels on CUDA, the torch references elsewhere (same codes, tested)."""
    if x.is_cuda:
        from kvlab.kernels import triton_quant

        return triton_quant
    return quant



# --------------------------------------------------------------------------- #
# Codecs: (B, H, n, D) float ↔ a dict of storage tensors whose dim 2 grows with tokens
# --------------------------------------------------------------------------- #


class Codec:
    """What ``QuantizedKVLayer`` asks of a codec besides ``encode`` and ``decode``; the defaults hold for a codec
    with no metadata range to check, no check of its first input's peak, and no bytes beyond its codes."""

    fp16_metadata = False  # whether its metadata is fp16 (then quant.check_input checks the range it must fit)

    def check_first_peak(self, peak: float, what: str) -> None:
        """Check the largest |x| of the first tensor encoded (`peak`, read once with the finiteness check)."""

    def constant_bytes(self) -> int:
        """Bytes the codec stores once per layer, beside its per-token codes."""
        return 0

    def saturated(self, x: torch.Tensor) -> torch.Tensor | None:
        """Entries of x (B, H, n, D), just encoded, that the format clamped, per batch row (B,) int64 on x's device
        (no read back); None for a codec whose range covers every finite input (affine min-max, grids)."""
        return None


@dataclass
class AffineCodec(Codec):
    """Asymmetric min–max integers. ``channel``: per channel over groups of ``group`` tokens (KIVI keys);
    ``token``: per token over groups of ``group`` channels (KIVI values; INT8 per-token with group = D).
    ``encode`` takes x as checked (finite, within fp16 metadata's range): ``QuantizedKVLayer`` checks keys and
    values together, with one wait on a GPU (``quant.check_input``)."""

    bits: int
    group: int
    axis: str
    fp16_metadata = True  # its scales and zero points are fp16 (the range check of quant.check_input)

    def encode(self, x: torch.Tensor, cos=None, sin=None) -> dict[str, torch.Tensor]:
        b, h, n, d = x.shape
        packed, scale, zero = ops(x).affine_quantize(quant.to_rows(x, self.axis, self.group), self.bits, checked=True)
        if self.axis == "channel":  # rows are (b, h, token group, channel)
            lead = (b, h, n // self.group, d)
        else:  # rows are (b, h, token, channel group)
            lead = (b, h, n, d // quant.value_group(self.group, d))
        return {"codes": packed.view(*lead, -1), "scale": scale.view(lead), "zero": zero.view(lead)}

    def decode(self, s: dict[str, torch.Tensor], shape, cos=None, sin=None) -> torch.Tensor:
        rows = ops(s["codes"]).affine_dequantize(
            s["codes"].reshape(-1, s["codes"].shape[-1]), s["scale"].reshape(-1), s["zero"].reshape(-1), self.bits
        )
        return quant.from_rows(rows, self.axis, self.group, shape)


@dataclass
class FP8Codec(Codec):
    """E4M3 codes of x / scale: static per-KV-head scales (calibration), or — when ``scales`` is None — one
    per-tensor scale set from the first tensor encoded (the prefill) and reused for every later token."""

    scales: torch.Tensor | None = None  # (H,) float32, static
    dynamic: torch.Tensor | None = field(default=None, repr=False)  # () float32, set on first encode

    def head_scales(self, heads: int, device) -> torch.Tensor:
        """One float32 scale per KV head (H,): the static ones, or the dynamic per-tensor scale repeated. Static
        scales move to the device once (not a host-to-device copy at every step, which a CUDA graph forbids)."""
        if self.scales is not None:
            if self.scales.device != torch.device(device) or self.scales.dtype != torch.float32:
                self.scales = self.scales.to(device, torch.float32)
            return self.scales
        return self.dynamic.to(device, torch.float32).expand(heads)

    def check_first_peak(self, peak: float, what: str) -> None:
        """Refuse to set the dynamic scale from tokens that are all (nearly) zero: ``peak / 448`` would be a scale
        so small that every later token saturates at ±448 × scale, i.e. is wiped out to about zero. Run by
        ``QuantizedKVLayer.append`` with the peak its one read of the data already holds."""
        if self.scales is None and self.dynamic is None and peak < quant.FP8_MIN_PEAK:
            raise ValueError(
                f"{what}: fp8 dynamic scale: the first tokens quantized peak at |x| = {peak:.3g} (below {quant.FP8_MIN_PEAK:.3g}), "
                "too small to set the per-tensor scale from (later tokens would saturate); use scales: calibrated"
            )

    def _row_scales(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, _ = x.shape
        if self.scales is None and self.dynamic is None:
            # The floor only binds where no read could run check_first_peak (a CUDA graph capture): it keeps
            # |x| up to FP8_MIN_PEAK representable instead of a 1e-12 scale that saturates everything after.
            self.dynamic = (x.detach().abs().amax().float() / quant.FP8_MAX).clamp_min(quant.FP8_MIN_PEAK / quant.FP8_MAX)
        return self.head_scales(h, x.device).view(1, h, 1).expand(b, h, n).reshape(-1)

    def encode(self, x: torch.Tensor, cos=None, sin=None) -> dict[str, torch.Tensor]:
        codes = ops(x).fp8_quantize(x.reshape(-1, x.shape[-1]), self._row_scales(x), checked=True)
        return {"codes": codes.view(x.shape)}

    def decode(self, s: dict[str, torch.Tensor], shape, cos=None, sin=None) -> torch.Tensor:
        scale = self._row_scales(torch.empty(shape, device=s["codes"].device, dtype=torch.float32))
        return ops(s["codes"]).fp8_dequantize(s["codes"].reshape(-1, shape[-1]), scale).view(shape)

    def saturated(self, x: torch.Tensor) -> torch.Tensor:
        """Entries E4M3 clamped: |x / scale| beyond 464, half a step (32) above its largest value 448, where a format
        with one more exponent would have rounded to 480 and E4M3 stores ±448 × scale instead, so their error is the
        clamp, not rounding (up to 464 rounding alone gives 448, as for the peak a dynamic scale is set from). With a
        dynamic scale set from the prefill's peak only later tokens can exceed it; static (calibrated) scales clamp
        whatever exceeds the calibration's peak."""
        scale = self.head_scales(x.shape[1], x.device).view(1, -1, 1, 1)
        return ((x.float() / scale).abs() > quant.FP8_MAX + 16).sum(dim=(1, 2, 3))

    def constant_bytes(self) -> int:
        """The dynamic per-tensor scale is part of the cache; static scales are calibration constants."""
        return 4 if self.scales is None else 0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of RoPE k·cos + rotate_half(k)·sin (cos² + sin² is the rope's attention scaling squared)."""
    return (k * cos - rotate_half(k) * sin) / (cos * cos + sin * sin)


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return k * cos + rotate_half(k) * sin


@dataclass
class GridKeyCodec(Codec):
    """KVQuant-style keys: un-rotate to pre-RoPE with the tokens' own positions, map each channel onto
    [-1, 1] by its calibrated range [lo, hi], take the nearest level of the layer's calibrated non-uniform
    grid; the ``outliers`` largest normalized entries of each key vector are kept in fp16 (dense-and-sparse)
    with a uint8 channel index. Decoding maps back and re-rotates."""

    bits: int
    levels: torch.Tensor  # (2^bits,) sorted, in normalized units
    lo: torch.Tensor  # (H, D) calibrated pre-RoPE minimum per channel
    hi: torch.Tensor  # (H, D) calibrated pre-RoPE maximum per channel
    outliers: int = 0  # per key vector

    def _affine(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel centre and half-width, broadcastable to (B, H, T, D)."""
        lo, hi = self.lo.to(device, torch.float32), self.hi.to(device, torch.float32)
        return ((hi + lo) / 2)[None, :, None], ((hi - lo) / 2).clamp_min(1e-12)[None, :, None]

    def encode(self, x: torch.Tensor, cos=None, sin=None) -> dict[str, torch.Tensor]:
        centre, half = self._affine(x.device)
        v = (unrotate(x.float(), cos[:, None].float(), sin[:, None].float()) - centre) / half
        out = {"codes": ops(x).grid_quantize(v.reshape(-1, v.shape[-1]), self.levels.to(x.device), self.bits, checked=True).view(*v.shape[:3], -1)}
        if self.outliers:
            idx = v.abs().topk(self.outliers, dim=-1).indices
            out["outlier_index"] = idx.to(torch.uint8)
            out["outlier_value"] = v.gather(-1, idx).to(torch.float16)
        return out

    def decode(self, s: dict[str, torch.Tensor], shape, cos=None, sin=None) -> torch.Tensor:
        codes = s["codes"]
        v = ops(codes).grid_dequantize(codes.reshape(-1, codes.shape[-1]), self.levels.to(codes.device), self.bits).view(shape)
        if self.outliers:
            v = v.scatter(-1, s["outlier_index"].long(), s["outlier_value"].float())
        centre, half = self._affine(codes.device)
        return rotate(v * half + centre, cos[:, None].float(), sin[:, None].float())


@dataclass
class GGMLCodec(Codec):
    """One of llama.cpp's KV cache types (``kvlab.kernels.ggml``): ``q8_0`` or ``q4_0`` blocks of 32 channels per
    token and head, codes (B, H, T, D/32, 32 or 16) uint8 and one fp16 scale per block (B, H, T, D/32), or ``f16``
    values (B, H, T, D). ``rotation``: n of the Hadamard rotation llama.cpp applies before quantizing (None: none):
    encode rotates, decode rotates back (H_n / √n is its own inverse), so attention reads the tensor itself, which
    is what llama.cpp's rotated queries against rotated keys, and its output rotated back, compute. ``rounding``:
    q8_0's, as llama.cpp's x86 CPU backend writes the cache (``x86``) or as ggml's reference (``ref``)."""

    ggml_type: str
    rotation: int | None = None
    rounding: str = "x86"
    fp16_metadata = True  # fp16 scales (f16: the values themselves), the range check of quant.check_input

    def __post_init__(self):
        if self.ggml_type not in ggml.TYPES:
            raise ValueError(f"ggml type must be one of {', '.join(ggml.TYPES)}, got {self.ggml_type!r}")
        if self.rotation is not None and self.ggml_type not in ggml.QUANTIZED:
            raise ValueError("llama.cpp rotates quantized cache types only")

    def encode(self, x: torch.Tensor, cos=None, sin=None) -> dict[str, torch.Tensor]:
        b, h, n, d = x.shape
        v = x.float() if self.rotation is None else ggml.hadamard(x, self.rotation)
        if self.ggml_type == "f16":
            return {"codes": v.to(torch.float16)}
        ggml.row_bytes(self.ggml_type, d)  # a head dim that blocks of 32 do not divide: one line
        qs, scale = ggml.quantize(v.reshape(-1, ggml.QK), self.ggml_type, self.rounding)
        return {"codes": qs.view(b, h, n, d // ggml.QK, -1), "scale": scale.view(b, h, n, d // ggml.QK)}

    def decode(self, s: dict[str, torch.Tensor], shape, cos=None, sin=None) -> torch.Tensor:
        codes = s["codes"]
        if self.ggml_type == "f16":
            v = codes.float()
        else:
            v = ggml.dequantize(codes.reshape(-1, codes.shape[-1]), s["scale"].reshape(-1), self.ggml_type).view(shape)
        return v if self.rotation is None else ggml.hadamard(v, self.rotation)
