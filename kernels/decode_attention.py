"""Decode attention over a quantized cache layer: one query token per sequence against sinks + packed codes +
the full-precision residual, without materializing the dequantized cache.

The quantized part is attended segment by segment, each returning its softmax state: the normalized output
``o`` and the log-sum-exp ``lse`` of its scaled scores. Segments merge exactly (flash-decoding):
``lse = logsumexp(lse_i)``, ``o = Σ exp(lse_i − lse) · o_i``. The tokens whose key and value are both in codes are
one segment per split of the token axis; every other token (sinks, the codes of one tensor beyond those, which
KIVI's policy leaves, e.g. keys flushed while their values are still in full precision, dequantized; the
residual; the new token) is a short dense segment.

This module holds the torch reference (the codes dequantized with ``kvlab.kernels.quant``, then dense attention
per segment, then the merge) and the dispatcher; ``kvlab.kernels.triton_decode`` computes the same output with
one Triton kernel that reads the packed codes and dequantizes in registers, plus a merge kernel
(tests/test_decode_attention.py checks they agree under ``TRITON_INTERPRET=1`` on the CPU, and on CUDA when present).

Formats read (written by ``kvlab.kernels.kvcache``; B batch, H KV heads, T quantized tokens, D head dim):
  - affine on ``channel`` (KIVI keys): codes (B, H, T/G, D, G·bits/8), scale and zero (B, H, T/G, D) fp16;
  - affine on ``token`` (KIVI values, INT8): codes (B, H, T, D/g, g·bits/8), scale and zero (B, H, T, D/g) fp16;
  - FP8 (``FP8Codec``): E4M3 codes (B, H, T, D) uint8 with one float32 scale per KV head.
Queries are (B, H_q, D) with H_q = H · rep; query head ``i`` reads KV head ``i // rep`` (transformers' layout).
"""

from __future__ import annotations

import torch

# Whether generation's decode steps use the Triton kernel over the codes (kvlab.engine): None = on CUDA for
# the formats of `supported`; True = everywhere (on the CPU through Triton's interpreter: slow, for tests);
# False = never (the layer dequantizes its codes at every step, as transformers' quantized caches do).
FUSED: bool | None = None


def fused_enabled(device) -> bool:
    return torch.device(device).type == "cuda" if FUSED is None else FUSED


def fused_rows(layers: list, device) -> bool:
    """Whether decode steps on `device` attend to these cache layers with the kernel: all in a format it reads."""
    return fused_enabled(device) and all(supported(layer) for layer in layers)


def dense_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax state of q (B, H_q, D) over dense k, v (B, H, n, D): o (B, H_q, D) float32, lse (B, H_q) float32.
    An empty segment (n = 0) has lse = −inf and o = 0, so it merges as nothing."""
    b, hq, d = q.shape
    rep = hq // k.shape[1]
    qg = q.float().view(b, k.shape[1], rep, d)
    scores = torch.einsum("bhrd,bhnd->bhrn", qg, k.float()) * scaling
    if scores.shape[-1] == 0:
        return q.new_zeros(b, hq, d, dtype=torch.float32), q.new_full((b, hq), float("-inf"), dtype=torch.float32)
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("bhrn,bhnd->bhrd", torch.exp(scores - lse[..., None]), v.float())
    return o.reshape(b, hq, d), lse.reshape(b, hq)


def merge(states: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One output from several segments' (o, lse); o of shape (B, H_q, D) or (B, H_q, S, D) with lse (B, H_q, S)."""
    os = torch.cat([o if o.dim() == 4 else o[:, :, None] for o, _ in states], dim=2)
    lses = torch.cat([lse if lse.dim() == 3 else lse[:, :, None] for _, lse in states], dim=2)
    total = torch.logsumexp(lses, dim=-1, keepdim=True)
    weight = torch.exp(lses - total).nan_to_num_(0.0)  # a segment with lse = −inf weighs 0
    return (weight[..., None] * os).sum(2)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def head_dim_fits(d: int) -> bool:
    """Whether the kernel's tiles span a head of `d` channels: a power of two from 16 to 256."""
    return _pow2(d) and 16 <= d <= 256


def fp8_readable(capability: tuple[int, int] | None) -> bool:
    """Whether the kernel can read E4M3 codes on a GPU of this compute capability (None: no GPU, Triton's CPU
    interpreter, which can): Triton converts E4M3 in hardware from sm_89 (Ada, Hopper) on."""
    return capability is None or tuple(capability) >= (8, 9)


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def tileable(codec, spec, head_dim: int) -> bool:
    """Whether the kernel's tiles fit an affine codec's layout: a tile holds whole channel-axis groups, so a
    power of two from 32 to 128 tokens that divides the layer's flush group; a token-axis group is a
    power-of-two run of channels whose codes fill whole 32-bit words (the kernel's loads). (16-token groups,
    one per tile in the kernel's previous version, gave wrong bf16 outputs on an H200 with Triton 3.6 while
    float32 was exact; until a GPU run shows that tiles of several groups read them right, they take the
    dequantizing path.)"""
    if codec.axis == "channel":
        return _pow2(codec.group) and 32 <= codec.group <= 128 and spec.group % codec.group == 0
    g = min(codec.group, head_dim)
    return _pow2(g) and g * codec.bits >= 32


def supported(layer) -> str | None:
    """The fused format of a cache layer: 'affine' (KIVI on either axis, per-token INT8), 'fp8', or None where
    the kernel has none: not a ``QuantizedKVLayer``; FP8 on a GPU older than sm_89 (``fp8_readable``); a head
    dim that is not a power of two from 16 to 256; KVQuant's pre-RoPE grid keys, which need each token's RoPE
    tables; mixed codecs; affine groups its tiles do not fit (see ``tileable``), or keys and values both on the
    channel axis with different groups or bits."""
    from kvlab.kernels.codecs import AffineCodec, FP8Codec
    from kvlab.kernels.kvcache import QuantizedKVLayer

    if not isinstance(layer, QuantizedKVLayer) or not layer.is_initialized:
        return None
    d = layer.keys.shape[-1]
    if not head_dim_fits(d):
        return None
    key, value = layer.spec.key, layer.spec.value
    if isinstance(key, FP8Codec) and isinstance(value, FP8Codec):
        return "fp8" if fp8_readable(_capability(layer.keys.device)) else None
    if not (isinstance(key, AffineCodec) and isinstance(value, AffineCodec)) or layer.spec.rope:
        return None
    if not (tileable(key, layer.spec, d) and tileable(value, layer.spec, d)):
        return None
    if key.axis == value.axis == "channel" and (key.group, key.bits) != (value.group, value.bits):
        return None  # a tile's token order comes from its channel-axis codec's groups and bits (triton_decode)
    return "affine"


def codes_segment_reference(q: torch.Tensor, layer, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax state over the tokens whose key and value are both in codes: dequantize them (the codecs'
    references), then attend."""
    both = layer.quantized
    return dense_segment(q, layer.decode("key", 0, both), layer.decode("value", 0, both), scaling)


def dense_tokens(layer, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense segment (B, H, n, D) keys and values: every token after those whose key and value are both in
    codes: sinks, the codes one tensor holds beyond those (dequantized: at most a residual's worth), residual,
    then the new token (if given); the residual itself where it is all of it (no copy)."""
    both, out = layer.quantized, []
    for part, sinks, held, new, coded in (("key", layer.sink_keys, layer.keys, new_keys, layer.coded_keys),
                                           ("value", layer.sink_values, layer.values, new_values, layer.coded_values)):
        lead = layer.decode(part, both, coded) if coded > both else None
        parts = [t for t in (sinks, lead, held, new) if t is not None]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2))
    return out[0], out[1]


def decode_attention(q: torch.Tensor, layer, new_keys: torch.Tensor | None, new_values: torch.Tensor | None, scaling: float,
                     fused: bool | None = None) -> torch.Tensor:
    """Attention output (B, H_q, D) float32 of one new token per sequence over a ``QuantizedKVLayer`` that does
    not yet hold it (``new_keys``/``new_values`` (B, H, 1, D)), or that holds it in full precision already (None,
    None: appended without quantizing anything, so it is the last token of the residual). ``fused``: the Triton
    kernel reads the codes (default: on CUDA, for the formats of :func:`supported`); otherwise the torch
    reference dequantizes them."""
    if q.dim() != 3 or (new_keys is not None and new_keys.shape[-2] != 1):
        raise ValueError(f"decode attention takes one query token per sequence: q (B, H_q, D), got {tuple(q.shape)}")
    fmt = supported(layer)
    if fused is None:
        fused = fused_enabled(q.device) and fmt is not None
    if fused and fmt is None:
        raise ValueError(f"no fused decode kernel for keys {layer.spec.key!r} and values {layer.spec.value!r}")
    dense_k, dense_v = dense_tokens(layer, new_keys, new_values)
    if fused:
        from kvlab.kernels import triton_decode

        return triton_decode.attend(q, layer, fmt, dense_k, dense_v, scaling)
    states = [dense_segment(q, dense_k, dense_v, scaling)]
    if layer.quantized:
        states.append(codes_segment_reference(q, layer, scaling))
    return merge(states)

