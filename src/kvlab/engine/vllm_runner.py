"""vLLM's own KV caches on the same prompt token ids: greedy answers, KL along a path and the cache's bytes as vLLM's
KV cache spec gives them, per cache dtype (vLLM's --kv-cache-dtype: auto, fp8_e4m3, ...).

Runs in the engine's own environment (`make vllm-env`: .venv-vllm with vLLM, never the main venv, whose kvpress pins
transformers below vLLM's), so it imports nothing of kvlab: stdlib, numpy and vllm only.

    .venv-vllm/bin/python src/kvlab/engine/vllm_runner.py REQUEST.json ANSWERS.json

(Not vllm.py: a script of that name would shadow the vllm package it imports.)

REQUEST: {"model": the model folder kvlab evaluates, "dtype": the model's dtype, "device": "cpu" | "cuda", "threads",
          "n_ctx": the longest prompt and answer, "eos": [the token ids an answer stops at],
          "reference": the cache every other is compared with, "caches": {name: kv_cache_dtype},
          "prompts": [{"id", "prompt": [token ids], "max_new_tokens", "path": [token ids] or null, "continues"}]}
ANSWERS: {"engine": "vLLM <version>", "caches": {name: {"kv_cache_dtype", "dtype", "layers", "kv_heads", "head_dim",
          "token_bytes_engine": bytes per token of vLLM's KV cache spec (every layer's page bytes over its tokens),
          "kv_cells": the tokens vLLM's cache holds, "kv_mib_engine": their MiB, "answers": {id: {"ids", "diverged_at",
          "kl_vs_full", "kl_max", "nll", "tf_tokens", "decode_s", "teacher_forced_s"}}}}}

Each cache is one vLLM engine, in a process of its own (the reference first), that answers every prompt greedily
(temperature 0, up to EOS or the cap) and scores a path after it in one prefill: the prompt's `path` where it has one
(a prose reference text), else the reference's own answer. vLLM returns no whole logit vectors at a useful cost
(and prompt_logprob_token_ids needs its V2 model runner, which needs Triton: not on a CPU), so each cache's scoring keeps
its TOP most likely tokens per step and the path's token (prompt_logprobs), and KL(reference ‖ cache) is taken over
the tokens both keep and one bin for the rest of the vocabulary: a lower bound of the full KL (grouping outcomes
never raises a KL), short of it by the mass outside the tokens both keep. A cache's own greedy answer is its answer; `diverged_at` is where it first
leaves the reference's (greedy decoding by either follows the other's tokens exactly until their argmaxes differ).
A later turn (`continues`) shares its earlier turns' tokens, which vLLM's prefix cache keeps, as in serving.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

TOP = 64  # a cache's most likely tokens per step kept by its scoring (KL: over those both keep, one bin for the rest)


def engine(request: dict, kv_cache_dtype: str):
    """vLLM's engine of `request`'s model with a `kv_cache_dtype` cache, in this process."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if request["device"] == "cpu" else "auto")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends cache_info's function to the worker
    if request["device"] == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the CPU backend's cache, ample for one job's prompts
        os.environ.setdefault("OMP_NUM_THREADS", str(request["threads"]))
    from vllm import LLM

    return LLM(model=request["model"], dtype=request["dtype"], kv_cache_dtype=kv_cache_dtype, max_model_len=request["n_ctx"],
               seed=0, enforce_eager=True, max_logprobs=TOP + 1, gpu_memory_utilization=0.4)


def cache_info(llm, request: dict, kv_cache_dtype: str) -> dict:
    """The cache's geometry and vLLM's own size figures: the KV cache spec of every attention layer (bytes per page of
    `block_size` tokens) and the tokens vLLM's cache holds."""
    def spec(worker):
        return {name: (s.page_size_bytes, s.block_size, s.num_kv_heads, s.head_size)
                for name, s in worker.model_runner.get_kv_cache_spec().items()}

    layers = llm.collective_rpc(spec)[0]
    page_bytes = sum(p / b for p, b, _, _ in layers.values())
    _, _, heads, head_dim = next(iter(layers.values()))
    cache = llm.llm_engine.vllm_config.cache_config
    cells = cache.num_gpu_blocks * cache.block_size
    return {"kv_cache_dtype": kv_cache_dtype, "dtype": request["dtype"], "layers": len(layers), "kv_heads": heads,
            "head_dim": head_dim, "token_bytes_engine": int(round(page_bytes)), "kv_cells": cells,
            "kv_mib_engine": round(cells * page_bytes / 2**20, 2)}


def answer_all(llm, request: dict) -> tuple[dict, float]:
    """Every prompt's greedy answer (its token ids, EOS kept as kvlab's engine keeps it) and the seconds they took."""
    from vllm import SamplingParams, TokensPrompt

    asked = [p for p in request["prompts"] if p["max_new_tokens"]]
    params = [SamplingParams(temperature=0.0, max_tokens=p["max_new_tokens"], stop_token_ids=request["eos"],
                             detokenize=False) for p in asked]  # token ids are the answer; kvlab decodes them
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p["prompt"]) for p in asked], params, use_tqdm=False)
    ids = {p["id"]: list(o.outputs[0].token_ids) for p, o in zip(asked, outs)}
    return {p["id"]: ids.get(p["id"], []) for p in request["prompts"]}, time.perf_counter() - t0


def score_all(llm, request: dict, paths: dict) -> tuple[dict, float]:
    """Each prompt's path scored in one prefill of prompt + path: per step of the path, the log-probabilities of the
    cache's TOP most likely tokens and of the path's token (vLLM's prompt_logprobs)."""
    from vllm import SamplingParams, TokensPrompt

    asked = [p for p in request["prompts"] if paths[p["id"]]]
    prompts = [TokensPrompt(prompt_token_ids=p["prompt"] + paths[p["id"]]) for p in asked]
    t0 = time.perf_counter()
    # detokenize=False: no text made for the TOP tokens of every prompt position (kvlab reads token ids only)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=TOP, detokenize=False), use_tqdm=False)
    scored = {}
    for p, o in zip(asked, outs):
        steps = o.prompt_logprobs[len(p["prompt"]) :]  # the predictions of the path's tokens
        scored[p["id"]] = {"logp": [{str(t): s[t].logprob for t in s} for s in steps],
                           "path_logp": [s[t].logprob for s, t in zip(steps, paths[p["id"]])]}
    return scored, time.perf_counter() - t0


def kl_binned(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p ‖ q) over the tokens whose log-probabilities both give, and one bin for the rest of each distribution."""
    both = [t for t in p if t in q]
    kl = sum(math.exp(p[t]) * (p[t] - q[t]) for t in both)
    rest_p = max(0.0, 1 - sum(math.exp(p[t]) for t in both))
    rest_q = max(1e-30, 1 - sum(math.exp(q[t]) for t in both))
    return max(0.0, kl + (rest_p * math.log(rest_p / rest_q) if rest_p > 0 else 0.0))


def divergence(ref: dict | None, mine: dict | None) -> dict:
    """Per-step KL(reference ‖ cache) over the tokens both scorings give, and the cache's NLL of the path."""
    if mine is None:
        return {"kl_vs_full": None, "kl_max": None, "nll": None, "tf_tokens": 0}
    kl = [kl_binned(p, q) for p, q in zip(ref["logp"], mine["logp"])]
    nll = [-a for a in mine["path_logp"]]
    return {"kl_vs_full": sum(kl) / len(kl), "kl_max": max(kl), "nll": sum(nll) / len(nll), "tf_tokens": len(nll)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ (one ending first counts), None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def read_cache(request: dict, name: str, reference: dict | None) -> dict:
    """One cache's answers to every prompt (see the module's docstring); `reference`: the reference cache's, with its
    scoring, None when this cache is the reference."""
    import vllm

    kv_cache_dtype = request["caches"][name]
    llm = engine(request, kv_cache_dtype)
    info = cache_info(llm, request, kv_cache_dtype)
    ids, decode_s = answer_all(llm, request)
    ref_ids = ids if reference is None else {k: a["ids"] for k, a in reference["answers"].items()}
    paths = {p["id"]: p["path"] or ref_ids[p["id"]] for p in request["prompts"]}
    scored, tf_s = score_all(llm, request, paths)
    ref_scored = scored if reference is None else reference["scored"]
    answers = {}
    for p in request["prompts"]:
        key, share = p["id"], len(request["prompts"])
        left = None if reference is None or p["path"] else first_difference(ids[key], ref_ids[key])
        answers[key] = {"ids": ids[key], "diverged_at": left, **divergence(ref_scored.get(key), scored.get(key)),
                        "decode_s": decode_s / share, "teacher_forced_s": tf_s / share}
    print(f"cache {name} ({kv_cache_dtype}): {len(answers)} prompts answered in {decode_s:.1f} s, scored in {tf_s:.1f} s",
          flush=True)  # the job's log shows it (kvlab.steps.serve)
    return {**info, "engine": f"vLLM {vllm.__version__}", "answers": answers, "scored": scored}


def run(request: dict, runner: str) -> dict:
    """Every cache of `request`, each in a process of its own (vLLM holds its device until its process ends): the
    reference first, whose answers and scoring the others are read against."""
    out, reference = {}, None
    order = [request["reference"]] + [n for n in request["caches"] if n != request["reference"]]
    for name in order:
        one = {**request, "_cache": name, "_reference": reference}
        with open(runner + ".one.json", "w") as f:
            json.dump(one, f)
        subprocess.run([sys.executable, __file__, "--one", runner + ".one.json", runner + ".cache.json"], check=True)
        with open(runner + ".cache.json") as f:
            out[name] = json.load(f)
        if name == request["reference"]:
            reference = out[name]
    engine_label = out[request["reference"]]["engine"]
    for cache in out.values():
        cache.pop("scored")
        cache.pop("engine")
    return {"engine": engine_label, "caches": out}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        with open(sys.argv[2]) as f:
            one = json.load(f)
        result = read_cache(one, one["_cache"], one["_reference"])
        with open(sys.argv[3], "w") as f:
            json.dump(result, f)
    elif len(sys.argv) == 3:
        with open(sys.argv[1]) as f:
            req = json.load(f)
        answers = run(req, sys.argv[2])  # the file is written only once every cache has read every prompt
        with open(sys.argv[2], "w") as f:
            json.dump(answers, f)
    else:
        sys.exit("usage: python vllm_runner.py REQUEST.json ANSWERS.json")
