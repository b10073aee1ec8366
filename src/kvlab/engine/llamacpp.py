"""llama.cpp's own KV caches on the same prompt token ids: greedy answers, first-answer-step logits and the cache's
bytes as llama.cpp reports them, per cache type (K and V separately: f16, q8_0, q4_0, ...).

Runs in the engine's own environment (`make llamacpp-env`: .venv-llamacpp with llama-cpp-python, never the main
venv, whose kvpress pins transformers), so it imports nothing of kvlab: stdlib, numpy and llama_cpp only.

    .venv-llamacpp/bin/python src/kvlab/engine/llamacpp.py REQUEST.json ANSWERS.json

REQUEST: {"gguf": path, "threads": int, "n_ctx": int, "caches": {name: [type_k, type_v]},
          "samples": [{"sample_id": str, "prompt": [token ids], "max_new_tokens": int}]}
ANSWERS: {"llama_cpp": version, "caches": {name: {"type_k", "type_v", "kv_bytes_engine": the bytes llama.cpp's
          `llama_kv_cache` log line reports, "kv_bytes_formula": the block layout's bytes for n_ctx cells,
          "answers": {sample_id: {"ids": generated ids, "logprobs": log-softmax at the first answer step (float32
          list), "seconds": float}}}}}
Greedy is the argmax of llama.cpp's logits at each step (no sampler); the prompt is evaluated as token ids.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import time

# llama.cpp's block formats (ggml-common.h): bytes per block of values along a row (head_dim here)
BLOCKS = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
          "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18)}
MIB_LINE = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers")


def row_bytes(cache_type: str, values: int) -> int:
    """Bytes of `values` consecutive values (one token's K or V of a layer) in llama.cpp's `cache_type` blocks."""
    per, size = BLOCKS[cache_type]
    if values % per:
        raise ValueError(f"cache type {cache_type} packs {per} values per block; a row of {values} does not divide")
    return values // per * size


def ggml_type(llama_cpp, name: str) -> int:
    return getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")


class Log:
    """llama.cpp's log lines, caught by a log callback (kept referenced while the library may call it)."""

    def __init__(self, llama_cpp):
        self.text = []

        @llama_cpp.llama_log_callback
        def catch(level, message, user_data):
            self.text.append(message.decode("utf-8", "replace"))

        self.callback = catch
        llama_cpp.llama_log_set(catch, ctypes.c_void_p(0))

    def kv_mib(self) -> tuple[float, int, int]:
        """(MiB, cells, layers) of the last `llama_kv_cache: size = ...` line."""
        found = MIB_LINE.findall("".join(self.text))
        if not found:
            raise RuntimeError("llama.cpp logged no 'llama_kv_cache: size' line; its log format changed")
        mib, cells, layers = found[-1]
        return float(mib), int(cells), int(layers)


def log_softmax(logits):
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


def answer(llm, prompt: list[int], max_new_tokens: int, eos: int) -> tuple[list[int], list[float]]:
    """Greedy ids after `prompt` (argmax of the logits, stopping at EOS or the cap) and the first step's log-softmax."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    ids, first = [], None
    for _ in range(max_new_tokens):
        # the last evaluated token's logits (llm.scores keeps them only with logits_all, which holds every position)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
        if first is None:
            first = log_softmax(logits)
        token = int(np.argmax(logits))
        ids.append(token)
        if token == eos:
            break
        llm.eval([token])
    return ids, first


def run(request: dict) -> dict:
    import llama_cpp
    import numpy as np

    log = Log(llama_cpp)
    out = {"llama_cpp": llama_cpp.__version__, "caches": {}}
    for name, (type_k, type_v) in request["caches"].items():
        log.text.clear()
        llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=request["n_ctx"], n_batch=512, n_threads=request["threads"],
                              n_threads_batch=request["threads"], seed=0, type_k=ggml_type(llama_cpp, type_k),
                              type_v=ggml_type(llama_cpp, type_v), flash_attn=True, logits_all=False, verbose=True)
        mib, cells, layers = log.kv_mib()
        model = llm.model
        heads, head_dim = llama_cpp.llama_model_n_head_kv(model), llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        formula = cells * layers * heads * (row_bytes(type_k, head_dim) + row_bytes(type_v, head_dim))
        answers = {}
        for s in request["samples"]:
            t0 = time.perf_counter()
            ids, first = answer(llm, s["prompt"], s["max_new_tokens"], llm.token_eos())
            answers[s["sample_id"]] = {"ids": ids, "logprobs": np.asarray(first).tolist(), "seconds": time.perf_counter() - t0}
        out["caches"][name] = {"type_k": type_k, "type_v": type_v, "kv_bytes_engine": round(mib * 2**20), "kv_mib_engine": mib,
                               "kv_cells": cells, "layers": layers, "kv_heads": heads, "head_dim": head_dim,
                               "kv_bytes_formula": formula, "answers": answers}
        llm.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python llamacpp.py REQUEST.json ANSWERS.json")
    with open(sys.argv[1]) as f:
        req = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run(req), f)
