"""Feeding a quantized cache layer several tokens at once, read exactly as if they came one at a time.

Decoding (and the teacher-forced pass that measures KL) feeds a quantized layer one token per step: each step
attends to the sinks, the dequantized codes, the full-precision residual and its own token, then appends the
token, and whenever the residual holds ``residual + group`` tokens its oldest group is quantized. So which
tokens a query sees quantized depends on the step. For a known sequence of n tokens (teacher forcing) the
same reads can be made in one pass: the keys are laid out once as

    [sinks | codes held before | residual held before, then the n new tokens (full precision) | every token
     the n steps quantize, dequantized]

and query i sees a full-precision token if it came no later than step i and was not quantized before step i,
and the dequantized copy of a token quantized after an earlier step. The codes are those the n single steps
write (each group quantized from the same tokens: codecs work per group or per token), so the layer ends in
the same state. transformers' cache API has no such view, and KIVI's code streams token by token, hence this
module. Only layers whose sinks are complete qualify (sinks fill during the prefill).
"""

from __future__ import annotations

import torch

from kvlab.kernels.kvcache import QuantizedKVLayer


def streamable(layer) -> bool:
    """Whether `layer` can take several tokens in one pass as if one at a time (see the module docstring)."""
    if not isinstance(layer, QuantizedKVLayer) or not layer.is_initialized:
        return False
    held = 0 if layer.sink_keys is None else layer.sink_keys.shape[-2]
    return held >= layer.spec.sink_tokens


def flush_steps(layer: QuantizedKVLayer, n: int) -> list[int]:
    """For n tokens fed one at a time: the step (0…n-1) after whose append each token of the full-precision
    region (the residual held now, then the new tokens) is quantized, for as many of them as get quantized."""
    residual, steps = layer.keys.shape[-2], []
    for i in range(n):
        residual += 1
        _, quantized = layer._plan(residual)  # the layer's own rule: every complete group beyond the residual
        steps += [i] * quantized
        residual -= quantized
    return steps


def visibility(layer, n: int, device) -> torch.Tensor:
    """(n, width) bool: which entries of `stream_update`'s keys query i (the i-th new token) attends to. For a
    dense layer: its held tokens and the new ones causally."""
    held = layer.get_seq_length() if isinstance(layer, QuantizedKVLayer) else layer.keys.shape[-2]
    i = torch.arange(n, device=device)[:, None]
    if not isinstance(layer, QuantizedKVLayer):
        j = torch.arange(held + n, device=device)[None, :]
        return j <= held + i
    residual = layer.keys.shape[-2]
    fixed = held - residual  # sinks and codes: seen by every query as they are
    steps = torch.tensor(flush_steps(layer, n), dtype=torch.long, device=device)
    region = torch.full((residual + n,), n, dtype=torch.long, device=device)  # n: not quantized within these steps
    region[: steps.numel()] = steps
    u = torch.arange(residual + n, device=device)[None, :]
    full_precision = ((u < residual) | (u - residual <= i)) & ~(region[None, :] < i)
    return torch.cat([torch.ones(n, fixed, dtype=torch.bool, device=device), full_precision, steps[None, :] < i], dim=1)


def stream_update(layer: QuantizedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
    """Append the new tokens as the single steps would, and return the keys and values `visibility` indexes:
    the view before the append (sinks, codes, residual), the new tokens, and every token the append quantized,
    dequantized."""
    before = layer.quantized
    keys, values = layer.full(key_states, value_states) if layer.is_initialized else (key_states, value_states)
    layer.append(key_states, value_states, cache_kwargs)
    if layer.quantized == before:
        return keys, values
    dk, dv = layer._dequantized()
    return torch.cat([keys, dk[..., before:, :]], dim=-2), torch.cat([values, dv[..., before:, :]], dim=-2)
