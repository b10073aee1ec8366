"""Bytes one real quantized cache layer stores (``kvlab.kernels.kvcache``), per tensor: codes packed per head,
their group metadata and sparse outliers, and the dense residual and sink tokens, in exact integers. The
accounting model (``kvlab.kernels.accounting``) prices its KIVI-style schemes with the same functions; the
methods describe their layers with :class:`TensorCodes` (``MethodKind.layouts``)."""

from __future__ import annotations

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TensorCodes:
    """How a real cache stores one tensor (keys or values) of one layer, for :func:`stored_layer_bytes`.

    ``grouping`` says where the metadata goes: ``channel`` (one fp16 scale + fp16 zero per channel per
    ``group`` tokens, KIVI keys), ``token`` (per token per ``min(group, head_dim)`` channels, KIVI values and
    per-token INT8), ``static`` (scales fixed by calibration: model constants, 0 bytes in the cache) or
    ``tensor`` (one fp32 scale per layer, set at prefill). ``outliers`` sparse entries per vector cost 3 bytes
    each (fp16 value + uint8 channel index).
    """

    bits: int
    grouping: str
    group: int = 0
    meta_bytes: int = 4
    outliers: int = 0


def tensor_code_bytes(codes: TensorCodes, kv_heads: int, head_dim: int, tokens: int) -> int:
    """Exact bytes of ``tokens`` quantized tokens of one tensor of one layer (codes packed per head)."""
    n, d = tokens, head_dim
    total = kv_heads * ceil_div(n * d * codes.bits, 8) + kv_heads * n * codes.outliers * 3
    if codes.grouping == "channel":
        total += kv_heads * d * ceil_div(n, codes.group) * codes.meta_bytes
    elif codes.grouping == "token":
        total += kv_heads * n * ceil_div(d, min(codes.group, d)) * codes.meta_bytes
    elif codes.grouping == "tensor":
        total += 4
    elif codes.grouping != "static":
        raise ValueError(f"grouping must be channel, token, static or tensor, got {codes.grouping!r}")
    return total


POLICIES = ("kivi", "together")
"""How a quantized layer streams tokens into codes (:func:`coded_tokens`)."""


def kivi_residual_problem(residual: int, group: int) -> str | None:
    """Why KIVI's policy cannot flush per-channel codes in groups of `group` tokens with this residual, or None."""
    if residual <= 0 or residual % group:
        return (f"policy kivi quantizes per-channel codes R tokens at a time, in whole groups: residual must be a "
                f"positive multiple of group {group}, got {residual}")
    return None


def coded_tokens(policy: str, per_channel: bool, held: int, residual: int, group: int) -> int:
    """Of ``held`` tokens of one tensor not in sinks (codes and full precision together), how many a layer
    stores as codes; the rest are its newest, in full precision.

    - ``kivi`` (KIVI's own cache, jy-yuan/KIVI ``models/llama_kivi.py``): a tensor quantized per channel over
      groups of tokens (keys) quantizes its full-precision tokens all at once whenever they reach ``residual``
      (a multiple of the group), so 0 to residual − 1 of them stay; a per-token tensor (values) quantizes its
      oldest full-precision token whenever more than ``residual`` are held, so min(held, residual) stay.
    - ``together`` (kvlab's earlier policy, kept as an option): keys and values move together, every complete
      ``group`` beyond the newest ``residual`` tokens is quantized, so residual to residual + group − 1 stay.
    """
    if policy == "together":
        return max(0, (held - residual) // group * group)
    if policy != "kivi":
        raise ValueError(f"quantized cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if per_channel:
        if problem := kivi_residual_problem(residual, group):
            raise ValueError(problem)
        return held // residual * residual
    return max(0, held - residual)


def stored_layer_bytes(key: TensorCodes, value: TensorCodes, kv_heads: int, head_dim: int, quantized: tuple[int, int],
                       dense: tuple[int, int], dense_bytes: int) -> int:
    """Bytes one quantized cache layer stores: ``quantized`` (keys, values) tokens as codes, ``dense`` (keys, values)
    tokens (residual window and sinks) at ``dense_bytes`` per element."""
    return (tensor_code_bytes(key, kv_heads, head_dim, quantized[0]) + tensor_code_bytes(value, kv_heads, head_dim, quantized[1])
            + sum(dense) * kv_heads * head_dim * dense_bytes)
