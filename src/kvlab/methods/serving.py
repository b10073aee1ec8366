"""Serving engines' own KV caches as method kinds: the engine answers the job's prompts (the same token ids, greedy)
with its default cache, the job's reference, and with the configured one. ``llamacpp``: llama.cpp's cache types
(`--cache-type-k/-v`), run by kvlab.engine.llamacpp on the model's GGUF file; ``vllm``: vLLM's cache dtypes
(`--kv-cache-dtype`), run by kvlab.engine.vllm_runner on the model folder kvlab evaluates. Each runs in its engine's own
environment (`make llamacpp-env`, `make vllm-env`). Their rows are those of every method (kvlab.steps.serve), under a
model of their own (``<model>@<engine>``: the engine's default cache is that model's full cache).

A kind here (a `ServingKind`) says what its engine is called (`label`), which runner script runs it (`runner`),
whether it reads the model's GGUF file (`reads_gguf`) and the dtype it computes in (`compute_dtype`), what it is asked
(`cache`), what its default cache is (`REFERENCE`), the bytes of a token in a cache the runner describes (`cache_bytes`) and the check of that formula
against the engine's own figure (`check_bytes`), and why a machine cannot run it (`refusal`, asked of the selected
preset's methods before any job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.methods.base import MethodKind, MethodParams
from kvlab.util.params import param, shared

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


class ServingKind(MethodKind):
    """A serving engine's cache (see the module's docstring)."""

    engine: ClassVar[str]
    label: ClassVar[str]  # the engine's name in logs, rows and the report
    runner: ClassVar[str]  # its runner script in kvlab/engine/, run by the engine's own python, never imported
    reads_gguf: ClassVar[bool] = False  # the model's GGUF file (rule gguf); else the model folder kvlab evaluates
    REFERENCE: ClassVar[object]  # what the engine is asked for its default cache, the engine's own "full"

    @staticmethod
    def compute_dtype(run_dtype: str) -> str:
        """The dtype the engine computes in, for a run of `run_dtype` (the rows' dtype column)."""
        return run_dtype

    @property
    def cache(self) -> object:
        """What the engine's runner is asked for this cache (its REQUEST's `caches` values)."""
        raise NotImplementedError

    @staticmethod
    def cache_bytes(info: dict) -> int:
        """Bytes one token's K and V take in every layer of the cache the runner describes (ANSWERS' `caches`)."""
        raise NotImplementedError

    @classmethod
    def check_bytes(cls, name: str, info: dict) -> None:
        """Raise RuntimeError (one line) where `cache_bytes` disagrees with the engine's own figure in `info`."""
        raise NotImplementedError


class LlamaCpp(ServingKind):
    """llama.cpp's KV cache of `cache_type_k` keys and `cache_type_v` values (flash attention on, as a quantized V
    needs); its reference is llama.cpp's f16 cache of the same GGUF model."""

    name = "llamacpp"
    engine: ClassVar[str] = "llamacpp"
    label: ClassVar[str] = "llama.cpp"
    runner: ClassVar[str] = "llamacpp.py"
    reads_gguf: ClassVar[bool] = True
    REFERENCE: ClassVar[tuple[str, str]] = ("f16", "f16")  # llama.cpp's default cache: the engine's own "full"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        cache_type_k: str = param(doc="llama.cpp's --cache-type-k: f16 | bf16 | f32 | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | iq4_nl",
                                  **CACHE_TYPE)
        cache_type_v: str = param(doc="llama.cpp's --cache-type-v (the same types)", **CACHE_TYPE)
        kvlab_twin: str | None = param(
            None, "a kvlab method of this config that simulates this cache: the report compares their answers prompt by "
            "prompt (README \"Your serving engine\")", pattern=r"^[A-Za-z0-9_.\-]+$")

    @staticmethod
    def compute_dtype(run_dtype: str) -> str:
        return "float32"  # ggml's CPU matmuls: quantized weights, fp32 activations

    @property
    def cache(self) -> list[str]:
        return [self.params["cache_type_k"], self.params["cache_type_v"]]

    @staticmethod
    def cache_bytes(info: dict) -> int:
        return token_bytes((info["type_k"], info["type_v"]), info["layers"], info["kv_heads"], info["head_dim"])

    @classmethod
    def check_bytes(cls, name: str, info: dict) -> None:
        """llama.cpp logs its cache's MiB for its cells to two decimals (ANSWERS' kv_mib_engine, kv_cells)."""
        formula = info["kv_cells"] * cls.cache_bytes(info)
        if abs(formula / 2**20 - info["kv_mib_engine"]) > 0.005 + 1e-9:
            raise RuntimeError(f"llama.cpp reports {info['kv_mib_engine']} MiB for {info['kv_cells']} cells of cache "
                               f"{name}, the block layout {formula / 2**20:.4f} MiB: kvlab.methods.serving's layout is wrong")

    @property
    def storage(self) -> dict:
        """The row's scheme: the cache types; bits: stored bits per value, K and V averaged (q4_0: 4.5)."""
        k, v = self.cache
        bits = sum(8 * LLAMACPP_BLOCKS[t][1] / LLAMACPP_BLOCKS[t][0] for t in (k, v)) / 2
        return {"scheme": f"llama.cpp {k}/{v}", "bits": bits, "key_axis": "token", "value_axis": "token", "policy": None}


# vLLM's KV cache dtypes kvlab runs (vllm/config/cache.py CacheDType), and the bytes one stored value takes: `auto`
# stores the model's dtype (None: the run's), the FP8 ones one byte per value with a per-tensor scale (a float per
# layer, not counted per token). vLLM's per-token-head, TurboQuant and NVFP4 layouts are left out: their scale
# layouts differ per backend and no machine of this project could run one to check kvlab's formula against.
VLLM_DTYPES = {"auto": None, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
VLLM_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


def vllm_token_bytes(kv_cache_dtype: str, model_dtype: str, layers: int, heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in every layer of a vLLM cache of `kv_cache_dtype` (`auto`: the model's dtype)."""
    import torch

    size = VLLM_DTYPES[kv_cache_dtype] or getattr(torch, model_dtype).itemsize
    return layers * heads * 2 * head_dim * size


class Vllm(ServingKind):
    """vLLM's KV cache of `kv_cache_dtype` (vLLM's `--kv-cache-dtype`); its reference is vLLM's `auto` cache (the
    model's own dtype) of the same model folder kvlab evaluates. vLLM's FP8 scales are its defaults (1.0 unless the
    checkpoint carries some): the twin to compare is kvlab's fp8 with the same scales."""

    name = "vllm"
    engine: ClassVar[str] = "vllm"
    label: ClassVar[str] = "vLLM"
    runner: ClassVar[str] = "vllm_runner.py"  # not vllm.py, which would shadow the package it imports
    REFERENCE: ClassVar[str] = "auto"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        kv_cache_dtype: str = param(doc="vLLM's --kv-cache-dtype: " + " | ".join(VLLM_DTYPES), enum=list(VLLM_DTYPES))
        kvlab_twin: str | None = shared(LlamaCpp.Params, "kvlab_twin")

    @property
    def cache(self) -> str:
        return self.params["kv_cache_dtype"]

    @staticmethod
    def cache_bytes(info: dict) -> int:
        return vllm_token_bytes(info["kv_cache_dtype"], info["dtype"], info["layers"], info["kv_heads"], info["head_dim"])

    @classmethod
    def check_bytes(cls, name: str, info: dict) -> None:
        """vLLM's own figure: its KV cache spec's bytes per page over the page's tokens, summed over the layers
        (ANSWERS' token_bytes_engine)."""
        if cls.cache_bytes(info) != info["token_bytes_engine"]:
            raise RuntimeError(f"vLLM's cache spec gives {info['token_bytes_engine']} bytes per token for cache {name}, "
                               f"kvlab's formula {cls.cache_bytes(info)}: kvlab.methods.serving's vLLM layout is wrong")

    @property
    def storage(self) -> dict:
        """The row's scheme: vLLM's cache dtype; bits: stored bits per value (None for `auto`: the model's dtype)."""
        size = VLLM_DTYPES[self.cache]
        return {"scheme": f"vLLM {self.cache}", "bits": 8 * size if size else None, "key_axis": "tensor",
                "value_axis": "tensor", "policy": None}

    def refusal(self, device: str) -> str | None:
        """Why this machine cannot run the cache, and what would run it; None where it can. vLLM's CPU attention
        (vllm/v1/attention/backends/cpu_attn.py) supports the caches `auto` and FP8, and FP8 only on a CPU with
        AVX-512 or AMX (its own check). It accepts `float16`/`bfloat16` without a word but reads that cache as the
        model's dtype: on Qwen2.5-0.5B in float32 a bfloat16 cache answered garbage (KL 8 nats against `auto`)."""
        from kvlab.util.hardware import avx512_or_amx

        if device == "cpu" and self.cache in VLLM_FP8 and not avx512_or_amx():
            return (f"vLLM's CPU backend refuses a {self.cache} KV cache on a CPU without AVX-512 or AMX, as this one is; "
                    f"run it on an AVX-512/AMX CPU or with device: cuda on a GPU, or leave the method out")
        if device == "cpu" and self.cache not in ("auto", *VLLM_FP8):
            return (f"vLLM's CPU attention has no {self.cache} KV cache (it supports auto and fp8, and reads any other "
                    f"as the model's dtype); run it with device: cuda on a GPU, or leave the method out")
        return None
