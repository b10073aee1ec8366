"""Byte accounting of KV caches, in exact integer arithmetic.

A cache is described by a model geometry (:class:`KVGeometry`) and a storage
scheme (:class:`Scheme`).  Every byte count below is a Python ``int``; the only
floats are the user-facing ``keep_fraction`` (read back as the decimal it prints
as, see :func:`kept_tokens`) and the ratio returned by
:func:`compression_ratio`.

Storage model (the "physical" view used by :func:`context_bytes`):

* Of a context of ``tokens`` tokens, ``kept_tokens`` survive eviction
  (``keep_fraction``); a sliding-attention layer holds at most ``sliding_window``
  of them.
* Of the tokens a layer holds, the most recent ones sit in BF16 *instead of*
  being quantized, as many of the keys and of the values as the scheme's
  ``policy`` leaves (``kvlab.kernels.layouts.coded_tokens``, the rule the real
  cache layer follows): under ``kivi`` (KIVI's own cache) ``held mod residual``
  keys and ``min(held, residual)`` values, under ``together`` the same
  ``residual`` to ``residual + group - 1`` of both; the rest are quantized.
  Residual tokens are therefore counted once.
* The article's simpler view (every kept token quantized, the residual window
  added on top) is available as :func:`article_view_bytes`.

Quantized layout (KIVI-style, ``Scheme.int``): per layer, per KV head, per
token, keys and values each store ``head_dim * bits / 8`` bytes of codes.  Keys
are quantized per channel in groups of ``group`` tokens, so each channel pays
one (scale, zero) per ``group`` tokens: ``head_dim * 4 / group`` bytes per
token.  Values are quantized per token in groups of ``group`` channels:
``ceil(head_dim / group)`` groups per token, 4 bytes each.  (4 = fp16 scale +
fp16 zero point by default.)  An MLA latent vector is treated like a value
tensor: per-token groups of ``group`` channels.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction

from kvlab.kernels.layouts import POLICIES, TensorCodes, ceil_div, coded_tokens, kivi_residual_problem, stored_layer_bytes

BF16_BYTES = 2
"""Bytes per element of a BF16 (full-precision) cache entry."""

ARTICLE_CONTEXT_TOKENS = 131_072
"""The article's "128K" context, 128 × 1024 tokens."""


def _exact_fraction(x: float) -> Fraction:
    """The decimal a float prints as, as an exact Fraction (``0.3`` -> 3/10)."""
    return Fraction(repr(float(x)))


# --------------------------------------------------------------------------- #
# Geometry
# --------------------------------------------------------------------------- #

_LAYER_TYPE_ALIASES = {
    "full": "full",
    "full_attention": "full",
    "sliding": "sliding",
    "sliding_attention": "sliding",
}


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache.

    ``latent_dim`` is set for MLA models: their cache holds, per layer per
    token, one latent vector of ``latent_dim`` elements instead of
    ``2 * kv_heads * head_dim`` (``kv_heads``/``head_dim`` are then nominal and
    unused for byte counts).  ``sliding_layers`` of the ``layers`` use sliding-
    window attention and hold at most ``sliding_window`` tokens each.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    latent_dim: int | None = None
    sliding_layers: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        """Reject non-positive sizes and inconsistent sliding-window settings."""
        for field in ("layers", "kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive")
        if self.latent_dim is not None and self.latent_dim <= 0:
            raise ValueError(f"{self.name}: latent_dim must be positive")
        if not 0 <= self.sliding_layers <= self.layers:
            raise ValueError(f"{self.name}: sliding_layers must be in [0, layers]")
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError(f"{self.name}: sliding layers need a positive sliding_window")

    @classmethod
    def from_card(cls, card: dict) -> KVGeometry:
        """Build a geometry from a model card dict.

        Reads ``name``, ``num_layers``, ``num_kv_heads``, ``head_dim``, optional
        ``latent_dim``, and optional ``layer_types`` (one "full"/"sliding" per
        layer; Hugging Face's "full_attention"/"sliding_attention" also accepted)
        with ``sliding_window``.
        """
        layers = int(card["num_layers"])
        layer_types = card.get("layer_types")
        sliding = 0
        window = None
        if layer_types is not None:
            if len(layer_types) != layers:
                raise ValueError(
                    f"{card['name']}: layer_types has {len(layer_types)} entries, "
                    f"num_layers is {layers}"
                )
            kinds = []
            for t in layer_types:
                if t not in _LAYER_TYPE_ALIASES:
                    raise ValueError(f"{card['name']}: unknown layer type {t!r}")
                kinds.append(_LAYER_TYPE_ALIASES[t])
            sliding = kinds.count("sliding")
            if sliding:
                window = int(card["sliding_window"])
        latent = card.get("latent_dim")
        return cls(
            name=str(card["name"]),
            layers=layers,
            kv_heads=int(card["num_kv_heads"]),
            head_dim=int(card["head_dim"]),
            latent_dim=None if latent is None else int(latent),
            sliding_layers=sliding,
            sliding_window=window,
        )

    @property
    def full_layers(self) -> int:
        """Number of full-attention layers."""
        return self.layers - self.sliding_layers

    def elements_per_layer_token(self) -> int:
        """Cache elements one layer stores per token (K and V, or the MLA latent)."""
        if self.latent_dim is not None:
            return self.latent_dim
        return 2 * self.kv_heads * self.head_dim


LLAMA_31_70B = KVGeometry(name="Llama-3.1-70B", layers=80, kv_heads=8, head_dim=128)
"""Llama-3.1-70B: 80 layers, GQA with 8 KV heads of dimension 128."""

DEEPSEEK_V3_MLA = KVGeometry(
    name="DeepSeek-V3", layers=61, kv_heads=128, head_dim=128, latent_dim=576
)
"""DeepSeek-V3 with MLA: 61 layers, a 576-element latent (512 KV + 64 RoPE key)
per layer per token.  ``kv_heads``/``head_dim`` (128/128) are nominal."""


# --------------------------------------------------------------------------- #
# Scheme
# --------------------------------------------------------------------------- #

_ACCEPTED_FORMS = (
    "accepted forms: 'bf16', 'fp8', 'int<bits>-g<group>-r<residual>' "
    "(e.g. 'int4-g32-r128'; KIVI's streaming policy, or '-together' after it for kvlab's earlier one), each "
    "optionally followed by '+keep<fraction>' with 0 < fraction <= 1 (e.g. 'int4-g32-r128+keep0.25')"
)

_SCHEME_RE = re.compile(
    r"^(?:(?P<bf16>bf16)|(?P<fp8>fp8)|int(?P<bits>\d+)-g(?P<group>\d+)-r(?P<residual>\d+)(?:-(?P<policy>together))?)"
    r"(?:\+keep(?P<keep>\d*\.?\d+))?$"
)


@dataclass(frozen=True)
class Scheme:
    """How cache entries are stored.

    ``bits`` per element; if ``group`` is set, each quantization group also
    stores ``scale_bytes + zero_bytes`` of metadata; the newest ``residual``
    tokens are kept in BF16 (which of the keys and values exactly: ``policy``,
    see the module docstring); ``keep_fraction`` of the context survives
    token eviction (e.g. SnapKV).
    """

    name: str
    bits: int = 16
    group: int | None = None
    residual: int = 0
    keep_fraction: float = 1.0
    scale_bytes: int = 2
    zero_bytes: int = 2
    policy: str = "kivi"

    def __post_init__(self) -> None:
        """Reject out-of-range settings."""
        if not 1 <= self.bits <= 32:
            raise ValueError(f"{self.name}: bits must be in [1, 32]")
        if self.group is not None and self.group <= 0:
            raise ValueError(f"{self.name}: group must be positive")
        if self.residual < 0:
            raise ValueError(f"{self.name}: residual must be >= 0")
        if not 0 < self.keep_fraction <= 1:
            raise ValueError(f"{self.name}: keep_fraction must be in (0, 1]")
        if self.scale_bytes < 0 or self.zero_bytes < 0:
            raise ValueError(f"{self.name}: metadata sizes must be >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"{self.name}: policy must be one of {', '.join(POLICIES)}")
        if (self.group is not None and self.residual and self.policy == "kivi"  # residual 0: every token quantized
                and (problem := kivi_residual_problem(self.residual, self.group))):
            raise ValueError(f"{self.name}: {problem} (or use '-together')")

    @classmethod
    def bf16(cls) -> Scheme:
        """Uncompressed BF16 cache: 16 bits per element, no metadata."""
        return cls(name="bf16", bits=16)

    @classmethod
    def dense(cls, dtype: str) -> Scheme:
        """An unquantized cache in a torch dtype name (float32, bfloat16, float16): what a run really holds."""
        bits = {"float32": 32, "bfloat16": 16, "float16": 16}
        if dtype not in bits:
            raise ValueError(f"dense scheme: unknown dtype {dtype!r}; allowed: {', '.join(bits)}")
        return cls(name=dtype, bits=bits[dtype])

    @classmethod
    def fp8(cls) -> Scheme:
        """FP8 cache: 8 bits per element.

        FP8 KV caches use static per-head (or per-tensor) scales: a handful of
        bytes per layer, independent of the context length.  They are
        negligible and counted as 0 here.
        """
        return cls(name="fp8", bits=8, scale_bytes=0, zero_bytes=0)

    @classmethod
    def int(cls, bits: int, group: int, residual: int, policy: str = "kivi") -> Scheme:
        """KIVI-style integer quantization.

        Keys per channel in groups of ``group`` tokens, values per token in
        groups of ``group`` channels, one fp16 scale + fp16 zero point (4 bytes)
        per group, and recent tokens in BF16 by ``policy`` (module docstring).
        """
        if not 1 <= bits <= 8:
            raise ValueError(f"int{bits}: integer bits must be in [1, 8]")
        suffix = "" if policy == "kivi" else f"-{policy}"
        return cls(name=f"int{bits}-g{group}-r{residual}{suffix}", bits=bits, group=group, residual=residual, policy=policy)

    def with_keep(self, fraction: float) -> Scheme:
        """The same storage with only ``fraction`` of the tokens kept (name gets ``+keepF``)."""
        base = self.name.split("+keep", 1)[0]
        fraction = float(fraction)
        name = base if fraction == 1.0 else f"{base}+keep{fraction!r}"
        return replace(self, name=name, keep_fraction=fraction)

    @classmethod
    def parse(cls, text: str) -> Scheme:
        """Parse 'bf16', 'fp8', 'int<bits>-g<group>-r<residual>', each with optional '+keep<f>'.

        Raises a one-line ValueError listing the accepted forms on bad input.
        """
        m = _SCHEME_RE.match(text.strip().lower()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"bad scheme {text!r}; {_ACCEPTED_FORMS}")
        try:
            if m["bf16"]:
                scheme = cls.bf16()
            elif m["fp8"]:
                scheme = cls.fp8()
            else:
                scheme = cls.int(int(m["bits"]), int(m["group"]), int(m["residual"]), m["policy"] or "kivi")
            if m["keep"] is not None:
                scheme = scheme.with_keep(float(m["keep"]))
        except ValueError as err:
            raise ValueError(f"bad scheme {text!r} ({err}); {_ACCEPTED_FORMS}") from None
        return scheme


# --------------------------------------------------------------------------- #
# Byte counts
# --------------------------------------------------------------------------- #


def kept_tokens(scheme: Scheme, tokens: int) -> int:
    """Tokens that survive eviction: ``floor(keep_fraction * tokens)``.

    ``keep_fraction`` is read as the decimal it prints as (0.3 means exactly
    3/10, not the nearest binary double), so e.g. 0.25 × 131,072 = 32,768 and
    0.3 × 10 = 3 exactly.  The product is rounded down.
    """
    if tokens < 0:
        raise ValueError("tokens must be >= 0")
    return math.floor(_exact_fraction(scheme.keep_fraction) * tokens)


def _bf16_layer_bytes_per_token(geom: KVGeometry) -> int:
    """BF16 bytes one layer stores per token."""
    return BF16_BYTES * geom.elements_per_layer_token()


def _quantized_layer_bytes(geom: KVGeometry, scheme: Scheme, keys: int, values: int) -> int:
    """Exact bytes one layer needs to store ``keys`` keys and ``values`` values as codes under ``scheme`` (an MLA
    latent: ``keys`` latent vectors).

    Codes are packed per tensor per head (rounded up to a whole byte); key
    groups are counted whole (``ceil(n / group)`` per channel).
    """
    meta = scheme.scale_bytes + scheme.zero_bytes
    if geom.latent_dim is not None:
        codes = ceil_div(keys * geom.latent_dim * scheme.bits, 8)
        if scheme.group is None:
            return codes
        return codes + keys * ceil_div(geom.latent_dim, scheme.group) * meta
    if scheme.group is None:
        codes = TensorCodes(scheme.bits, "static")
        return stored_layer_bytes(codes, codes, geom.kv_heads, geom.head_dim, (keys, values), (0, 0), 0)
    # keys: one group per channel per g tokens; values: ceil(d/g) groups per token
    key = TensorCodes(scheme.bits, "channel", scheme.group, meta)
    value = TensorCodes(scheme.bits, "token", scheme.group, meta)
    return stored_layer_bytes(key, value, geom.kv_heads, geom.head_dim, (keys, values), (0, 0), 0)


def coded_split(geom: KVGeometry, scheme: Scheme, held: int) -> tuple[int, int]:
    """(keys, values) of the ``held`` tokens of one layer stored as codes; the rest are in BF16. The real layer's
    rule (``kvlab.kernels.layouts.coded_tokens``) for per-channel keys in groups and per-token values; schemes
    without groups, an MLA latent and a residual of 0 keep exactly the newest ``residual`` tokens."""
    if scheme.group is None or geom.latent_dim is not None or scheme.residual == 0:
        coded = max(0, held - scheme.residual)
        return coded, coded
    args = (held, scheme.residual, scheme.group)
    return coded_tokens(scheme.policy, True, *args), coded_tokens(scheme.policy, False, *args)


def _layer_bytes_per_token(geom: KVGeometry, scheme: Scheme) -> Fraction:
    """Steady-state (amortized) quantized bytes per token of one layer, exact."""
    meta = scheme.scale_bytes + scheme.zero_bytes
    if geom.latent_dim is not None:
        b = Fraction(geom.latent_dim * scheme.bits, 8)
        if scheme.group is not None:
            b += ceil_div(geom.latent_dim, scheme.group) * meta
        return b
    d, g = geom.head_dim, scheme.group
    per_head = Fraction(2 * d * scheme.bits, 8)
    if g is not None:
        per_head += Fraction(d * meta, g)  # key metadata, amortized over g tokens
        per_head += ceil_div(d, g) * meta  # value metadata
    return geom.kv_heads * per_head


def bytes_per_token(geom: KVGeometry, scheme: Scheme) -> int:
    """Steady-state quantized bytes per token over all layers, metadata included.

    Excludes the residual window and ignores ``keep_fraction`` and sliding
    windows (it is the full-attention, per-stored-token figure).  If the
    amortized key metadata is not a whole number of bytes it is rounded up.
    """
    return math.ceil(geom.layers * _layer_bytes_per_token(geom, scheme))


def _layer_groups(geom: KVGeometry, held: int) -> list[tuple[int, int]]:
    """``(number_of_layers, tokens_held_per_layer)`` for full and sliding layers."""
    groups = [(geom.full_layers, held)]
    if geom.sliding_layers:
        groups.append((geom.sliding_layers, min(held, geom.sliding_window)))
    return groups


def context_bytes(geom: KVGeometry, scheme: Scheme, tokens: int) -> int:
    """Exact cache bytes for a context of ``tokens`` tokens (physical view).

    Each layer holds ``kept_tokens(scheme, tokens)`` tokens (a sliding layer at
    most ``sliding_window``).  Of those, the keys and values ``coded_split``
    gives are quantized with their group metadata, and the others (the newest)
    are stored in BF16 *instead of* quantized: what the cache layer stores.
    """
    per_tensor = BF16_BYTES * (geom.latent_dim if geom.latent_dim is not None else geom.kv_heads * geom.head_dim)
    total = 0
    for n_layers, held in _layer_groups(geom, kept_tokens(scheme, tokens)):
        keys, values = coded_split(geom, scheme, held)
        dense = held - keys if geom.latent_dim is not None else 2 * held - keys - values
        total += n_layers * (_quantized_layer_bytes(geom, scheme, keys, values) + dense * per_tensor)
    return total


def article_view_bytes(geom: KVGeometry, scheme: Scheme, tokens: int) -> int:
    """Cache bytes in the article's simpler view.

    Every kept token is quantized, and the BF16 residual window is added on
    top (so the residual tokens are counted twice).  Sliding caps still apply.
    """
    bf16_per_layer = _bf16_layer_bytes_per_token(geom)
    total = 0
    for n_layers, held in _layer_groups(geom, kept_tokens(scheme, tokens)):
        total += n_layers * (
            _quantized_layer_bytes(geom, scheme, held, held)
            + min(held, scheme.residual) * bf16_per_layer
        )
    return total


def compression_ratio(geom: KVGeometry, scheme: Scheme, tokens: int | None = None) -> float:
    """Compression versus BF16 (BF16 bytes / scheme bytes).

    With ``tokens``, the ratio of :func:`context_bytes` of a BF16 cache of the
    full context to ``scheme``'s.  Without, the steady-state per-token ratio
    ``bytes_per_token(bf16) / (keep_fraction * bytes_per_token(scheme))``
    (for a model without sliding layers, the limit as tokens grow).  Computed
    exactly, then rounded once to a float.
    """
    if tokens is None:
        num = Fraction(bytes_per_token(geom, Scheme.bf16()))
        den = _exact_fraction(scheme.keep_fraction) * _layer_bytes_per_token(geom, scheme) * geom.layers
    else:
        num = Fraction(context_bytes(geom, Scheme.bf16(), tokens))
        den = Fraction(context_bytes(geom, scheme, tokens))
    return float(num / den)
