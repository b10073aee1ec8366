"""Triton flash-decoding over packed KV codes: the code segment of ``kvlab.kernels.decode_attention`` (read that
module for the formats and the merge), computed without writing the dequantized cache anywhere.

One program per (sequence, KV head, split of the token axis) serves all ``rep`` query heads of its KV head
(GQA: the codes are read once for the group). It walks its tokens ``BLOCK_T`` at a time: loads the packed
bytes, shifts each code out, applies the group's fp16 scale and zero point (KIVI) or the E4M3 bit pattern and
the head's scale (FP8) in registers, and keeps an online softmax (running max, sum, weighted values). One more
program per (sequence, KV head) attends to the full-precision tokens (sinks, residual, the new one); every
program writes its (o, lse), and a second small kernel merges them: two launches per layer and step.

Dots run in the query's dtype with float32 accumulation (bf16 on GPU models); float32 queries use exact
("ieee") dots, which is what the tests compare against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.triton_quant import e4m3_to_float

_PROGRAMS = 264  # programs to aim for: two per SM of an H100 (132 SMs); more splits only add merge work
_BYTES = {"KBITS": 8, "KG": 1, "KCHANNEL": False, "VBITS": 8, "VG": 1, "VCHANNEL": False}  # one code per byte


@triton.jit
def _affine_tile(c, s, z, base, t, m2, d, T, D, BITS: tl.constexpr, G: tl.constexpr, CHANNEL: tl.constexpr):
    """Dequantized (BLOCK_T, BLOCK_D) float32 of tokens ``t`` of one (sequence, KV head) from affine codes.
    CHANNEL: rows are (group of G tokens, channel), each packing its G codes (KIVI keys); otherwise rows are
    (token, group of G channels) (KIVI values, per-token INT8)."""
    PER: tl.constexpr = 8 // BITS
    if CHANNEL:
        row = (base * (T // G) + t // G)[:, None] * D + d[None, :]
        at = (t % G)[:, None] + 0 * d[None, :]  # position of each code inside its row
    else:
        row = (base * T + t)[:, None] * (D // G) + (d // G)[None, :]
        at = 0 * t[:, None] + (d % G)[None, :]
    byte = tl.load(c + row * (G // PER) + at // PER, mask=m2, other=0).to(tl.int32)
    code = (byte >> ((at % PER) * BITS)) & ((1 << BITS) - 1)
    return code.to(tl.float32) * tl.load(s + row, mask=m2, other=0).to(tl.float32) + tl.load(z + row, mask=m2, other=0).to(tl.float32)


@triton.jit
def _fp8_tile(c, scale, base, t, m2, d, T, D):
    """Dequantized (BLOCK_T, BLOCK_D) float32 of tokens ``t`` from E4M3 codes (B, H, T, D) and the head's scale."""
    return e4m3_to_float(tl.load(c + (base * T + t)[:, None] * D + d[None, :], mask=m2, other=0).to(tl.int32)) * scale


@triton.jit
def _online(q, k, v, tmask, m, l, acc, scaling, IEEE: tl.constexpr):
    """One block of the online softmax: scores of the rep query heads against BLOCK_T keys, then values."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.where(tmask[None, :], s * scaling, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite after a program's first block, which always holds a token
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(q_ptr, o_ptr, lse_ptr, kc, ks, kz, vc, vs, vz, dk, dv, H, T, ND, D, REP, SPLITS, BLOCKS_PER_SPLIT,
                   scaling, FP8: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KCHANNEL: tl.constexpr,
                   VBITS: tl.constexpr, VG: tl.constexpr, VCHANNEL: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Programs (sequence × KV head, split): splits 0…SPLITS-1 walk the codes, the last one the ND dense tokens
    (sinks, residual, the new token); each writes its softmax state (o, lse) for the rep query heads."""
    bh = tl.program_id(0).to(tl.int64)  # (sequence, KV head), int64 so long caches do not overflow offsets
    split = tl.program_id(1)
    h = bh % H
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rmask = r < REP
    dmask = d < D
    qrow = bh * REP + r  # query heads h*rep … h*rep+rep-1 of this sequence
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    if split < SPLITS:
        if FP8:
            k_scale = tl.load(ks + h).to(tl.float32)
            v_scale = tl.load(vs + h).to(tl.float32)
        for i in range(BLOCKS_PER_SPLIT):
            t = (split * BLOCKS_PER_SPLIT + i) * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < T
            m2 = tmask[:, None] & dmask[None, :]
            if FP8:
                k = _fp8_tile(kc, k_scale, bh, t, m2, d, T, D)
                v = _fp8_tile(vc, v_scale, bh, t, m2, d, T, D)
            else:
                k = _affine_tile(kc, ks, kz, bh, t, m2, d, T, D, KBITS, KG, KCHANNEL)
                v = _affine_tile(vc, vs, vz, bh, t, m2, d, T, D, VBITS, VG, VCHANNEL)
            m, l, acc = _online(q, k, v, tmask, m, l, acc, scaling, IEEE)
    else:
        for start in range(0, ND, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            tmask = t < ND
            m2 = tmask[:, None] & dmask[None, :]
            off = (bh * ND + t)[:, None] * D + d[None, :]
            k = tl.load(dk + off, mask=m2, other=0.0).to(tl.float32)
            v = tl.load(dv + off, mask=m2, other=0.0).to(tl.float32)
            m, l, acc = _online(q, k, v, tmask, m, l, acc, scaling, IEEE)
    out = qrow * (SPLITS + 1) + split
    tl.store(o_ptr + out[:, None] * D + d[None, :], acc / l[:, None], mask=rmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + out, m + tl.log(l), mask=rmask)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, query head): the splits' states merged, weights exp(lse_i − logsumexp)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < S
    lse = tl.load(lse_ptr + row * S + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    o = tl.load(o_ptr + (row * S + s)[:, None] * D + d[None, :], mask=smask[:, None] & (d < D)[None, :], other=0.0)
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * o, axis=0), mask=d < D)


def attend(q: torch.Tensor, layer, fmt: str, dense_k: torch.Tensor, dense_v: torch.Tensor, scaling: float,
           splits: int | None = None, block_t: int = 64) -> torch.Tensor:
    """Attention output (B, H_q, D) float32 of q over the layer's codes (split in S parts, by default enough
    programs to fill an H100) and the dense tokens `dense_k`/`dense_v` (B, H, n ≥ 1, D): two launches."""
    b, hq, d = q.shape
    h, t = dense_k.shape[1], layer.quantized
    rep = hq // h
    blocks = triton.cdiv(t, block_t)
    wanted = splits or max(1, triton.cdiv(_PROGRAMS, b * h))
    per_split = triton.cdiv(blocks, min(blocks, wanted)) if blocks else 0
    n_splits = triton.cdiv(blocks, per_split) if blocks else 0  # every split starts inside the T tokens
    o = torch.empty(b, hq, n_splits + 1, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, n_splits + 1, dtype=torch.float32, device=q.device)
    key, value = layer.stored["key"], layer.stored["value"]
    if not t:  # nothing quantized yet: the dense program alone (the code pointers are never read)
        tensors, layout = (dense_k,) * 6, _BYTES
    elif fmt == "fp8":
        tensors = (key["codes"], layer.spec.key.head_scales(h, q.device), key["codes"],
                   value["codes"], layer.spec.value.head_scales(h, q.device), value["codes"])
        layout = _BYTES
    else:
        tensors = (key["codes"], key["scale"], key["zero"], value["codes"], value["scale"], value["zero"])
        layout = {}
        for tag, codec, stored in (("K", layer.spec.key, key), ("V", layer.spec.value, value)):
            channel = codec.axis == "channel"  # a token-axis group is the head when the head is narrower
            group = codec.group if channel else d // stored["scale"].shape[-1]
            layout |= {f"{tag}BITS": codec.bits, f"{tag}G": group, f"{tag}CHANNEL": channel}
    q = q.contiguous()
    _decode_kernel[(b * h, n_splits + 1)](
        q, o, lse, *(x.contiguous() for x in tensors), dense_k.contiguous(), dense_v.contiguous(), h, t,
        dense_k.shape[2], d, rep, n_splits, per_split, float(scaling), FP8=fmt == "fp8" and bool(t), **layout,
        IEEE=q.dtype == torch.float32, BLOCK_R=max(16, triton.next_power_of_2(rep)), BLOCK_T=block_t,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    _combine_kernel[(b * hq,)](o, lse, out, n_splits + 1, d, BLOCK_S=max(2, triton.next_power_of_2(n_splits + 1)),
                               BLOCK_D=triton.next_power_of_2(d))
    return out
