"""Feeding a quantized cache layer several tokens at once, read exactly as if they came one at a time.

Decoding (and the teacher-forced pass that measures KL) feeds a quantized layer one token per step: each step
attends to the sinks, the dequantized codes, the full-precision residual and its own token, then appends the
token, and the layer's policy quantizes what it quantizes (keys and values each on their own schedule under
KIVI's policy). So whether a query reads a token's key, and its value, dequantized depends on the step. For a
known sequence of n tokens (teacher forcing) the same reads can be made in one pass. The tokens whose key and
value are both in codes before the first step are read as they are by every query; every later token (the
"region": the rest of what is held, then the n new ones) can be read in up to four ways, its key and its value
each in full precision or dequantized, and the keys are laid out once as

    [sinks | codes of both, held before | for each way, in turn, the region tokens some query reads that way]

with query i attending to a token's entry of the way step i reads it, once the token has come (no later than
step i). A token's dequantized key (or value) is the same whenever it was quantized, so each way's entries are
taken from the layer's view before the append (what was in full precision then) or after it (what is in codes
then). The codes are those the n single steps write (each group quantized from the same tokens: codecs work
per group or per token), so the layer ends in the same state. transformers' cache API has no such view, and
KIVI's code streams token by token, hence this module. Only layers whose sinks are complete qualify (sinks
fill during the prefill).
"""

from __future__ import annotations

import torch

from kvlab.kernels.kvcache import QuantizedKVLayer
from kvlab.kernels.layer import KVLayer


def streamable(layer) -> bool:
    """Whether `layer` can take several tokens in one pass as if one at a time (see the module docstring): a
    quantized layer with its sinks complete, or a kvlab layer that says so (`KVLayer.streams`)."""
    if not isinstance(layer, QuantizedKVLayer):
        return isinstance(layer, KVLayer) and layer.streams
    if not layer.is_initialized:
        return False
    held = 0 if layer.sink_keys is None else layer.sink_keys.shape[-2]
    return held >= layer.spec.sink_tokens


def flush_steps(layer: QuantizedKVLayer, n: int) -> tuple[list[int], list[int]]:
    """For n tokens fed one at a time: per tensor (keys, values), the step (0…n-1) after whose append each of its
    full-precision tokens (those held now, then the new ones) is quantized, for as many of them as get quantized."""
    keys, values, steps = layer.keys.shape[-2], layer.values.shape[-2], ([], [])
    for i in range(n):
        _, k, v = layer._plan(keys + 1, values + 1)  # the layer's own rule
        steps[0].extend([i] * k)
        steps[1].extend([i] * v)
        keys, values = keys + 1 - k, values + 1 - v
    return steps


WAYS = ((False, False), (True, False), (False, True), (True, True))  # (key dequantized, value dequantized)


_LAYOUTS: dict = {}  # `_layout` by schedule and counts: a row's layers mostly share both (one layout, not 24), and a
                   # batch's mask and update ask for the same one


def _layout(layer: QuantizedKVLayer, n: int) -> tuple[int, list[tuple[bool, bool, torch.Tensor, torch.Tensor]]]:
    """Where the keys `stream_update` returns come from: the leading entries read alike by every query, then per
    way of reading a region token (`WAYS`) that some query uses: (key dequantized, value dequantized, the region
    tokens read that way, (n, tokens) which query reads each so). On the host: a few small tensors, never written
    (they are shared by every layer of the same spec and counts)."""
    sinks = 0 if layer.sink_keys is None else layer.sink_keys.shape[-2]
    key = (layer.spec.schedule(), n, layer.coded, layer.keys.shape[-2], layer.values.shape[-2], sinks)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 4096:
            _LAYOUTS.clear()
        _LAYOUTS[key] = _plan_layout(layer, n)
    return _LAYOUTS[key]


def _plan_layout(layer: QuantizedKVLayer, n: int) -> tuple[int, list[tuple[bool, bool, torch.Tensor, torch.Tensor]]]:
    """`_layout`, computed."""
    coded_keys, coded_values = layer.coded
    both = min(coded_keys, coded_values)
    held = coded_keys + layer.keys.shape[-2] - both  # region tokens held now (as many for values)
    width = held + n
    i = torch.arange(n)[:, None]
    u = torch.arange(width)[None, :]
    arrived = (u < held) | (u - held <= i)

    def dequantized(coded: int, steps: list[int]) -> torch.Tensor:
        at = torch.full((width,), n)  # n: still full precision after these steps
        lead = coded - both
        at[:lead] = -1  # in codes already
        at[lead : lead + len(steps)] = torch.tensor(steps, dtype=torch.long)
        return at[None, :] < i  # step i reads it dequantized once an earlier step quantized it

    key_steps, value_steps = flush_steps(layer, n)
    read_k, read_v = dequantized(coded_keys, key_steps), dequantized(coded_values, value_steps)
    ways = []
    for dk, dv in WAYS:
        seen = arrived & (read_k == dk) & (read_v == dv)
        tokens = seen.any(0).nonzero().flatten()
        if tokens.numel():
            ways.append((dk, dv, tokens, seen[:, tokens]))
    sinks = 0 if layer.sink_keys is None else layer.sink_keys.shape[-2]
    return sinks + both, ways


def visibility(layer, n: int, device) -> torch.Tensor:
    """(n, width) bool: which entries of `stream_update`'s keys query i (the i-th new token) attends to. For a
    dense layer: its held tokens and the new ones causally."""
    if not isinstance(layer, QuantizedKVLayer):
        held = layer.keys.shape[-2]
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(held + n, device=device)[None, :]
        return j <= held + i
    fixed, ways = _layout(layer, n)
    return torch.cat([torch.ones(n, fixed, dtype=torch.bool), *(seen for *_, seen in ways)], dim=1).to(device)


def stream_update(layer: QuantizedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
    """Append the new tokens as the single steps would, and return the keys and values `visibility` indexes:
    the leading entries of the view before the append, then each way's region tokens, from the view before the
    append (full precision then) or after it (in codes then)."""
    fixed, ways = _layout(layer, key_states.shape[-2])
    keys, values = layer.full(key_states, value_states)
    plain = len(ways) == 1 and not any(ways[0][:2]) and ways[0][2].numel() == keys.shape[-2] - fixed
    if not plain:  # `after` below rewrites the layer's view in place: keep the one before the append
        keys, values = keys.clone(), values.clone()
    layer.append(key_states, value_states, cache_kwargs)
    if plain:
        return keys, values  # nothing read dequantized beyond the leading entries: the view as it was
    after = layer.full()
    parts_k, parts_v = [keys[..., :fixed, :]], [values[..., :fixed, :]]
    for dk, dv, tokens, _ in ways:
        index = (tokens + fixed).to(keys.device)
        parts_k.append((after[0] if dk else keys).index_select(-2, index))
        parts_v.append((after[1] if dv else values).index_select(-2, index))
    return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)
