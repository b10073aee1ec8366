"""Serving engines' own KV caches as method kinds: the engine answers the job's prompts (the same token ids, greedy)
with its default cache, the job's reference, and with the configured one. ``llamacpp``: llama.cpp's cache types
(`--cache-type-k/-v`), run by kvlab.engine.llamacpp in the engine's own environment (`make llamacpp-env`) on the
model's GGUF file. Their rows are those of every method (kvlab.steps.serve), under a model of their own
(``<model>@<engine>``: the engine's default cache is that model's full cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.methods.base import MethodKind, MethodParams
from kvlab.util.params import param

# llama.cpp's block formats (ggml-common.h): (values per block, bytes per block) along a row of head_dim values
LLAMACPP_BLOCKS = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
                   "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18)}
CACHE_TYPE = {"enum": list(LLAMACPP_BLOCKS)}


def row_bytes(cache_type: str, values: int) -> int:
    """Bytes of `values` consecutive values (one token's K or V of one KV head) in llama.cpp's `cache_type` blocks."""
    per, size = LLAMACPP_BLOCKS[cache_type]
    if values % per:
        raise ValueError(f"llama.cpp cache type {cache_type} packs {per} values per block; a head of {values} does "
                         f"not divide: use f16, bf16 or f32")
    return values // per * size


def token_bytes(types: tuple[str, str], layers: int, heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in every layer of a llama.cpp cache of (K, V) cache `types`."""
    k, v = types
    return layers * heads * (row_bytes(k, head_dim) + row_bytes(v, head_dim))


class LlamaCpp(MethodKind):
    """llama.cpp's KV cache of `cache_type_k` keys and `cache_type_v` values (flash attention on, as a quantized V
    needs); its reference is llama.cpp's f16 cache of the same GGUF model."""

    name = "llamacpp"
    engine: ClassVar[str] = "llamacpp"
    REFERENCE: ClassVar[tuple[str, str]] = ("f16", "f16")  # llama.cpp's default cache: the engine's own "full"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        cache_type_k: str = param(doc="llama.cpp's --cache-type-k: f16 | bf16 | f32 | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | iq4_nl",
                                  **CACHE_TYPE)
        cache_type_v: str = param(doc="llama.cpp's --cache-type-v (the same types)", **CACHE_TYPE)
        kvlab_twin: str | None = param(
            None, "a kvlab method of this config that simulates this cache: the report compares their answers prompt by "
            "prompt (README \"Your serving engine\")", pattern=r"^[A-Za-z0-9_.\-]+$")

    @property
    def types(self) -> tuple[str, str]:
        return self.params["cache_type_k"], self.params["cache_type_v"]

    @property
    def storage(self) -> dict:
        """The row's scheme: the cache types; bits: stored bits per value, K and V averaged (q4_0: 4.5)."""
        k, v = self.types
        bits = sum(8 * LLAMACPP_BLOCKS[t][1] / LLAMACPP_BLOCKS[t][0] for t in (k, v)) / 2
        return {"scheme": f"llama.cpp {k}/{v}", "bits": bits, "key_axis": "token", "value_axis": "token", "policy": None}
