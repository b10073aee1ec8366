"""The GPU device check's own steps (gpu/check.sh runs them on a bare GPU machine; README "GPU check"):

* ``e2e``: one end-to-end decode point — a model with Qwen2.5-0.5B's configuration and random weights (the
  real weights are not on the device machine; decode time does not depend on their values) prefills a random
  context once; the dense cache and its KIVI INT4 compression are each decoded as a batch of copies, eagerly and
  as one step replayed from a CUDA graph (``benchmark.graph_step``). One Parquet row per cache.
* ``memory``: one evaluation sample at 8K (niah_single, the `long` preset's methods) on the same random model, in the
  waves kvlab.state.memory plans: the peak allocated beside the memory model's prediction. One Parquet row.
* ``summary``: one screen of the decode-kernel rows (``python -m kvlab.steps.kernel_bench``) and the end-to-end rows
  against the targets of issue 23, PASS or FAIL each.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

# Qwen2.5-0.5B's config.json (sizes, RoPE base, norm epsilon); head_dim 896 / 14 = 64.
QWEN2_5_0_5B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "tie_word_embeddings": True,
}
E2E_MODEL = "Qwen2.5-0.5B config, random weights"
KIVI4 = {"scheme": "kivi", "bits": 4, "group": 32, "residual": 32, "key_axis": "channel", "value_axis": "token"}
LLAMA_8B = (8, 32, 128)  # the layer the kernel targets are read at: KV heads, query heads, head dim
H200_GB_PER_S = 4800.0  # H200 HBM3e, nominal


def e2e(context: int, batch: int, new_tokens: int, device: str, dtype: str, layers: int) -> pd.DataFrame:
    """Rows (cache: dense, in `dtype`, or int4) of decoding `batch` copies of one prefilled `context`-token cache,
    the model Qwen2.5-0.5B's but for its number of `layers` (24: the real one's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvlab.steps.benchmark import GRAPH_REPLAYS, graph_step
    from kvlab.engine import ATTENTION, cache_stats, compress, decode_path, greedy_decode, host_free_step, prefill
    from kvlab.util.hardware import device_name
    from kvlab.methods import Variant

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **{**QWEN2_5_0_5B, "num_hidden_layers": layers})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation=ATTENTION)
    model.eval().requires_grad_(False)
    ids = torch.randint(config.vocab_size, (context + 3,), generator=torch.Generator().manual_seed(0)).tolist()
    tail = ids[context:]
    base = prefill(model, ids[:context])
    label = E2E_MODEL if layers == QWEN2_5_0_5B["num_hidden_layers"] else f"{E2E_MODEL}, {layers} layers"
    steps = max(new_tokens, 4)  # the graph replays the fourth step; eager decoding must reach it
    rows = []
    for name, variant in {"dense": Variant("full", "full", 1.0), "int4": Variant("kivi4", "quant", 1.0, KIVI4)}.items():
        caches = [compress(model, base, variant)] * batch
        greedy_decode(model, caches, tail, base.length, 2, stop=False)  # warm-up: kernels compiled
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        eager = greedy_decode(model, caches, tail, base.length, steps, stop=False)
        if device == "cuda":
            torch.cuda.synchronize()
        eager_s = time.perf_counter() - t0
        graph_ms, same = math.nan, None
        if device == "cuda" and host_free_step(caches, model.device):
            with torch.no_grad():
                seconds, tokens = graph_step(model, caches, tail, base.length, GRAPH_REPLAYS)
            graph_ms, same = seconds * 1e3, tokens == [row[3] for row in eager]
        rows.append({
            "model": label, "cache": name, "context_tokens": context, "batch": batch, "new_tokens": steps,
            "eager_tokens_per_s": batch * steps / eager_s, "graph_step_ms": graph_ms,
            "graph_tokens_per_s": batch / graph_ms * 1e3, "graph_equals_eager": same,
            "kv_bytes": cache_stats(caches[0], variant, base.length)["kv_bytes"],
            "decode_path": decode_path(caches[0], model.device), "dtype": dtype, "device": device_name(device),
        })
    return pd.DataFrame(rows)


# The `long` preset's methods (config.yaml), every parameter given (no config or schema on the device machine); FP8
# takes dynamic scales in place of calibrated ones (the same bytes: memory does not depend on the scales' values).
LONG_METHODS = {
    "full": {"kind": "full"},
    "fp8": {"kind": "quant", "scheme": "fp8", "scales": "dynamic"},
    **{f"kivi{b}": {"kind": "quant", **KIVI4, "bits": b} for b in (4, 2)},
    "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 32, "kernel_size": 5}},
    "pyramidkv": {"kind": "kvpress", "press": "PyramidKVPress", "kwargs": {"window_size": 32, "kernel_size": 5}},
    "streaming_llm": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}},
}


def memory(context: int, device: str, dtype: str, layers: int, share: float) -> pd.DataFrame:
    """One evaluation sample (niah_single, depth 0.5, both question modes, the `long` methods at 25%) on a model with
    Qwen2.5-0.5B's configuration and random weights, its variants in the waves kvlab.state.memory plans under `share` of the
    free device memory: the peak the engine allocated over the loaded model (torch.cuda.max_memory_allocated; on a
    CPU, peak RSS is not tracked here: benchmarks/long_memory.py) beside the memory model's prediction. One row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvlab.engine import ATTENTION, Reading, Scope, evaluate_samples
    from kvlab.util.hardware import device_name
    from kvlab.state.memory import GB, job_waves
    from kvlab.methods import build, variants
    from kvlab.models.tiny import byte_level_tokenizer
    from kvlab.tasks import KINDS

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **{**QWEN2_5_0_5B, "num_hidden_layers": layers})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation=ATTENTION)
    model.eval().requires_grad_(False)
    tokenizer = byte_level_tokenizer()  # one token per byte: a context of `context` tokens whatever the weights
    (sample,) = KINDS["niah"].generate("niah_single", {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 0}, tokenizer, context)
    grid = variants(build(LONG_METHODS), [0.25])
    run = {"memory": {"share": share}, "device": device, "dtype": dtype, "question_modes": ["agnostic", "aware"]}
    loaded = torch.cuda.memory_allocated() if device == "cuda" else 0
    waves = job_waves(model, run, grid, sample.prompt.tokens, 16, floor=False)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rows = evaluate_samples(model, tokenizer, [sample], grid, run["question_modes"], 16, Reading(noise_samples=1),
                            Scope(waves=waves))
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - loaded if device == "cuda" else math.nan
    return pd.DataFrame([{
        "model": E2E_MODEL if layers == QWEN2_5_0_5B["num_hidden_layers"] else f"{E2E_MODEL}, {layers} layers",
        "context_tokens": sample.prompt.tokens, "variants": len(grid), "waves": rows[0]["waves"], "rows": len(rows),
        "peak_over_loaded_gb": peak / GB, "predicted_gb": waves.planned.peak / GB, "wall_s": wall, "dtype": dtype,
        "device": device_name(device)}])


@dataclass(frozen=True)
class Target:
    name: str
    passed: bool
    measured: str


def _one(frame: pd.DataFrame, **where) -> pd.Series | None:
    """The row of `frame` matching every column = value of `where` (None if there is none)."""
    hit = frame
    for column, value in where.items():
        if hit.empty or column not in hit:
            return None
        hit = hit[hit[column] == value]
    return None if hit.empty else hit.iloc[0]


def targets(kernels: pd.DataFrame, e2e_rows: pd.DataFrame, context: int, batch: int, gb_per_s: float) -> list[Target]:
    """The targets: at the Llama-8B layer, `context` tokens, batch `batch`, INT4 decode attention (the Triton kernel
    over the codes) >= 2.5x faster than bf16 SDPA and >= 70% of `gb_per_s` counting the bytes it reads, FP8
    >= 1.8x faster, INT2 faster than INT4; end to end, INT4 KV decodes faster (one step replayed
    from a CUDA graph) than the dense cache in the model dtype (bf16) at each measured batch x context. A target without its rows fails."""
    heads, q_heads, dim = LLAMA_8B
    at = {"context_tokens": context, "batch": batch, "kv_heads": heads, "query_heads": q_heads, "head_dim": dim}
    ms = {}
    for fmt, path in (("dense", "sdpa"), ("fp8", "triton"), ("int4", "triton"), ("int2", "triton")):
        row = _one(kernels, format=fmt, path=path, **at)
        ms[fmt] = (row["ms"], row["gb_per_s"]) if row is not None else None
    out = []

    def speedup(fmt: str, least: float) -> Target:
        name = f"{fmt.upper()} decode attention >= {least:g}x faster than dense SDPA"
        if ms["dense"] is None or ms[fmt] is None:
            return Target(name, False, "no row")
        x = ms["dense"][0] / ms[fmt][0]
        return Target(name, x >= least, f"{x:.2f}x ({ms[fmt][0]:.3f} vs {ms['dense'][0]:.3f} ms)")

    out.append(speedup("int4", 2.5))
    name = f"INT4 decode attention >= 70% of {gb_per_s:.0f} GB/s (bytes read)"
    if ms["int4"] is None:
        out.append(Target(name, False, "no row"))
    else:
        share = ms["int4"][1] / gb_per_s
        out.append(Target(name, share >= 0.7, f"{share:.0%} ({ms['int4'][1]:.0f} GB/s)"))
    out.append(speedup("fp8", 1.8))
    name = "INT2 decode attention faster than INT4"
    if ms["int2"] is None or ms["int4"] is None:
        out.append(Target(name, False, "no row"))
    else:
        out.append(Target(name, ms["int2"][0] < ms["int4"][0], f"{ms['int2'][0]:.3f} vs {ms['int4'][0]:.3f} ms"))
    points = sorted(set(zip(e2e_rows.get("batch", []), e2e_rows.get("context_tokens", []))))
    for b, t in points or [(None, None)]:
        name = "end to end: INT4 KV decodes faster than dense KV" + (f" (batch {b} x {t} tokens)" if b else "")
        dense, int4 = (_one(e2e_rows, cache=c, batch=b, context_tokens=t) for c in ("dense", "int4"))
        if dense is None or int4 is None or math.isnan(dense["graph_step_ms"]) or math.isnan(int4["graph_step_ms"]):
            out.append(Target(name, False, "no graph-step rows"))
        else:
            x = dense["graph_step_ms"] / int4["graph_step_ms"]
            out.append(Target(name, x > 1, f"{x:.2f}x ({int4['graph_step_ms']:.2f} vs {dense['graph_step_ms']:.2f} ms/step)"))
    return out


def _read(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path) if path.exists() else pd.DataFrame()


def summary(kernels_path: Path, e2e_path: Path, context: int, batch: int, gb_per_s: float,
            memory_path: Path | None = None) -> str:
    """One screen: the kernel rows at `context` x `batch` per head shape, the end-to-end rows, the memory row, the
    targets."""
    kernels, e2e_rows = _read(kernels_path), _read(e2e_path)
    lines = []
    if memory_path is not None:
        mem = _read(memory_path)
        if mem.empty:
            lines.append(f"memory: no row ({memory_path} missing)")
        for r in mem.itertuples():
            lines.append(f"memory: {r.model}, one {r.context_tokens}-token sample, {r.variants} variants in {r.waves} "
                         f"wave(s) ({r.dtype}, {r.device}): peak {r.peak_over_loaded_gb:.2f} GB allocated over the loaded "
                         f"model, kvlab.state.memory predicted {r.predicted_gb:.2f} GB ({r.peak_over_loaded_gb / r.predicted_gb:.2f}x)")
    if kernels.empty:
        lines.append(f"decode kernels: no rows ({kernels_path} missing)")
    else:
        lines.append(f"decode attention, {context} tokens x batch {batch} on {kernels['device'].iloc[0]} "
                     f"({kernels['dtype'].iloc[0]}); bandwidth counts the bytes each path reads")
        at = kernels[(kernels["context_tokens"] == context) & (kernels["batch"] == batch)]
        for (heads, q_heads, dim), rows in at.groupby(["kv_heads", "query_heads", "head_dim"]):
            sdpa = _one(rows, format="dense", path="sdpa")
            lines.append(f"  {heads} KV / {q_heads} query heads, D={dim}" + (" (Llama-8B layer)" if (heads, q_heads, dim) == LLAMA_8B else ""))
            for r in rows.itertuples():
                vs = f"{sdpa['ms'] / r.ms:6.2f}x" if sdpa is not None else ""
                lines.append(f"    {r.format + '/' + r.path:<16} {r.ms:9.3f} ms {r.gb_per_s:8.0f} GB/s {r.gb_per_s / gb_per_s:5.0%} {vs}")
    if e2e_rows.empty:
        lines.append(f"end to end: no rows ({e2e_path} missing)")
    else:
        r0 = e2e_rows.iloc[0]
        lines.append(f"end to end: {r0['model']} ({r0['dtype']}, {r0['device']}); timing does not depend on the weights")
        for r in e2e_rows.itertuples():
            same = "" if pd.isna(r.graph_equals_eager) else ("graph = eager" if r.graph_equals_eager else "graph != eager")
            lines.append(f"    {r.cache:<5} batch {r.batch} x {r.context_tokens}: {r.graph_step_ms:8.2f} ms/step in a graph "
                         f"({r.graph_tokens_per_s:7.0f} tok/s), eager {r.eager_tokens_per_s:7.0f} tok/s, "
                         f"{r.kv_bytes / 2**20:.0f} MiB KV/seq, {r.decode_path}; {same}")
    results = targets(kernels, e2e_rows, context, batch, gb_per_s)
    lines.append("targets:")
    lines += [f"  {'PASS' if t.passed else 'FAIL'}  {t.name}: {t.measured}" for t in results]
    lines.append(f"{sum(t.passed for t in results)} of {len(results)} targets pass")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.tools.gpu_check", description="The GPU device check's steps (gpu/check.sh).")
    sub = ap.add_subparsers(dest="step", required=True)
    e = sub.add_parser("e2e", help="one end-to-end decode point, written as Parquet")
    e.add_argument("--context", type=int, default=32768)
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--new-tokens", type=int, default=16)
    e.add_argument("--device", default="cuda")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.add_argument("--layers", type=int, default=QWEN2_5_0_5B["num_hidden_layers"], help="fewer for a quick CPU run")
    e.add_argument("--out", type=Path, required=True)
    m = sub.add_parser("memory", help="one evaluation sample's peak memory beside the memory model's, as Parquet")
    m.add_argument("--context", type=int, default=8192)
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--layers", type=int, default=QWEN2_5_0_5B["num_hidden_layers"], help="fewer for a quick CPU run")
    m.add_argument("--share", type=float, default=0.8, help="the share of free device memory the job may hold")
    m.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary", help="one screen of results against the targets")
    s.add_argument("--kernels", type=Path, required=True, help="python -m kvlab.steps.kernel_bench's Parquet")
    s.add_argument("--e2e", type=Path, required=True, help="the e2e step's Parquet")
    s.add_argument("--context", type=int, default=32768, help="the kernel rows the targets read")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--memory", type=Path, help="the memory step's Parquet")
    s.add_argument("--gb-per-s", type=float, default=H200_GB_PER_S, help="the device bandwidth (default: H200 nominal)")
    args = ap.parse_args(argv)
    if args.step in ("e2e", "memory"):
        if args.device == "cuda" and not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device (use --device cpu for a dry run)")
        frame = (e2e(args.context, args.batch, args.new_tokens, args.device, args.dtype, args.layers) if args.step == "e2e"
                 else memory(args.context, args.device, args.dtype, args.layers, args.share))
        frame.to_parquet(args.out, index=False)
        print(f"wrote {args.out}: {len(frame)} rows")
    else:
        print(summary(args.kernels, args.e2e, args.context, args.batch, args.gb_per_s, args.memory))


if __name__ == "__main__":
    main()
