"""llama.cpp's own KV caches on the same prompt token ids: greedy answers, KL along a path and the cache's bytes as
llama.cpp reports them, per cache type (K and V separately: f16, q8_0, q4_0, ...).

Runs in the engine's own environment (`make llamacpp-env`: .venv-llamacpp with llama-cpp-python, never the main
venv, whose kvpress pins transformers), so it imports nothing of kvlab: stdlib, numpy and llama_cpp only.

    .venv-llamacpp/bin/python src/kvlab/engine/llamacpp.py REQUEST.json ANSWERS.json

REQUEST: {"gguf": path, "threads": int, "n_ctx": int, "eos": [the token ids an answer stops at],
          "reference": the cache every other is compared with,
          "caches": {name: [type_k, type_v]},
          "prompts": [{"id": str, "prompt": [token ids], "max_new_tokens": int, "path": [token ids] or null,
                       "continues": whether it is a later turn of the prompt before it (its cells then reused)}]}
ANSWERS: {"engine": "llama.cpp <version>", "caches": {name: {"type_k", "type_v", "kv_mib_engine": the MiB llama.cpp's
          `llama_kv_cache` log line reports for its "kv_cells" cells (to two decimals), "layers", "kv_heads",
          "head_dim", "answers": {id: {"ids": generated ids, "diverged_at",
          "kl_vs_full", "kl_max", "nll", "tf_tokens", "decode_s", "teacher_forced_s"}}}}}

Each prompt is read the way kvlab's engine reads one (kvlab.engine.verify): the reference cache answers greedily (the
argmax of llama.cpp's logits at each step, no sampler, up to EOS or the cap); every other cache is fed along a path,
one token at a time, and its per-token KL(reference ‖ cache) and NLL read there: the prompt's `path` where it has one
(a prose reference text), else the reference's own answer. Where a cache's argmax first leaves the reference's answer
(`diverged_at`), its cells from there on are dropped and it answers on greedily by itself. A prompt of
max_new_tokens 0 is only read along its path (prose: no answer).
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import time

MIB_LINE = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers")


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
    return x - np.log(np.exp(x).sum())


class Cache:
    """One llama.cpp context of the model with one cache type: its token-by-token reading."""

    def __init__(self, llama_cpp, request: dict, type_k: str, type_v: str, log: Log):
        """llama.cpp's context of `request`'s model with cache types `type_k` and `type_v`, its cache's size read
        off llama.cpp's own log line."""
        log.text.clear()
        self.llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=request["n_ctx"], n_batch=512, n_threads=request["threads"],
                                   n_threads_batch=request["threads"], seed=0, type_k=ggml_type(llama_cpp, type_k),
                                   type_v=ggml_type(llama_cpp, type_v), flash_attn=True, logits_all=False, verbose=False)
        mib, cells, layers = log.kv_mib()
        model = self.llm.model
        heads = llama_cpp.llama_model_n_head_kv(model)
        head_dim = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        self.info = {"type_k": type_k, "type_v": type_v, "kv_mib_engine": mib, "kv_cells": cells, "layers": layers,
                     "kv_heads": heads, "head_dim": head_dim}
        self.eos = set(request["eos"])

    def logprobs(self):
        """The log-softmax of the last evaluated token's logits (float64)."""
        import numpy as np

        llm = self.llm
        return log_softmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)))

    def start(self, prompt: list[int], reuse: bool = False):
        """The cache holding `prompt` alone; the log-probabilities of the token after it. With `reuse` (a later turn of
        the same sample), the cells of the longest prefix it shares with what the cache holds are kept, as a serving
        engine's prefix cache keeps them; else, and beyond that prefix, `prompt` is evaluated afresh (at least its last
        token), so that no sample's reading depends on the sample before it."""
        llm = self.llm
        same = 0
        for held, token in zip(llm.input_ids[: llm.n_tokens].tolist() if reuse else [], prompt):
            if held != token:
                break
            same += 1
        llm.n_tokens = min(same, len(prompt) - 1)  # Llama.eval drops the cells from n_tokens on
        llm.eval(prompt[llm.n_tokens :])
        return self.logprobs()

    def greedy(self, first, ids: list[int], cap: int) -> tuple[list[int], list]:
        """`ids` continued greedily (from `first`, the log-probabilities after them) up to EOS or `cap` ids in all,
        and the log-probabilities each new id was chosen from."""
        import numpy as np

        logp, steps = first, []
        while len(ids) < cap:
            token = int(np.argmax(logp))
            ids.append(token)
            steps.append(logp)
            if token in self.eos or len(ids) == cap:
                break
            self.llm.eval([token])
            logp = self.logprobs()
        return ids, steps

    def along(self, first, path: list[int]) -> tuple[list, int | None]:
        """Fed `path` one token at a time: the log-probabilities before each of its tokens, and the first position
        whose argmax is not the path's token (None: none)."""
        import numpy as np

        steps, left, logp = [], None, first
        for t, token in enumerate(path):
            steps.append(logp)
            if left is None and int(np.argmax(logp)) != token:
                left = t
            if t + 1 < len(path):
                self.llm.eval([token])
                logp = self.logprobs()
        return steps, left


def divergence(ref: list, steps: list, path: list[int]) -> dict:
    """Per-token KL(reference ‖ cache) and the cache's NLL of the path, as kvlab's rows carry them."""
    import numpy as np

    if not path:
        return {"kl_vs_full": None, "kl_max": None, "nll": None, "tf_tokens": 0}
    kl = [float((np.exp(p) * (p - q)).sum()) for p, q in zip(ref, steps)]
    nll = [-float(q[token]) for q, token in zip(steps, path)]
    return {"kl_vs_full": float(np.mean(kl)), "kl_max": float(max(kl)), "nll": float(np.mean(nll)), "tf_tokens": len(path)}


def read_prompt(ref: Cache, others: dict[str, Cache], p: dict) -> dict[str, dict]:
    """One prompt through the reference cache and every other (see the module's docstring)."""
    t0 = time.perf_counter()
    reuse = p.get("continues", False)
    answer, ref_steps = ref.greedy(ref.start(p["prompt"], reuse), [], p["max_new_tokens"]) if p["max_new_tokens"] else ([], [])
    decode_s = time.perf_counter() - t0
    path = p["path"] if p.get("path") else answer  # else: its own answer, read by the steps it chose each token from
    t0 = time.perf_counter()
    if p.get("path"):  # a path of its own: the reference read along it as well
        ref_steps, _ = ref.along(ref.start(p["prompt"], reuse=bool(p["max_new_tokens"]) or reuse), path)
    out = {"reference": {"ids": answer, "diverged_at": None, **divergence(ref_steps, ref_steps, path), "decode_s": decode_s,
                         "teacher_forced_s": time.perf_counter() - t0}}
    for name, cache in others.items():
        t0 = time.perf_counter()
        steps, left = cache.along(cache.start(p["prompt"], reuse), path)
        tf_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = answer
        if p.get("path"):  # read along its own path: any answer decoded by the cache alone
            ids = cache.greedy(cache.start(p["prompt"], reuse=True), [], p["max_new_tokens"])[0] if p["max_new_tokens"] else []
        elif left is not None:  # its own answer from the first token it chose otherwise
            cache.llm.n_tokens = len(p["prompt"]) + left  # cells from there on dropped at the next eval
            ids = cache.greedy(steps[left], list(answer[:left]), p["max_new_tokens"])[0]
        out[name] = {"ids": ids, "diverged_at": left if not p.get("path") else None, **divergence(ref_steps, steps, path),
                     "decode_s": time.perf_counter() - t0, "teacher_forced_s": tf_s}
    return out


def run(request: dict) -> dict:
    import llama_cpp

    log = Log(llama_cpp)
    caches = {name: Cache(llama_cpp, request, k, v, log) for name, (k, v) in request["caches"].items()}
    ref = caches[request["reference"]]
    others = {name: c for name, c in caches.items() if name != request["reference"]}
    out = {"engine": f"llama.cpp {llama_cpp.__version__}", "caches": {name: {**c.info, "answers": {}} for name, c in caches.items()}}
    for i, p in enumerate(request["prompts"], start=1):
        t0 = time.perf_counter()
        for name, answer in read_prompt(ref, others, p).items():
            out["caches"][request["reference"] if name == "reference" else name]["answers"][p["id"]] = answer
        print(f"prompt {i}/{len(request['prompts'])} ({len(p['prompt'])} tokens) read by {len(caches)} caches in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)  # the job's log shows it (kvlab.steps.serve)
    for c in caches.values():
        c.llm.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python llamacpp.py REQUEST.json ANSWERS.json")
    with open(sys.argv[1]) as f:
        req = json.load(f)
    answers = run(req)  # the file is written only once every prompt is read
    with open(sys.argv[2], "w") as f:
        json.dump(answers, f)
