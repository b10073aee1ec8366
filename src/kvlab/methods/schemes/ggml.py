"""llama.cpp's KV cache types (`cache_type_k` / `cache_type_v`: q8_0, q4_0 or f16, as its `--cache-type-k` and
`--cache-type-v`), kvlab's copy of what llama.cpp stores: ggml's blocks of 32 channels per token and KV head with
one fp16 scale each (q8_0: 34 bytes per 32 values, q4_0: 18; `kvlab.kernels.ggml`, which cites the sources), every
token quantized as it is written (no residual). Where a type is quantized and the head dim a multiple of 64,
llama.cpp (since PR #21038, src/llama-kv-cache.cpp `attn_rot_k` / `attn_rot_v`, applied in src/llama-graph.cpp
`build_attn`) multiplies K (after RoPE) and V by an orthonormal Hadamard matrix before storing them, and so does
this scheme (`attn_rot: false` leaves them as they are, as `LLAMA_ATTN_ROT_DISABLE=1` does). q8_0 codes are those
llama.cpp's x86 CPU backend writes (ties to even; ggml's reference rounds them away from zero).

What it does not copy of llama.cpp's engine (kvlab's attention runs on the dequantized tensors in the model's
dtype): on the CPU, flash attention quantizes each query to q8_0 for its dot products with a quantized K
(ggml/src/ggml-cpu/ops.cpp `ggml_compute_forward_flash_attn_ext_f16_one_chunk`); and llama.cpp writes each token's
K and V into the cache before attention reads it, so a prompt's tokens already attend to quantized keys and values
during the prefill, and a new token to its own quantized entry, where kvlab's `quant` kind quantizes the prefilled
cache and a new token attends to itself in full precision."""

from __future__ import annotations

from kvlab.kernels.layouts import TensorCodes
from kvlab.methods.schemes.base import QuantScheme

TYPES = ("f16", "q8_0", "q4_0")  # kvlab.kernels.ggml.TYPES (not imported: validation loads no kernels)
BITS = {"f16": 16, "q8_0": 8, "q4_0": 4}


class GGML(QuantScheme):
    name = "ggml"

    def __init__(self, params: dict):
        # not QuantScheme's: the entry's `bits` and `group` (the schema's defaults) say nothing of ggml's blocks
        self.params = params
        self.types: tuple[str, str] = params.get("cache_type_k") or "f16", params.get("cache_type_v") or "f16"
        self.attn_rot: bool = params.get("attn_rot", True)
        self.bits = max(BITS[t] for t in self.types)  # rows' `bits`: the wider of the two (what memory plans by)
        self.group = 32  # values per block
        self.residual = 0

    @property
    def axes(self) -> tuple[str, str]:
        return "token", "token"

    def problem(self):
        if self.types == ("f16", "f16"):
            return "cache_type_k", ("scheme ggml needs a quantized cache_type_k or cache_type_v (q8_0, q4_0); "
                                    "f16 for both is llama.cpp's unquantized cache")
        if self.params.get("residual"):
            return "residual", "llama.cpp quantizes every token as it is written; scheme ggml keeps no residual: remove it"
        return None

    def rotations(self, head_dim: int) -> tuple[int | None, int | None]:
        """(key, value) n of llama.cpp's Hadamard rotations at this head dim (None: not rotated)."""
        from kvlab.kernels import ggml

        k, v = self.types
        on = self.attn_rot
        return (ggml.k_rotation(head_dim) if on and k in ggml.QUANTIZED else None,
                ggml.v_rotation(head_dim) if on and v in ggml.QUANTIZED else None)

    def layer_spec(self, layer: int, heads: int, head_dim: int):
        from kvlab.kernels import codecs, kvcache

        if head_dim % 32 and any(t != "f16" for t in self.types):
            raise ValueError(f"scheme ggml: q8_0 and q4_0 blocks hold 32 channels; head_dim {head_dim} is not a multiple of 32")
        key, value = (codecs.GGMLCodec(t, n) for t, n in zip(self.types, self.rotations(head_dim)))
        return kvcache.LayerSpec(key, value, group=1, residual=0)

    def layouts(self, head_dim: int):
        def codes(t: str) -> TensorCodes:
            return TensorCodes(16, "static") if t == "f16" else TensorCodes(BITS[t], "token", 32, meta_bytes=2)

        return codes(self.types[0]), codes(self.types[1])
