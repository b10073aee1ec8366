"""Quantized KV cache layers on transformers' Cache API.

A :class:`QuantizedKVLayer` stores, per layer and in sequence order:
  1. ``sinks``: the first ``sink_tokens`` tokens in full precision (KVQuant's attention-sink option);
  2. the quantized part: packed codes plus their metadata (scales, zero points, sparse outliers) only;
  3. the residual: the newest tokens in full precision (``self.keys`` / ``self.values``, as in transformers'
     DynamicLayer), for keys and values each as many as the layer's policy leaves.
Streaming: new tokens enter the residual, and the spec's ``policy`` says when they move into codes
(``kvlab.kernels.layouts.coded_tokens``):
  - ``kivi``, KIVI's own cache: keys (per channel) are quantized R at a time, all of the full-precision keys
    once there are R of them (0 to R − 1 stay); values (per token) one at a time, the oldest beyond the newest
    R (R stay). So keys and values hold different counts of codes.
  - ``together``: keys and values move together; whenever the residual holds ``residual + group`` tokens its
    oldest ``group`` are quantized as one complete group (residual to residual + group − 1 stay).
Codes are written once and never dequantized-and-requantized. A prefilled cache is split by the same rule in
one step, so it stores what streaming the same tokens would.

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
from transformers.cache_utils import QuantizedLayer

from kvlab.kernels import layouts, quant
from kvlab.kernels.codecs import AffineCodec
from kvlab.kernels.layer import KVLayer


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own when it is a slice of a larger tensor (the same values)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


# --------------------------------------------------------------------------- #
# The layer
# --------------------------------------------------------------------------- #


@dataclass
class LayerSpec:
    """How one layer stores its cache: codecs per tensor, the flush unit, the residual and sink counts."""

    key: Any
    value: Any
    group: int  # tokens quantized at once under `together` (a complete key group); 1 for per-token schemes
    residual: int  # newest tokens kept in full precision (see `policy`)
    sink_tokens: int = 0  # first tokens always kept in full precision
    rope: bool = False  # the key codec needs each token's RoPE tables (pre-RoPE quantization)
    policy: str = "together"  # when tokens move into codes: kivi | together (kvlab.kernels.layouts.coded_tokens)

    def __post_init__(self):
        if self.policy not in layouts.POLICIES:
            raise ValueError(f"quantized cache policy must be one of {', '.join(layouts.POLICIES)}, got {self.policy!r}")
        for codec in (self.key, self.value):
            if self.policy == "kivi" and _per_channel(codec) and (problem := layouts.kivi_residual_problem(self.residual, codec.group)):
                raise ValueError(problem)

    def coded(self, part: str, full_precision: int) -> int:
        """Of `full_precision` tokens of `part` (key, value) beyond the sinks, how many are quantized now."""
        return layouts.coded_tokens(*self._rule(part, full_precision))

    def _rule(self, part: str, full_precision: int) -> tuple:
        codec = self.key if part == "key" else self.value
        group = self.group if self.policy == "together" else _unit(codec)
        return self.policy, _per_channel(codec), full_precision, self.residual, group

    def schedule(self) -> tuple:
        """Everything that decides which tokens are in codes when (sinks, and `coded` of keys and values): specs with
        the same schedule quantize the same tokens at the same steps (every layer of a row, mostly)."""
        return (self.sink_tokens, *self._rule("key", 0), *self._rule("value", 0))


def _per_channel(codec) -> bool:
    return isinstance(codec, AffineCodec) and codec.axis == "channel"


def _unit(codec) -> int:
    """Tokens per stored unit of a codec: its group for per-channel codes, else 1."""
    return codec.group if _per_channel(codec) else 1


class QuantizedKVLayer(KVLayer):
    """A cache layer holding sinks + packed codes + a full-precision residual (see the module docstring)."""

    own_layout = True  # codes cannot be concatenated with other rows' tensors

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.sink_keys = self.sink_values = None
        self.stored: dict[str, dict[str, torch.Tensor]] = {"key": {}, "value": {}}
        self.coded_keys = self.coded_values = 0  # tokens of each tensor in codes (the first ones after the sinks)
        # entries its codec clamped, per part and batch row ((B,) int64 on the device; a codec with no clamp: none).
        # Replaced, never written in place, so forks and stacked copies count on their own.
        self.saturated: dict[str, torch.Tensor] = {}
        # () float32 on the device: the sum of the one-token appends since the last read, NaN/Inf iff they held one
        self._unread_nonfinite: torch.Tensor | None = None
        self.cumulative_length = 0
        # RoPE tables of the tokens held (pre-RoPE codecs only): a function of position, like a model's
        # rotary cache, kept beside the cache and not counted as KV bytes.
        self.cos = self.sin = None
        self._view: dict | None = None  # the full-precision view's buffers (see `_viewed`), a compute cache

    @property
    def coded(self) -> tuple[int, int]:
        """Tokens in codes: (keys, values)."""
        return self.coded_keys, self.coded_values

    @property
    def quantized(self) -> int:
        """Tokens whose key and value are both in codes (the first ones after the sinks)."""
        return min(self.coded_keys, self.coded_values)

    def fork(self) -> "QuantizedKVLayer":
        """An independent copy sharing the stored tensors (updates build new tensors, never write in place)."""
        out = copy.copy(self)
        out.stored = {k: dict(v) for k, v in self.stored.items()}
        out._view = None  # its own buffers (built again at its first read): `full` writes into them
        return out

    def _viewed(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers (B, H, capacity, D) of keys and values whose first T positions hold the full-precision view of the
        T tokens held (sinks, dequantized codes, residual, in sequence order), with room for `n` more (shaped like
        `like`, a 4-d tensor of the layer's: before the first append its residual is still empty). A call writes
        only what changed since the last: tokens that entered (sinks and residual are full precision) and tokens that
        entered codes (decoded once where they lie: codes are written once and only appended to, and every codec
        decodes per group or per token, so these are the values decoding every code again gives). Rebuilding the view
        at every step (concatenating sinks, codes and residual) cost O(context) per layer and step. The buffers are a
        compute cache, never counted as stored bytes; room grows by half when used up."""
        sinks = 0 if self.sink_keys is None else self.sink_keys.shape[-2]
        held = self.cumulative_length
        view = self._view
        if view is None or view["key"].shape[-2] < held + n:
            room = max(64, n, held // 2)
            grown = {part: like.new_empty(*like.shape[:2], held + n + room, like.shape[-1]) for part in ("key", "value")}
            if view is None:
                view = {**grown, "filled": 0, "final": {"key": 0, "value": 0}}
            else:
                for part in ("key", "value"):
                    grown[part][..., : view["filled"], :] = view[part][..., : view["filled"], :]
                view = {**view, **grown}
            self._view = view
        filled = view["filled"]
        for part, sink, residual, coded in (("key", self.sink_keys, self.keys, self.coded_keys),
                                            ("value", self.sink_values, self.values, self.coded_values)):
            out = view[part]
            if filled < sinks:
                out[..., filled:sinks, :] = sink[..., filled:sinks, :]
            first = sinks + coded  # the residual's first position
            if held > max(filled, first):
                out[..., max(filled, first) : held, :] = residual[..., max(filled, first) - first :, :]
            done = max(view["final"][part], sinks)
            if first > done:
                out[..., done:first, :] = self.decode(part, done - sinks, coded)
            view["final"][part] = first
        view["filled"] = held
        return view["key"], view["value"]

    def decode(self, part: str, a: int, b: int) -> torch.Tensor:
        """Coded tokens a…b-1 of `part` (key, value) in full precision: the stored units covering them (whole
        groups of a per-channel codec) decoded, then cut to a…b-1."""
        codec = self.spec.key if part == "key" else self.spec.value
        per = _unit(codec)
        lo, hi = a // per * per, -(-b // per) * per
        shape = (*self.keys.shape[:2], hi - lo, self.keys.shape[-1])
        cos = sin = None
        if self.spec.rope:
            first = self.spec.sink_tokens
            cos, sin = self.cos[:, first + lo : first + hi], self.sin[:, first + lo : first + hi]
        block = {name: t[:, :, lo // per : hi // per] for name, t in self.stored[part].items()}
        return codec.decode(block, shape, cos, sin).to(self.dtype)[..., a - lo : b - lo, :]

    def full(self, new_keys=None, new_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, dequantized codes, residual (and new tokens) in sequence order, full precision: views of the layer's
        buffers (`_viewed`), which its next `full` may rewrite (copy what must outlive it)."""
        n = 0 if new_keys is None else new_keys.shape[-2]
        keys, values = self._viewed(n, self.keys if new_keys is None else new_keys)
        held = self._view["filled"]
        if n:
            keys[..., held : held + n, :] = new_keys
            values[..., held : held + n, :] = new_values
        return keys[..., : held + n, :], values[..., : held + n, :]

    def update(self, key_states, value_states, cache_kwargs: dict | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out = self.full(key_states, value_states)  # a view only: nothing is stored before append's checks
        self.append(key_states, value_states, cache_kwargs)
        return out

    def append(self, key_states, value_states, cache_kwargs: dict | None = None) -> None:
        """Store new tokens (residual, then what the policy quantizes into codes) without building the dequantized view:
        the fused decode path (``decode_attention``) attends to the codes where they lie. Every token must be
        finite, and the tokens this call quantizes within their codec's range; a failing call stores nothing.

        When NaN/Inf is refused: checking reads the data back, which on a GPU is a wait that stops the host from
        queueing launches, so a call reads at most once. A call that quantizes, or brings several tokens (a
        prefill, a chunk), checks all its tokens with that one read — a NaN entering the residual or the sinks
        there is refused at once. A one-token call that quantizes nothing (most decode steps) reads nothing: it
        records on the device a sum that a NaN/Inf makes non-finite, and the next read (the next quantizing call, at
        most ``group`` tokens later) refuses what entered. Under KIVI's own policy a one-token call quantizes the
        oldest full-precision value once R are held, so nearly every decode step reads (on a GPU, one wait per
        layer and step). On the CPU the same rule holds (the same code)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for t, what in ((key_states, "keys"), (value_states, "values")):
            quant.check_float(t, f"quantized cache layer {what}")
        if self.spec.rope and (not cache_kwargs or "cos" not in cache_kwargs):
            raise ValueError("a pre-RoPE key codec needs the RoPE tables (cos, sin) of every token it stores")
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        sinks, *coding = self._plan(keys.shape[-2], values.shape[-2])
        codecs = ((keys, key_states, "keys", self.spec.key), (values, value_states, "values", self.spec.value))
        quantizing = [(t, what, codec, n) for (t, _, what, codec), n in zip(codecs, coding) if n]
        unread = self._unread_nonfinite
        if quantizing or key_states.shape[-2] > 1:
            checks = [(f"quantized cache layer {what}", t[..., sinks : sinks + n, :], codec.fp16_metadata)
                      for t, what, codec, n in quantizing]
            # all new tokens: the quantized ones are checked above first, so a failure here is in sinks or residual
            checks += [(f"quantized cache layer {what} entering full precision (sinks or residual)", new, False)
                       for _, new, what, _ in codecs]
            held = ((self.sink_keys, keys), (self.sink_values, values))  # where a one-token append's tokens are
            entered = [] if unread is None else [(f"quantized cache layer {what}", unread, tuple(t for t in held[i] if t is not None))
                                                 for i, (_, _, what, _) in enumerate(codecs)]
            peaks = quant.check_input(*checks, entered=tuple(entered))
            if peaks is not None:
                for (_, what, codec, _), peak in zip(quantizing, peaks):
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

    def _plan(self, keys: int, values: int) -> tuple[int, int, int]:
        """Of `keys` / `values` leading full-precision tokens: how many move into the sinks (as many of each: sinks
        fill before anything is quantized), and how many of each after them are quantized (the spec's policy).
        The codes so far are whole units of that rule, so applying it to what is still in full precision splits
        the tokens as applying it to all of them would."""
        held = 0 if self.sink_keys is None else self.sink_keys.shape[-2]
        sinks = min(max(self.spec.sink_tokens - held, 0), keys)
        return sinks, self.spec.coded("key", keys - sinks), self.spec.coded("value", values - sinks)

    def _settle(self) -> None:
        """Move leading tokens into the sinks, then quantize what the policy quantizes of keys and of values."""
        spec = self.spec
        take, n_keys, n_values = self._plan(self.keys.shape[-2], self.values.shape[-2])
        # Sinks and residual are copied out of the tensor they were cut from (`_own`): a slice would keep all of it
        # alive, a prefill's whole full-precision K/V per quantized cache (measured: 3x the cache's bf16 bytes at 16K).
        if take:
            self.sink_keys = _cat(self.sink_keys, _own(self.keys[..., :take, :]))
            self.sink_values = _cat(self.sink_values, _own(self.values[..., :take, :]))
            self.keys, self.values = self.keys[..., take:, :], self.values[..., take:, :]
        for name, codec, attr, n in (("key", spec.key, "keys", n_keys), ("value", spec.value, "values", n_values)):
            if not n:
                continue
            done = getattr(self, f"coded_{attr}")
            cos = sin = None
            if spec.rope:
                lo = spec.sink_tokens + done
                cos, sin = self.cos[:, lo : lo + n], self.sin[:, lo : lo + n]
            x = getattr(self, attr)
            block = codec.encode(x[..., :n, :], cos, sin)
            self.stored[name] = {k: _cat(self.stored[name].get(k), t) for k, t in block.items()}
            clamped = codec.saturated(x[..., :n, :])
            if clamped is not None:
                self.saturated = {**self.saturated, name: clamped + self.saturated.get(name, 0)}
            setattr(self, attr, _own(x[..., n:, :]))
            setattr(self, f"coded_{attr}", done + n)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes of every tensor the layer stores: sinks, codes and metadata, residual."""
        codes = sum(_nbytes(*d.values()) for d in self.stored.values())
        constant = sum(c.constant_bytes() for c in (self.spec.key, self.spec.value))
        return _nbytes(self.sink_keys, self.sink_values, self.keys, self.values) + codes + constant

    def saturated_share(self, part: str) -> tuple[int, int] | None:
        """(entries clamped, entries in codes) of `part` (key, value) over all batch rows (one read back); None for a
        codec that clamps nothing."""
        if part not in self.saturated:
            return None
        coded = self.coded_keys if part == "key" else self.coded_values
        return int(self.saturated[part].sum()), coded * self.keys.shape[0] * self.keys.shape[1] * self.keys.shape[-1]

    def counts(self) -> dict[str, int]:
        """Tokens held per storage class (for the byte-accounting formula)."""
        sinks = 0 if self.sink_keys is None else self.sink_keys.shape[-2]
        return {"sink_tokens": sinks, "quantized_keys": self.coded_keys, "quantized_values": self.coded_values,
                "residual_keys": self.keys.shape[-2], "residual_values": self.values.shape[-2]}


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
    for name in _FULL_PRECISION:
        if getattr(first, name) is not None:
            setattr(out, name, torch.cat([getattr(x, name) for x in layers]))
    out.stored = {part: {k: torch.cat([x.stored[part][k] for x in layers]) for k in first.stored[part]} for part in first.stored}
    flags = [x._unread_nonfinite for x in layers if x._unread_nonfinite is not None]
    out._unread_nonfinite = torch.stack(flags).sum() if flags else None
    out.saturated = {part: torch.cat([x.saturated[part] for x in layers]) for part in first.saturated}
    return out


def select_rows(layer: QuantizedKVLayer, rows: list[int]) -> QuantizedKVLayer:
    """A layer holding only the given batch rows of `layer` (which is not touched)."""
    index = torch.tensor(rows, device=layer.keys.device)
    out = layer.fork()
    for name in _FULL_PRECISION:
        if getattr(layer, name) is not None:
            setattr(out, name, getattr(layer, name).index_select(0, index))
    out.stored = {part: {k: t.index_select(0, index) for k, t in d.items()} for part, d in layer.stored.items()}
    out.saturated = {part: t.index_select(0, index) for part, t in layer.saturated.items()}
    return out


def layer_from_dense(keys: torch.Tensor, values: torch.Tensor, spec: LayerSpec, cos=None, sin=None) -> QuantizedKVLayer:
    """A quantized layer holding a prefilled (possibly evicted) cache, split into sinks / codes / residual."""
    layer = QuantizedKVLayer(spec)
    layer.append(keys, values, {"cos": cos, "sin": sin} if spec.rope else None)  # no full-precision view: a batch's
    return layer  # forks build their own at their first read (`fork`), so one built here would only hold memory


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
    if isinstance(layer, KVLayer) and layer.shares is not None:
        return 0  # another layer's keys and values: counted there
    dense = tensor_nbytes(layer.keys) + tensor_nbytes(layer.values)
    if isinstance(layer, QuantizedLayer) and layer.is_initialized:  # transformers' own: codes packed by its backend, plus a dense residual
        return dense + tensor_nbytes(layer._quantized_keys) + tensor_nbytes(layer._quantized_values)
    return dense


def is_quantized(layer) -> bool:
    return isinstance(layer, (QuantizedKVLayer, QuantizedLayer))


def outliers_per_vector(fraction: float, head_dim: int) -> int:
    """Sparse entries kept per key vector for a requested outlier fraction (at least one when > 0)."""
    return 0 if fraction <= 0 else max(1, math.ceil(fraction * head_dim - 1e-9))
