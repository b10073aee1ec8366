"""Quantized KV cache layers on transformers' Cache API.

A :class:`QuantizedKVLayer` stores, per layer and in sequence order:
  1. ``sinks``: the first ``sink_tokens`` tokens in full precision (KVQuant's attention-sink option);
  2. the quantized part: packed codes plus their metadata (scales, zero points, sparse outliers) only;
  3. the residual: the newest tokens in full precision, between ``residual`` and ``residual + group - 1``
     of them (``self.keys`` / ``self.values``, as in transformers' DynamicLayer).
Streaming (KIVI): new tokens enter the residual; whenever it holds ``residual + group`` tokens, its oldest
``group`` tokens are quantized as one complete group and appended to the codes. Codes are written once and
never dequantized-and-requantized. A prefilled cache is split the same way in one step: every complete
group beyond the last ``residual`` tokens is quantized, the rest stays in the residual.

``update`` returns the full-precision view for attention: the dequantized codes, the residual and the new
tokens unquantized — so the tokens of a prefill chunk attend to each other exactly, as in KIVI, and a decoded
token is quantized only once it leaves the residual window.

The codecs, one per tensor, are in ``kvlab.kernels.codecs``. Code storage grows along the token axis, so one
decode call covers it all.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvlab.kernels import quant
from kvlab.kernels.codecs import AffineCodec


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


# --------------------------------------------------------------------------- #
# The layer
# --------------------------------------------------------------------------- #


@dataclass
class LayerSpec:
    """How one layer stores its cache: codecs per tensor, the flush unit, the residual and sink counts."""

    key: Any
    value: Any
    group: int  # tokens quantized at once (a complete key group); 1 for per-token schemes
    residual: int  # newest tokens always kept in full precision
    sink_tokens: int = 0  # first tokens always kept in full precision
    rope: bool = False  # the key codec needs each token's RoPE tables (pre-RoPE quantization)


class QuantizedKVLayer(DynamicLayer):
    """A cache layer holding sinks + packed codes + a full-precision residual (see the module docstring)."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.sink_keys = self.sink_values = None
        self.stored: dict[str, dict[str, torch.Tensor]] = {"key": {}, "value": {}}
        self.quantized = 0  # tokens in codes
        # () float32 on the device: the sum of the one-token appends since the last read, NaN/Inf iff they held one
        self._unread_nonfinite: torch.Tensor | None = None
        self.cumulative_length = 0
        # RoPE tables of the tokens held (pre-RoPE codecs only): a function of position, like a model's
        # rotary cache, kept beside the cache and not counted as KV bytes.
        self.cos = self.sin = None
        self._decoded: tuple[int, torch.Tensor, torch.Tensor] | None = None  # see _dequantized

    def fork(self) -> "QuantizedKVLayer":
        """An independent copy sharing the stored tensors (updates build new tensors, never write in place)."""
        out = copy.copy(self)
        out.stored = {k: dict(v) for k, v in self.stored.items()}
        return out

    def _dequantized(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The codes in full precision. Codes are written once and only appended to, and every codec decodes per
        group or per token, so the tokens decoded at an earlier call are kept (`_decoded`, a compute cache of the
        dequantizing path, never counted as stored bytes) and only codes added since are decoded: the same
        values as decoding them all again, without the O(context) work at every step."""
        if not self.quantized:
            return None, None
        done, k, v = self._decoded if self._decoded is not None else (0, None, None)
        if done < self.quantized:
            dk, dv = self._decode_tokens(done, self.quantized)
            k, v = _cat(k, dk), _cat(v, dv)
            self._decoded = (self.quantized, k, v)
        return k, v

    def _decode_tokens(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of quantized tokens a…b-1 (group boundaries for channel-grouped codecs) in full precision."""
        shape = (*self.keys.shape[:2], b - a, self.keys.shape[-1])
        cos = sin = None
        if self.spec.rope:
            lo = self.spec.sink_tokens
            cos, sin = self.cos[:, lo + a : lo + b], self.sin[:, lo + a : lo + b]
        out = []
        for part, codec in (("key", self.spec.key), ("value", self.spec.value)):
            per = codec.group if isinstance(codec, AffineCodec) and codec.axis == "channel" else 1  # tokens per unit
            block = {name: t[:, :, a // per : b // per] for name, t in self.stored[part].items()}
            out.append(codec.decode(block, shape, cos, sin).to(self.dtype))
        return out[0], out[1]

    def full(self, new_keys=None, new_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, dequantized codes, residual (and new tokens) in sequence order, full precision."""
        dk, dv = self._dequantized()
        ks = [t for t in (self.sink_keys, dk, self.keys, new_keys) if t is not None]
        vs = [t for t in (self.sink_values, dv, self.values, new_values) if t is not None]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def update(self, key_states, value_states, cache_kwargs: dict | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out = self.full(key_states, value_states)  # a view only: nothing is stored before append's checks
        self.append(key_states, value_states, cache_kwargs)
        return out

    def append(self, key_states, value_states, cache_kwargs: dict | None = None) -> None:
        """Store new tokens (residual, then complete groups into codes) without building the dequantized view:
        the fused decode path (``decode_attention``) attends to the codes where they lie. Every token must be
        finite, and the tokens this call quantizes within their codec's range; a failing call stores nothing.

        When NaN/Inf is refused: checking reads the data back, which on a GPU is a wait that stops the host from
        queueing launches, so a call reads at most once. A call that quantizes, or brings several tokens (a
        prefill, a chunk), checks all its tokens with that one read — a NaN entering the residual or the sinks
        there is refused at once. A one-token call that quantizes nothing (most decode steps) reads nothing: it
        records on the device a sum that a NaN/Inf makes non-finite, and the next read (the next quantizing call, at
        most ``group`` tokens later) refuses what entered. On the CPU the same rule holds (the same code)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for t, what in ((key_states, "keys"), (value_states, "values")):
            quant.check_float(t, f"quantized cache layer {what}")
        if self.spec.rope and (not cache_kwargs or "cos" not in cache_kwargs):
            raise ValueError("a pre-RoPE key codec needs the RoPE tables (cos, sin) of every token it stores")
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        sinks, n = self._plan(keys.shape[-2])
        codecs = ((keys, key_states, "keys", self.spec.key), (values, value_states, "values", self.spec.value))
        unread = self._unread_nonfinite
        if n or key_states.shape[-2] > 1:
            checks = [(f"quantized cache layer {what}", t[..., sinks : sinks + n, :], getattr(codec, "fp16_metadata", False))
                      for t, _, what, codec in codecs] if n else []
            # all new tokens: the quantized ones are checked above first, so a failure here is in sinks or residual
            checks += [(f"quantized cache layer {what} entering full precision (sinks or residual)", new, False)
                       for _, new, what, _ in codecs]
            held = ((self.sink_keys, keys), (self.sink_values, values))  # where a one-token append's tokens are
            entered = [] if unread is None else [(f"quantized cache layer {what}", unread, tuple(t for t in held[i] if t is not None))
                                                 for i, (_, _, what, _) in enumerate(codecs)]
            peaks = quant.check_input(*checks, entered=tuple(entered))
            if n and peaks is not None:
                for (_, _, what, codec), peak in zip(codecs, peaks):
                    if hasattr(codec, "check_first_peak"):
                        codec.check_first_peak(peak, f"quantized cache layer {what}")
            unread = None
        elif not quant.capturing(key_states):  # no read: a device sum, not finite if a NaN/Inf entered, refused at
            # the next call that reads (which counts them in the tensors held); 3-4 small launches
            total = torch.sum(key_states, dtype=torch.float32) + torch.sum(value_states, dtype=torch.float32)
            unread = total if unread is None else unread + total
        self._unread_nonfinite = unread
        if self.spec.rope:
            cos, sin = cache_kwargs["cos"], cache_kwargs["sin"]
            self.cos = cos if self.cos is None else torch.cat([self.cos, cos], dim=1)
            self.sin = sin if self.sin is None else torch.cat([self.sin, sin], dim=1)
        self.keys, self.values = keys, values
        self.cumulative_length += key_states.shape[-2]
        self._settle()

    def _plan(self, unsettled: int) -> tuple[int, int]:
        """Of `unsettled` leading full-precision tokens: how many move into the sinks, and how many after them
        are quantized (every complete group beyond the residual)."""
        held = 0 if self.sink_keys is None else self.sink_keys.shape[-2]
        sinks = min(max(self.spec.sink_tokens - held, 0), unsettled)
        return sinks, max(0, (unsettled - sinks - self.spec.residual) // self.spec.group * self.spec.group)

    def _settle(self) -> None:
        """Move leading tokens into the sinks, then quantize every complete group beyond the residual."""
        spec = self.spec
        take, n = self._plan(self.keys.shape[-2])
        if take:
            self.sink_keys = _cat(self.sink_keys, self.keys[..., :take, :])
            self.sink_values = _cat(self.sink_values, self.values[..., :take, :])
            self.keys, self.values = self.keys[..., take:, :], self.values[..., take:, :]
        if not n:
            return
        cos = sin = None
        if spec.rope:
            lo = spec.sink_tokens + self.quantized
            cos, sin = self.cos[:, lo : lo + n], self.sin[:, lo : lo + n]
        for name, codec, x in (("key", spec.key, self.keys), ("value", spec.value, self.values)):
            block = codec.encode(x[..., :n, :], cos, sin)
            self.stored[name] = {k: _cat(self.stored[name].get(k), t) for k, t in block.items()}
        self.keys, self.values = self.keys[..., n:, :], self.values[..., n:, :]
        self.quantized += n

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes of every tensor the layer stores: sinks, codes and metadata, residual."""
        codes = sum(_nbytes(*d.values()) for d in self.stored.values())
        constant = sum(getattr(c, "constant_bytes", lambda: 0)() for c in (self.spec.key, self.spec.value))
        return _nbytes(self.sink_keys, self.sink_values, self.keys, self.values) + codes + constant

    def counts(self) -> dict[str, int]:
        """Tokens held per storage class (for the byte-accounting formula)."""
        sinks = 0 if self.sink_keys is None else self.sink_keys.shape[-2]
        return {"sink_tokens": sinks, "quantized_tokens": self.quantized, "residual_tokens": self.keys.shape[-2]}


_FULL_PRECISION = ("sink_keys", "sink_values", "keys", "values")  # a layer's tensors beside its stored codes


def stack_layers(layers: list) -> QuantizedKVLayer | None:
    """One layer holding the sequences of several (batch rows in order) when they can share one: initialized
    quantized layers of one spec object (so one FP8 scale; no pre-RoPE keys) holding the same counts of sinks,
    codes and residual tokens, as copies of one compressed cache do; None otherwise. The tensors are new; the
    layers given are not touched."""
    if len(layers) < 2:
        return None
    first = layers[0]
    same = all(isinstance(x, QuantizedKVLayer) and x.is_initialized and x.spec is first.spec and x.counts() == first.counts()
               and x.cumulative_length == first.cumulative_length for x in layers)
    if not same or first.spec.rope:
        return None
    out = first.fork()
    out._decoded = None  # the rows' codes are concatenated below: decode them anew
    for name in _FULL_PRECISION:
        if getattr(first, name) is not None:
            setattr(out, name, torch.cat([getattr(x, name) for x in layers]))
    out.stored = {part: {k: torch.cat([x.stored[part][k] for x in layers]) for k in first.stored[part]} for part in first.stored}
    flags = [x._unread_nonfinite for x in layers if x._unread_nonfinite is not None]
    out._unread_nonfinite = torch.stack(flags).sum() if flags else None
    return out


def select_rows(layer: QuantizedKVLayer, rows: list[int]) -> QuantizedKVLayer:
    """A layer holding only the given batch rows of `layer` (which is not touched)."""
    index = torch.tensor(rows, device=layer.keys.device)
    out = layer.fork()
    out._decoded = None  # only some rows are kept below: decode them anew
    for name in _FULL_PRECISION:
        if getattr(layer, name) is not None:
            setattr(out, name, getattr(layer, name).index_select(0, index))
    out.stored = {part: {k: t.index_select(0, index) for k, t in d.items()} for part, d in layer.stored.items()}
    return out


def layer_from_dense(keys: torch.Tensor, values: torch.Tensor, spec: LayerSpec, cos=None, sin=None) -> QuantizedKVLayer:
    """A quantized layer holding a prefilled (possibly evicted) cache, split into sinks / codes / residual."""
    layer = QuantizedKVLayer(spec)
    layer.update(keys, values, {"cos": cos, "sin": sin} if spec.rope else None)
    return layer


def hf_quantized_layer(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int, residual: int):
    """transformers' QuantizedCache layer (quanto backend) holding a prefilled cache: the baseline. It
    quantizes the whole prefill at once and re-quantizes everything whenever its residual fills."""
    from transformers.cache_utils import QuantoQuantizedLayer

    layer = QuantoQuantizedLayer(nbits=bits, axis_key=0, axis_value=0, q_group_size=group, residual_length=residual)
    layer.update(keys, values)
    return layer


def tensor_nbytes(t) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (quanto's packed codes, scales and shifts)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def layer_nbytes(layer) -> int:
    """Bytes one cache layer really stores, whatever its class."""
    if isinstance(layer, QuantizedKVLayer):
        return layer.nbytes()
    dense = tensor_nbytes(layer.keys) + tensor_nbytes(layer.values)
    return dense + tensor_nbytes(getattr(layer, "_quantized_keys", None)) + tensor_nbytes(getattr(layer, "_quantized_values", None))


def is_quantized(layer) -> bool:
    from transformers.cache_utils import QuantizedLayer

    return isinstance(layer, (QuantizedKVLayer, QuantizedLayer))


def fork_layer(layer):
    """A copy of a cache layer that can be updated without touching the original."""
    return layer.fork() if hasattr(layer, "fork") else copy.copy(layer)


def outliers_per_vector(fraction: float, head_dim: int) -> int:
    """Sparse entries kept per key vector for a requested outlier fraction (at least one when > 0)."""
    return 0 if fraction <= 0 else max(1, math.ceil(fraction * head_dim - 1e-9))
