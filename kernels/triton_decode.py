"""Triton flash-decoding over packed KV codes: the code segment of ``kvlab.kernels.decode_attention`` (read that
module for the formats and the merge), computed without writing the dequantized cache anywhere.

One program per (sequence, KV head, split of the token axis) serves all ``rep`` query heads of its KV head
(GQA: the codes are read once for the group). It walks its tokens one tile at a time and keeps an online
softmax (running max, sum, weighted values). Tiles are read in their storage layout as 32-bit words, so every
load is a contiguous run, and unpacked without moving codes between threads: each word's codes are shifted
out onto an axis of their own, and that axis is merged into the tile's token or channel axis. A tile's tokens
and channels are therefore permuted, never shuffled back; the softmax does not depend on token order, keys
and values are read in the same order, the query is read in the keys' channel order and the output written
in the values' (``_order``):
  - channel-axis codes (KIVI keys): a tile is BLOCK_T / G whole groups, each stored as (D channels × G·bits/32
    words); unpacked, they are the transposed (D, tokens) keys the score product needs, and each group's fp16
    scale and zero point per channel apply to its columns;
  - token-axis codes (KIVI values, per-token INT8): each token's D·bits/32 words, unpacked to (tokens, D),
    each run of g channels scaled by its own scale and zero point;
  - FP8 E4M3: each token's D/4 words, their bytes converted by the hardware (E4M3 values are exact in fp16 and
    fp32); the per-head scales multiply the scores and the output, not every element.
One more program per (sequence, KV head) attends to the full-precision tokens (sinks, residual, the new one);
every program writes its (o, lse), and a second small kernel merges them: two launches per layer and step.

Over the codes, 16-bit queries (bf16 or fp16 models) use fp16 dots with float32 accumulation: a code becomes
fp16 without an int→float conversion (``_to_dot``), dequantizes with fp16 scales and zero points in fp16
(the precision they are stored in; bf16 would round to 8 bits), and the softmax weights are fp16 (11 bits). A
query is scaled by a power of two into fp16's range first. The dense segment's dots run in the query's dtype.
Float32 queries use exact ("ieee") float32 dots throughout, which is what the tests compare against the torch
reference.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

_PROGRAMS_PER_SM = 4  # programs per multiprocessor where none is compiled (Triton's CPU interpreter)
_MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in its (o, lse) and merge than it saves
# Tokens per tile of the dense segment (sinks, residual, new token: tens to a few hundred). Small, so that its
# full-precision tiles do not set the kernel's shared memory, which every program reserves.
_BLOCK_DENSE = 32
_LOG2E = math.log2(math.e)  # the launch scales scores by it: the kernel's softmax runs in base 2
_LN2 = tl.constexpr(math.log(2.0))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


_RESIDENT: dict[tuple, int] = {}  # programs per multiprocessor, by compiled variant


def _resident(compiled, device: torch.device) -> int:
    """How many programs of a compiled kernel fit on one multiprocessor at once: its registers (allocated per
    warp in units of 256), shared memory (plus the 1 KB the driver reserves per block) and threads. Splits are
    sized to this, so that the launch is one full wave: a fixed guess above it leaves a tail wave (at 4 per
    multiprocessor, a program of 141 registers or 72 KB of shared memory fits only 3 on an H100)."""
    props = torch.cuda.get_device_properties(device)
    compiled._init_handles()  # loads the binary, which sets n_regs
    warps = compiled.metadata.num_warps
    per_warp = -(-compiled.n_regs * 32 // 256) * 256
    # (defaults: an H100's, for a torch whose device properties lack the field)
    fits = [getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps),
            getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps), 32]
    if compiled.metadata.shared:
        fits.append(getattr(props, "shared_memory_per_multiprocessor", 233472) // (compiled.metadata.shared + 1024))
    return max(1, min(fits))


@triton.jit
def _to_dot(code, DT: tl.constexpr):
    """Integer codes (any shape, int32, 0 … 255) in the dot's dtype, exactly. For fp16 without an int→float
    conversion: the code's bits ORed into the mantissa of 1024.0 (0x6400) give 1024 + code, minus 1024."""
    if DT == tl.float16:
        return (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    return code.to(DT)


@triton.jit
def _channel_tile(c, s, z, grp, gmask, d, BITS: tl.constexpr, G: tl.constexpr, NGRP: tl.constexpr, D: tl.constexpr,
                  DT: tl.constexpr):
    """(D, NGRP·G) in DT: NGRP groups of G tokens of channel-axis codes (rows (group, channel) of G·bits/32
    32-bit words; ``grp`` the first group's row block: sequence × head × token group; ``gmask`` the groups that
    exist), dequantized. Column (group i, shift k, word j) is token i·G + j·32/bits + k: each word's codes are
    shifted out onto an axis of their own (k), so no code moves between threads."""
    PER: tl.constexpr = 32 // BITS
    NW: tl.constexpr = G // PER
    row = (grp + tl.arange(0, NGRP))[None, :] * D + d[:, None]  # (D, NGRP)
    rmask = gmask[None, :]
    w = tl.load(c.to(tl.pointer_type(tl.int32)) + row[:, :, None, None] * NW + tl.arange(0, NW)[None, None, None, :],
                mask=rmask[:, :, None, None], other=0)
    code = (w >> (tl.arange(0, PER) * BITS)[None, None, :, None]) & ((1 << BITS) - 1)  # (D, NGRP, PER, NW)
    sc = tl.load(s + row, mask=rmask, other=0).to(DT)[:, :, None, None]
    zr = tl.load(z + row, mask=rmask, other=0).to(DT)[:, :, None, None]
    return tl.reshape(_to_dot(code, DT) * sc + zr, (D, NGRP * G))


@triton.jit
def _token_tile(c, s, z, tok, tmask, BITS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                DT: tl.constexpr):
    """(BLOCK_T, D) in DT: tokens ``tok`` (row indices sequence × head × token) of token-axis codes, each token's
    D·bits/32 32-bit words in a row, one scale and zero point per run of G channels, dequantized. Column
    (shift k, group i, word j) is channel i·G + j·32/bits + k."""
    PER: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // G
    NW: tl.constexpr = G // PER
    meta = tok[:, None] * NG + tl.arange(0, NG)[None, :]  # (BLOCK_T, NG)
    w = tl.load(c.to(tl.pointer_type(tl.int32)) + meta[:, None, :, None] * NW + tl.arange(0, NW)[None, None, None, :],
                mask=tmask[:, None, None, None], other=0)
    code = (w >> (tl.arange(0, PER) * BITS)[None, :, None, None]) & ((1 << BITS) - 1)  # (BLOCK_T, PER, NG, NW)
    sc = tl.load(s + meta, mask=tmask[:, None], other=0).to(DT)[:, None, :, None]
    zr = tl.load(z + meta, mask=tmask[:, None], other=0).to(DT)[:, None, :, None]
    return tl.reshape(_to_dot(code, DT) * sc + zr, (BLOCK_T, D))


@triton.jit
def _fp8_tile(c, tok, tmask, D: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr):
    """(BLOCK_T, D) in DT: E4M3 codes of tokens ``tok`` read as 32-bit words, column (shift k, word j) is channel
    4·j + k."""
    w = tl.load(c.to(tl.pointer_type(tl.int32)) + tok[:, None, None] * (D // 4) + tl.arange(0, D // 4)[None, None, :],
                mask=tmask[:, None, None], other=0)
    code = ((w >> (tl.arange(0, 4) * 8)[None, :, None]) & 255).to(tl.uint8)  # (BLOCK_T, 4, D/4)
    return tl.reshape(code.to(tl.float8e4nv, bitcast=True).to(DT), (BLOCK_T, D))


@triton.jit
def _order(A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr):
    """(A·B·C,) int32: a·SA + b·SB + c·SC over (a, b, c) in row-major order: where a tile's columns come from."""
    a = tl.arange(0, A)[:, None, None] * SA
    b = tl.arange(0, B)[None, :, None] * SB
    return tl.reshape(a + b + tl.arange(0, C)[None, None, :] * SC, (A * B * C,))


@triton.jit
def _online(q, kt, v, tmask, m, denom, acc, scaling, IEEE: tl.constexpr):
    """One tile of the online softmax: scores of the rep query heads against the tile's keys (given transposed,
    (D, tokens)), then its values (tokens, D); q, kt and v in the dot's dtype. Scores are in base 2: `scaling`
    includes log2(e), so each weight is one exp2 (what tl.exp does after a multiply)."""
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(tmask[None, :], s * scaling, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite after a program's first tile, which always holds a token
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, denom * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


# Sizes that change from step to step are not specialized on (a value of 1 or a multiple of 16 would compile
# another variant, possibly in the middle of a CUDA graph capture); the loads' alignment comes from the rows'
# widths, which are compile-time constants.
@triton.jit(do_not_specialize=["T", "TK", "TV", "ND", "SPLITS", "TILES_PER_SPLIT"])
def _decode_kernel(q_ptr, o_ptr, lse_ptr, kc, ks, kz, vc, vs, vz, dk, dv, H, T, TK, TV, ND, REP, SPLITS, TILES_PER_SPLIT,
                   scaling, FP8: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KCHANNEL: tl.constexpr,
                   VBITS: tl.constexpr, VG: tl.constexpr, VCHANNEL: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DENSE: tl.constexpr, D: tl.constexpr):
    """Programs (sequence × KV head, split): splits 0…SPLITS-1 walk the codes, TILES_PER_SPLIT tiles of BLOCK_T
    tokens each (a channel-axis tile is BLOCK_T / G whole groups) of the first T coded tokens, out of TK key and
    TV value codes per sequence and head (KIVI's policy codes more keys than values, or the other way round: the
    rest are dense tokens); the last one the ND dense tokens (sinks, codes beyond T dequantized, residual, the new
    token). Each writes its softmax state (o, lse) for the rep query heads."""
    bh = tl.program_id(0).to(tl.int64)  # (sequence, KV head), int64 so long caches do not overflow offsets
    split = tl.program_id(1)
    h = bh % H
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    rmask = r < REP
    qrow = bh * REP + r  # query heads h*rep … h*rep+rep-1 of this sequence
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    if split < SPLITS:
        DT: tl.constexpr = tl.float32 if IEEE else tl.float16
        # Where the tile's key columns (the score product's inner axis) and value columns come from, and which
        # tokens its rows are: see _channel_tile and _token_tile.
        if KCHANNEL:
            kcol = d
        else:
            kcol = _order(32 // KBITS, D // KG, KG * KBITS // 32, 1, KG, 32 // KBITS)
        if VCHANNEL:
            vcol = d
        else:
            vcol = _order(32 // VBITS, D // VG, VG * VBITS // 32, 1, VG, 32 // VBITS)
        if KCHANNEL:
            order = _order(BLOCK_T // KG, 32 // KBITS, KG * KBITS // 32, KG, 1, 32 // KBITS)
        elif VCHANNEL:
            order = _order(BLOCK_T // VG, 32 // VBITS, VG * VBITS // 32, VG, 1, 32 // VBITS)
        else:
            order = tl.arange(0, BLOCK_T)
        qf = tl.load(q_ptr + qrow[:, None] * D + kcol[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        score_scale = scaling
        out_scale = 1.0
        if not IEEE:  # fp16 dots: q scaled by a power of two into fp16's range (bf16 queries may exceed it)
            top = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
            q_scale = tl.exp2(tl.minimum(0.0, 14.0 - tl.ceil(tl.log2(top))))
            qf = qf * q_scale
            score_scale = scaling / q_scale
        qc = qf.to(DT)
        if FP8:  # E4M3 codes are exact in the dot's dtype: the head's scales apply to scores and output
            score_scale = score_scale * tl.load(ks + h)
            out_scale = tl.load(vs + h)
        first = split * TILES_PER_SPLIT
        last = tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(T, BLOCK_T))
        for tile in range(first, last):
            t = tile * BLOCK_T + order
            tmask = t < T
            tok_k = bh * TK + t
            tok_v = bh * TV + t
            if FP8:
                kt = tl.trans(_fp8_tile(kc, tok_k, tmask, D, BLOCK_T, DT))
                v = _fp8_tile(vc, tok_v, tmask, D, BLOCK_T, DT)
            else:
                if KCHANNEL:
                    grp = tile * (BLOCK_T // KG) + tl.arange(0, BLOCK_T // KG)
                    kt = _channel_tile(kc, ks, kz, bh * tl.cdiv(TK, KG) + tile * (BLOCK_T // KG), grp < tl.cdiv(T, KG),
                                       d, KBITS, KG, BLOCK_T // KG, D, DT)
                else:
                    kt = tl.trans(_token_tile(kc, ks, kz, tok_k, tmask, KBITS, KG, D, BLOCK_T, DT))
                if VCHANNEL:
                    grp = tile * (BLOCK_T // VG) + tl.arange(0, BLOCK_T // VG)
                    v = tl.trans(_channel_tile(vc, vs, vz, bh * tl.cdiv(TV, VG) + tile * (BLOCK_T // VG),
                                               grp < tl.cdiv(T, VG), d, VBITS, VG, BLOCK_T // VG, D, DT))
                else:
                    v = _token_tile(vc, vs, vz, tok_v, tmask, VBITS, VG, D, BLOCK_T, DT)
            m, denom, acc = _online(qc, kt, v, tmask, m, denom, acc, score_scale, IEEE)
        out = qrow * (SPLITS + 1) + split
        tl.store(o_ptr + out[:, None] * D + vcol[None, :], acc * (out_scale / denom[:, None]), mask=rmask[:, None])
    else:
        qd = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
        for start in range(0, ND, BLOCK_DENSE):
            t = start + tl.arange(0, BLOCK_DENSE)
            tmask = t < ND
            off = (bh * ND + t)[:, None] * D + d[None, :]
            k = tl.load(dk + off, mask=tmask[:, None], other=0.0)
            v = tl.load(dv + off, mask=tmask[:, None], other=0.0)
            m, denom, acc = _online(qd, tl.trans(k), v, tmask, m, denom, acc, scaling, IEEE)
        out = qrow * (SPLITS + 1) + split
        tl.store(o_ptr + out[:, None] * D + d[None, :], acc / denom[:, None], mask=rmask[:, None])
    tl.store(lse_ptr + out, (m + tl.log2(denom)) * _LN2, mask=rmask)  # natural log-sum-exp, as the merge reads it


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


def _programs_per_sm(pointers: tuple, h: int, t: int, coded: tuple[int, int], nd: int, rep: int, meta: dict) -> int:
    """Programs per multiprocessor for this variant of the kernel: compiled (not run) once per variant on CUDA."""
    q = pointers[0]
    if not q.is_cuda:
        return _PROGRAMS_PER_SM
    key = (q.device, q.dtype, tuple(x.dtype for x in pointers), tuple(sorted(meta.items())))
    if key not in _RESIDENT:
        scratch = torch.empty(1, dtype=torch.float32, device=q.device)  # o and lse: only their dtype matters here
        compiled = _decode_kernel.warmup(q, scratch, scratch, *pointers[1:], h, t, *coded, nd, rep, 2, 2, 1.0, grid=(1,),
                                         **meta)
        _RESIDENT[key] = _resident(compiled, q.device)
    return _RESIDENT[key]


def arguments(q: torch.Tensor, layer, fmt: str, dense_k: torch.Tensor, dense_v: torch.Tensor,
              block_t: int | None = None, num_warps: int = 4, num_stages: int | None = None):
    """What the kernel is launched with for this layer and query, but the outputs and splits: the tensors it reads
    (q, the six code tensors, the dense keys and values), the sizes (KV heads, tokens read from codes, key and
    value codes per sequence and head, dense tokens, query heads per KV head) and the compile-time parameters
    (``attend`` documents them). The codes read are the tokens whose key and value are both coded
    (``layer.quantized``); ``dense_k``/``dense_v`` hold every token after them."""
    if block_t is not None and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t is the tokens of a tile: a power of two from 16, got {block_t}")
    d = q.shape[-1]
    h, t = dense_k.shape[1], layer.quantized
    rep = q.shape[1] // h
    key, value = layer.stored["key"], layer.stored["value"]
    layout = {"KBITS": 8, "KG": d, "KCHANNEL": False, "VBITS": 8, "VG": d, "VCHANNEL": False}
    block_t = block_t or min(128, max(32, 8192 // d))
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
            if channel:  # whole groups per tile (supported() refuses two channel-axis codecs with other groups)
                block_t = max(block_t, codec.group)
    meta = dict(FP8=fmt == "fp8" and bool(t), **layout, IEEE=q.dtype == torch.float32,
                BLOCK_R=max(16, triton.next_power_of_2(rep)), BLOCK_T=block_t, BLOCK_DENSE=_BLOCK_DENSE, D=d,
                num_warps=num_warps, num_stages=num_stages or (2 if q.dtype == torch.float32 else 3))
    pointers = (q.contiguous(), *(x.contiguous() for x in tensors), dense_k.contiguous(), dense_v.contiguous())
    return pointers, (h, t, layer.coded, dense_k.shape[2], rep), meta


def attend(q: torch.Tensor, layer, fmt: str, dense_k: torch.Tensor, dense_v: torch.Tensor, scaling: float,
           splits: int | None = None, block_t: int | None = None, num_warps: int = 4,
           num_stages: int | None = None) -> torch.Tensor:
    """Attention output (B, H_q, D) float32 of q over the layer's codes and the dense tokens `dense_k`/`dense_v`
    (B, H, n ≥ 1, D): two launches. The codes are walked in tiles of `block_t` tokens (a power of two ≥ 16; by
    default 8192 / D between 32 and 128; at least one channel-axis group) split in `splits` parts (by default
    as many programs as fit on the device at once, see ``_resident``), with loads `num_stages` tiles ahead (3;
    2 for float32 queries, whose tiles take twice the shared memory). 4 warps and 3 stages were fastest or
    within a few percent for every format in a sweep on an H200 (4 or 8 warps, 1 to 3 stages, batch 8) of the
    previous version of this kernel, which read one key group per tile."""
    pointers, (h, t, coded, nd, rep), meta = arguments(q, layer, fmt, dense_k, dense_v, block_t, num_warps, num_stages)
    b, hq, d = q.shape
    block_t = meta["BLOCK_T"]
    tiles = triton.cdiv(t, block_t)
    per_split = n_splits = 0
    if tiles:
        wanted = splits or max(1, _programs_per_sm(pointers, h, t, coded, nd, rep, meta)
                               * _multiprocessors(q.device) // (b * h) - 1)  # one wave, with the dense programs
        per_split = triton.cdiv(tiles, min(tiles, wanted))
        if not splits:
            per_split = max(per_split, min(tiles, _MIN_TILES_PER_SPLIT))
        n_splits = triton.cdiv(tiles, per_split)  # every split starts inside the T tokens
    o = torch.empty(b, hq, n_splits + 1, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, n_splits + 1, dtype=torch.float32, device=q.device)
    _decode_kernel[(b * h, n_splits + 1)](pointers[0], o, lse, *pointers[1:], h, t, *coded, nd, rep, n_splits, per_split,
                                          float(scaling) * _LOG2E, **meta)
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    _combine_kernel[(b * hq,)](o, lse, out, n_splits + 1, D=d, BLOCK_S=max(2, triton.next_power_of_2(n_splits + 1)))
    return out
