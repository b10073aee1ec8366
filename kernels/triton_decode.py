"""Triton flash-decoding over packed KV codes: the code segment of ``kvlab.kernels.decode_attention`` (read that
module for the formats and the merge), computed without writing the dequantized cache anywhere.

One program per (sequence, KV head, split of the token axis) serves all ``rep`` query heads of its KV head
(GQA: the codes are read once for the group). It walks its tokens one tile at a time and keeps an online
softmax (running max, sum, weighted values). Tiles are read in their storage layout, so every load is a
contiguous run of bytes:
  - channel-axis codes (KIVI keys): a tile is one group of G tokens, stored as (D channels × G·bits/8 bytes);
    the codes are shifted out in registers (low bits first) into a (D, G) tile, which is the transposed keys
    the score product needs, and the group's fp16 scale and zero point per channel are applied to it;
  - token-axis codes (KIVI values, per-token INT8): each token's D·bits/8 bytes, unpacked to (tokens, D), each
    run of g channels scaled by its own scale and zero point;
  - FP8 E4M3: each token's D bytes, converted by the hardware (E4M3 values are exact in bf16/fp16/fp32); the
    per-head scales multiply the scores and the output, not every element.
One more program per (sequence, KV head) attends to the full-precision tokens (sinks, residual, the new one);
every program writes its (o, lse), and a second small kernel merges them: two launches per layer and step.

Dots run in the query's dtype with float32 accumulation (bf16 on GPU models); float32 queries use exact
("ieee") dots, which is what the tests compare against the torch reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_PROGRAMS_PER_SM = 4  # programs to aim for per multiprocessor: enough loads in flight to keep memory busy
_MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in its (o, lse) and merge than it saves


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@triton.jit
def _unpack(b, BITS: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr):
    """Codes (ROWS, NB·8/BITS) int32 from packed bytes (ROWS, NB) int32: code j of a row sits in byte j·BITS/8,
    lowest bits first (``kvlab.kernels.quant`` packs them so)."""
    if BITS == 8:
        return b
    elif BITS == 4:
        return tl.reshape(tl.join(b & 15, b >> 4), (ROWS, NB * 2))
    else:  # 2 bits: join(join(c0, c2), join(c1, c3)) lays the four codes of a byte out in order c0 c1 c2 c3
        return tl.reshape(tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, b >> 6)), (ROWS, NB * 4))


@triton.jit
def _channel_tile(c, s, z, grp, d, BITS: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """(D, G) float32: one group of G tokens of channel-axis codes (rows (group, channel) of G·bits/8 bytes),
    dequantized; ``grp`` is the group's row block (sequence × head × token group)."""
    NB: tl.constexpr = G * BITS // 8
    row = grp * D + d
    b = tl.load(c + row[:, None] * NB + tl.arange(0, NB)[None, :]).to(tl.int32)
    codes = _unpack(b, BITS, D, NB).to(tl.float32)
    return codes * tl.load(s + row).to(tl.float32)[:, None] + tl.load(z + row).to(tl.float32)[:, None]


@triton.jit
def _token_tile(c, s, z, tok, tmask, BITS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """(BLOCK_T, D) float32: tokens ``tok`` (row indices sequence × head × token) of token-axis codes, each token's
    D·bits/8 bytes in a row, one scale and zero point per run of G channels."""
    NB: tl.constexpr = D * BITS // 8
    NG: tl.constexpr = D // G
    b = tl.load(c + tok[:, None] * NB + tl.arange(0, NB)[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    codes = _unpack(b, BITS, BLOCK_T, NB).to(tl.float32)
    if NG == 1:
        return codes * tl.load(s + tok, mask=tmask, other=0).to(tl.float32)[:, None] + \
            tl.load(z + tok, mask=tmask, other=0).to(tl.float32)[:, None]
    meta = tok[:, None] * NG + tl.arange(0, NG)[None, :]
    sc = tl.load(s + meta, mask=tmask[:, None], other=0).to(tl.float32)
    zr = tl.load(z + meta, mask=tmask[:, None], other=0).to(tl.float32)
    x = tl.reshape(codes, (BLOCK_T, NG, G)) * sc[:, :, None] + zr[:, :, None]
    return tl.reshape(x, (BLOCK_T, D))


@triton.jit
def _online(q, kt, v, tmask, m, l, acc, scaling, IEEE: tl.constexpr):
    """One tile of the online softmax: scores of the rep query heads against the tile's keys (given transposed,
    (D, tokens)), then its values (tokens, D)."""
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt.to(q.dtype))
    s = tl.where(tmask[None, :], s * scaling, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite after a program's first tile, which always holds a token
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(q_ptr, o_ptr, lse_ptr, kc, ks, kz, vc, vs, vz, dk, dv, H, T, ND, REP, SPLITS, TILES_PER_SPLIT,
                   scaling, FP8: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KCHANNEL: tl.constexpr,
                   VBITS: tl.constexpr, VG: tl.constexpr, VCHANNEL: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Programs (sequence × KV head, split): splits 0…SPLITS-1 walk the codes, TILES_PER_SPLIT tiles of BLOCK_T
    tokens each (a channel-axis tile is one group); the last one the ND dense tokens (sinks, residual, the new
    token). Each writes its softmax state (o, lse) for the rep query heads."""
    bh = tl.program_id(0).to(tl.int64)  # (sequence, KV head), int64 so long caches do not overflow offsets
    split = tl.program_id(1)
    h = bh % H
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    rmask = r < REP
    qrow = bh * REP + r  # query heads h*rep … h*rep+rep-1 of this sequence
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    out_scale = 1.0
    if split < SPLITS:
        score_scale = scaling
        if FP8:  # E4M3 codes are exact in the dot's dtype: the head's scales apply to scores and output
            score_scale = scaling * tl.load(ks + h)
            out_scale = tl.load(vs + h)
        first = split * TILES_PER_SPLIT
        last = tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(T, BLOCK_T))
        for tile in range(first, last):
            t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            tmask = t < T
            tok = bh * T + t
            if FP8:
                k = tl.load(kc + tok[:, None] * D + d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
                v = tl.load(vc + tok[:, None] * D + d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
                kt = tl.trans(k)
            else:
                if KCHANNEL:  # tiles are the key groups (BLOCK_T == KG)
                    kt = _channel_tile(kc, ks, kz, bh * tl.cdiv(T, KG) + tile, d, KBITS, KG, D)
                else:
                    kt = tl.trans(_token_tile(kc, ks, kz, tok, tmask, KBITS, KG, D, BLOCK_T))
                if VCHANNEL:
                    v = tl.trans(_channel_tile(vc, vs, vz, bh * tl.cdiv(T, VG) + tile, d, VBITS, VG, D))
                else:
                    v = _token_tile(vc, vs, vz, tok, tmask, VBITS, VG, D, BLOCK_T)
            m, l, acc = _online(q, kt, v, tmask, m, l, acc, score_scale, IEEE)
    else:
        for start in range(0, ND, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            tmask = t < ND
            off = (bh * ND + t)[:, None] * D + d[None, :]
            k = tl.load(dk + off, mask=tmask[:, None], other=0.0).to(tl.float32)
            v = tl.load(dv + off, mask=tmask[:, None], other=0.0).to(tl.float32)
            m, l, acc = _online(q, tl.trans(k), v, tmask, m, l, acc, scaling, IEEE)
    out = qrow * (SPLITS + 1) + split
    tl.store(o_ptr + out[:, None] * D + d[None, :], acc * (out_scale / l[:, None]), mask=rmask[:, None])
    tl.store(lse_ptr + out, m + tl.log(l), mask=rmask)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per (sequence, query head): the splits' states merged, weights exp(lse_i − logsumexp)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    smask = s < S
    lse = tl.load(lse_ptr + row * S + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    o = tl.load(o_ptr + (row * S + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * o, axis=0))


def attend(q: torch.Tensor, layer, fmt: str, dense_k: torch.Tensor, dense_v: torch.Tensor, scaling: float,
           splits: int | None = None, block_t: int | None = None, num_warps: int = 4,
           num_stages: int | None = None) -> torch.Tensor:
    """Attention output (B, H_q, D) float32 of q over the layer's codes and the dense tokens `dense_k`/`dense_v`
    (B, H, n ≥ 1, D): two launches. The codes are walked in tiles (a channel-axis group, else `block_t` tokens,
    by default 8192 / D between 32 and 128) split in `splits` parts (by default enough programs to keep every
    multiprocessor busy), with loads `num_stages` tiles ahead (3; 2 for float32 queries, whose tiles take twice
    the shared memory). Chosen from a sweep on an H200 (4 or 8 warps, 1 to 3 stages): 4 warps and 3 stages
    were fastest or within a few percent for every format at batch 8; FP8 at D = 128 ran 15% faster still with 128-token
    tiles (195 vs 228 µs at batch 8, 32K), untried for INT8, so the default tile stays at 64 there."""
    b, hq, d = q.shape
    h, t = dense_k.shape[1], layer.quantized
    rep = hq // h
    key, value = layer.stored["key"], layer.stored["value"]
    layout = {"KBITS": 8, "KG": d, "KCHANNEL": False, "VBITS": 8, "VG": d, "VCHANNEL": False}
    block_t = block_t or min(128, max(32, 8192 // d))
    num_stages = num_stages or (2 if q.dtype == torch.float32 else 3)
    if not t:  # nothing quantized yet: the dense program alone (the code pointers are never read)
        tensors = (dense_k,) * 6
    elif fmt == "fp8":
        tensors = (key["codes"].view(torch.float8_e4m3fn), layer.spec.key.head_scales(h, q.device), key["codes"],
                   value["codes"].view(torch.float8_e4m3fn), layer.spec.value.head_scales(h, q.device), value["codes"])
    else:
        tensors = (key["codes"], key["scale"], key["zero"], value["codes"], value["scale"], value["zero"])
        for tag, codec in (("K", layer.spec.key), ("V", layer.spec.value)):
            channel = codec.axis == "channel"
            layout |= {f"{tag}BITS": codec.bits, f"{tag}G": codec.group if channel else min(codec.group, d), f"{tag}CHANNEL": channel}
            if channel:
                block_t = codec.group  # one group per tile (supported() refuses two channel-axis codecs with other groups)
    tiles = triton.cdiv(t, block_t)
    wanted = splits or max(1, _PROGRAMS_PER_SM * _multiprocessors(q.device) // (b * h))
    per_split = triton.cdiv(tiles, min(tiles, wanted)) if tiles else 0
    if not splits and tiles:
        per_split = max(per_split, min(tiles, _MIN_TILES_PER_SPLIT))
    n_splits = triton.cdiv(tiles, per_split) if tiles else 0  # every split starts inside the T tokens
    o = torch.empty(b, hq, n_splits + 1, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, n_splits + 1, dtype=torch.float32, device=q.device)
    _decode_kernel[(b * h, n_splits + 1)](
        q.contiguous(), o, lse, *(x.contiguous() for x in tensors), dense_k.contiguous(), dense_v.contiguous(), h, t,
        dense_k.shape[2], rep, n_splits, per_split, float(scaling), FP8=fmt == "fp8" and bool(t), **layout,
        IEEE=q.dtype == torch.float32, BLOCK_R=max(16, triton.next_power_of_2(rep)), BLOCK_T=block_t, D=d,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    _combine_kernel[(b * hq,)](o, lse, out, n_splits + 1, D=d, BLOCK_S=max(2, triton.next_power_of_2(n_splits + 1)))
    return out
