"""KV bytes one decode step reads, in exact integer arithmetic: full attention, NSA and MoBA, and the context
length at which those reads exceed the weights' (the article's §6 and §8.3).

A decode step at context ``tokens`` (the new token included) reads, per full-attention layer and KV head:

* full attention: every cached token's key and value (``kvlab.kernels.accounting.context_bytes``);
* NSA (Yuan et al. 2025, "Native Sparse Attention"): three branches, each with its own keys and values —
  ``floor((tokens - l) / d) + 1`` compressed tokens (one per block of ``l`` tokens taken every ``d``), ``n``
  selected blocks of ``l'`` raw tokens and the ``w`` newest tokens.  The branches are counted separately, as the
  paper's decoding count does (its Table 4: at most ``(s - l) / d`` compressed + ``n·l'`` selected + ``w``
  neighbouring tokens per step); a selected block inside the window is read twice;
* MoBA (Lu et al. 2025, "Mixture of Block Attention"): blocks of ``B`` tokens; the query scores every complete
  past block by its mean key (one key vector per block, assumed cached), takes the current block and the best
  ``top_k - 1`` past ones (MoonshotAI/MoBA ``moba_efficient.py``: "the last chunk is always chosen"), and reads
  their keys and values.

A sliding-window layer reads at most its window under every method.  Sparse reads are modelled for GQA caches
(keys and values per KV head); an MLA latent has no separate key to score with.

Weights: a decode step of one sequence reads every weight once: ``ceil(parameters × bits / 8)`` bytes
(4-bit formats' group scales excluded; the input embedding counted whole though one row is read).  The KV reads
grow with the context and with the number of sequences decoded together; the weights do not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvlab.kernels.accounting import KVGeometry, Scheme, bytes_per_token, context_bytes

LLAMA_3_70B_PARAMS = 70_553_706_496
"""Parameters of Llama-3-70B and Llama-3.1-70B (same shapes), summed from their config.json (meta-llama on the
Hugging Face hub: hidden 8192, intermediate 28672, 80 layers, 64 query and 8 KV heads of 128, vocabulary 128256,
untied embeddings): 80 × (2·8192² + 2·8192·1024 + 3·8192·28672 + 2·8192) + 2·128256·8192 + 8192."""


def _check_positive(obj) -> None:
    for f in fields(obj):
        if getattr(obj, f.name) <= 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a positive integer, got {getattr(obj, f.name)!r}")


@dataclass(frozen=True)
class NSA:
    """NSA's decode-time shape; the defaults are the paper's (blocks of 32 compressed every 16, 16 selected blocks
    of 64, a 512-token window)."""

    compress_block: int = 32
    compress_stride: int = 16
    select_block: int = 64
    select_blocks: int = 16
    window: int = 512

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.compress_stride > self.compress_block:
            raise ValueError(f"NSA.compress_stride {self.compress_stride} exceeds compress_block {self.compress_block}: "
                             "the compressed blocks would skip tokens; use a stride of at most the block")

    def branch_tokens(self, tokens: int) -> dict[str, int]:
        """Key/value vectors each branch reads per layer and KV head at context ``tokens``."""
        compressed = (tokens - self.compress_block) // self.compress_stride + 1 if tokens >= self.compress_block else 0
        return {"compressed": compressed, "selected": min(self.select_blocks * self.select_block, tokens),
                "window": min(self.window, tokens)}


@dataclass(frozen=True)
class MoBA:
    """MoBA's decode-time shape; the defaults are the paper's (blocks of 512, top 3, the current block among them)."""

    block: int = 512
    top_k: int = 3

    def __post_init__(self) -> None:
        _check_positive(self)

    def read_tokens(self, tokens: int) -> tuple[int, int]:
        """(tokens whose keys and values are read, past blocks whose mean key is scored) per layer and KV head."""
        if tokens <= 0:
            return 0, 0
        past = (tokens - 1) // self.block  # complete blocks before the current one
        current = tokens - past * self.block
        return current + min(self.top_k - 1, past) * self.block, past


def _layer_token_bytes(geom: KVGeometry, scheme: Scheme) -> int:
    """Bytes of one token's keys and values in one layer (a dense scheme: no group metadata, no residual)."""
    if scheme.group is not None:
        raise ValueError(f"sparse reads are counted for dense caches (bf16, fp8); got {scheme.name!r}")
    return bytes_per_token(geom, scheme) // geom.layers


def decode_read_bytes(geom: KVGeometry, tokens: int, method: NSA | MoBA | None = None,
                      scheme: Scheme = Scheme.bf16()) -> int:
    """KV bytes one decode step reads at context ``tokens``: full attention (``method`` None), NSA or MoBA."""
    if tokens < 0:
        raise ValueError("tokens must be >= 0")
    if method is None:
        return context_bytes(geom, scheme, tokens)
    if geom.latent_dim is not None:
        raise ValueError(f"{geom.name}: NSA/MoBA reads are counted for GQA caches; an MLA latent has no separate keys")
    per_token = _layer_token_bytes(geom, scheme)  # keys and values; a key alone is half
    if isinstance(method, NSA):
        full_layer = sum(method.branch_tokens(tokens).values()) * per_token
    else:
        kv, scored = method.read_tokens(tokens)
        full_layer = kv * per_token + scored * per_token // 2
    sliding = geom.sliding_layers * min(tokens, geom.sliding_window or 0) * per_token
    return geom.full_layers * full_layer + sliding


def weight_bytes(params: int, bits: int) -> int:
    """Bytes of ``params`` weights at ``bits`` bits each, rounded up to a whole byte."""
    if params <= 0 or not 1 <= bits <= 32:
        raise ValueError(f"weights: need params > 0 and bits in [1, 32], got {params} and {bits}")
    return -(-params * bits // 8)


def crossover_tokens(geom: KVGeometry, scheme: Scheme, weights: int) -> int | None:
    """The shortest context whose full-attention KV reads per decode step exceed ``weights`` bytes; None when no
    context does (every layer a sliding window too small).  ``context_bytes`` never decreases with the context, so
    a doubling search then a bisection find it exactly."""
    if geom.full_layers == 0 and context_bytes(geom, scheme, geom.sliding_window) <= weights:
        return None
    hi = 1
    while context_bytes(geom, scheme, hi) <= weights:
        hi *= 2
    lo = hi // 2  # reads at lo do not exceed the weights (or lo is 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if context_bytes(geom, scheme, mid) <= weights else (lo, mid)
    return hi
