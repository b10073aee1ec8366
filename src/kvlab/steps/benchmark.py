"""Two measurements that are not task scores.

* ``engine_vs_pipeline``: the same grid (samples × variants × question modes; the variants kvpress's pipeline
  runs as they are: full and plain presses without a wrapper; the agnostic and aware modes) evaluated by our engine
  (one prefill per sample, every variant compressed from it and decoded as one batch) and by kvpress's own
  pipeline, one call per variant and mode (each call prefills, compresses and decodes alone). In the
  question-agnostic mode both decode greedily from identical token ids, so their answers must agree; in the
  aware mode the pipeline tokenizes context and question as one string, so a boundary token may differ.
* ``throughput``: per variant and batch size, decode speed from a prefilled prose context, and the KV bytes
  one sequence holds after compression.
"""

from __future__ import annotations

import logging
import time

import pandas as pd
import torch

from kvlab.engine import Batch, cache_stats, compress, decode_path, evaluate_sample, greedy_decode, host_free_step, prefill
from kvlab.steps.evaluate import load_model
from kvlab.util.hardware import device_name
from kvlab.util.io import write_parquet
from kvlab.methods import variants
from kvlab.models.card import read_card
from kvlab.tasks import KINDS, generate, max_new_tokens

log = logging.getLogger(__name__)

GRAPH_REPLAYS = 20  # replays of the captured decode step timed per (variant, batch)


def _engine_answers(model, tokenizer, chosen: list, grid: list, modes: list[str], max_new: int) -> tuple[float, dict]:
    """The engine's seconds for the samples × variants × modes, answers only as the pipeline's, and its answers by
    (mode, sample, method, budget)."""
    t0 = time.perf_counter()
    answers = {}
    for s in chosen:
        for r in evaluate_sample(model, tokenizer, s, grid, modes, max_new, kl=False):  # answers only, as the pipeline
            answers[(r["question_mode"], s.sample_id, r["method"], r["budget"])] = r["prediction"]
    return time.perf_counter() - t0, answers


def _pipeline_answers(pipe, chosen: list, grid: list, modes: list[str], max_new: int) -> tuple[dict, dict]:
    """kvpress's pipeline once per sample, variant and mode (agnostic: the question passed apart from the compressed
    context; aware: inside it): its seconds per mode, and its answers by (mode, sample, method, budget)."""
    seconds, answers = {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        for s in chosen:
            before, question = s.prompt.text
            for v in grid:
                if mode == "agnostic":
                    out = pipe(before, question=question, press=v.make_press(), max_new_tokens=max_new)
                else:
                    out = pipe(before + question, press=v.make_press(), max_new_tokens=max_new)
                answers[(mode, s.sample_id, v.method, v.budget)] = out["answer"]
        seconds[mode] = time.perf_counter() - t0
        log.info("kvpress pipeline, question %s: %.1f s", mode, seconds[mode])
    return seconds, answers


def engine_vs_pipeline(model_dir, task: str, task_spec: dict, context_tokens: int, samples: int, run: dict, out_path) -> pd.DataFrame:
    """Wall time of the configured grid (samples × full and plain-press variants × agnostic and aware modes) by the engine and by kvpress's
    pipeline, answers only. The pipeline is called once per variant and mode: question-agnostic with the
    question passed separately (compressed context, then the question), question-aware with the question
    inside the compressed context. The engine is also timed on the agnostic mode alone."""
    from transformers import pipeline

    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)

    torch.set_num_threads(run["threads"])
    card = read_card(model_dir)
    model, tokenizer = load_model(model_dir, run["dtype"], run["device"])
    chosen = generate(task, task_spec, tokenizer, context_tokens)[:samples]
    if len(chosen) < samples:
        raise ValueError(f"benchmark task '{task}' generates {len(chosen)} samples per context length; "
                         f"benchmark.samples asks {samples}")
    if any(not s.prompt.text[1] for s in chosen):
        raise ValueError(f"benchmark task '{task}' must ask its question after the document (kvpress's pipeline does)")
    # plain presses: what the pipeline runs as is
    grid = [v for v in variants(run["methods"], run["budgets"], task) if v.kind in ("full", "kvpress") and "wrapper" not in v.params]
    modes = [m for m in run["question_modes"] if m in ("agnostic", "aware")]  # the niah task has no later turns
    max_new = max_new_tokens(task_spec, run["max_new_tokens"])

    engine_agnostic_s, _ = _engine_answers(model, tokenizer, chosen, grid, ["agnostic"], max_new)
    engine_s, ours = _engine_answers(model, tokenizer, chosen, grid, modes, max_new)
    log.info("engine: %.1f s for %d samples × %d variants × %d modes", engine_s, len(chosen), len(grid), len(modes))
    pipeline_s, theirs = _pipeline_answers(pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=model.device),
                                           chosen, grid, modes, max_new)
    same = {k: ours[k].strip() == theirs[k].strip() for k in theirs}
    for k, ok in same.items():
        if not ok:
            log.warning("answers differ for %s: engine %r, pipeline %r", k, ours[k], theirs[k])
    row = {
        "model": card["name"], "task": task, "context_tokens": context_tokens, "samples": len(chosen),
        "variants": len(grid), "question_modes": ",".join(modes), "max_new_tokens": max_new,
        "engine_s": engine_s, "pipeline_s": sum(pipeline_s.values()), "speedup": sum(pipeline_s.values()) / engine_s,
        "engine_agnostic_s": engine_agnostic_s, "pipeline_agnostic_s": pipeline_s.get("agnostic", float("nan")),
        "speedup_agnostic": pipeline_s.get("agnostic", float("nan")) / engine_agnostic_s,
    }
    for mode in modes:
        keys = [k for k in same if k[0] == mode]
        row[f"agreement_{mode}"] = sum(same[k] for k in keys) / len(keys)
    frame = pd.DataFrame([{**row, "dtype": run["dtype"], "device": device_name(run["device"])}])
    write_parquet(frame, out_path)
    return frame


def graph_step(model, caches: list, tail: list[int], start: int, replays: int) -> tuple[float, list[int]]:
    """Seconds per decode step without the host: after feeding `tail` and two warm-up steps (they compile the
    kernels), one step is captured in a CUDA graph and replayed `replays` times. A replay repeats the same
    step — same position, same cache, the new token rewritten where it went — so it times decoding at this
    context with every launch and Python call taken out, as graph-replaying servers decode. Also returns the
    step's tokens (argmax per row, the fourth new token) as the replays computed them."""
    if not host_free_step(caches, model.device):
        raise ValueError("graph_step: a decode step over these caches waits on the host (per-row masks), so a CUDA "
                         "graph cannot capture it; only dense caches and quantized ones the decode kernel reads can")
    batch = Batch(model, caches)
    x = torch.tensor([tail] * batch.size, device=model.device)
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch.cuda.graph asks
        x = batch.forward(x, start)[:, -1].argmax(-1, keepdim=True)
        pos = start + len(tail)
        for _ in range(2):
            x = batch.forward(x, pos)[:, -1].argmax(-1, keepdim=True)
            pos += 1
    torch.cuda.current_stream(model.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batch.forward(x, pos)[:, -1].argmax(-1)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(model.device)
    return begin.elapsed_time(end) / 1e3 / replays, out.tolist()


def throughput(model_dir, context_tokens: int, new_tokens: int, run: dict, out_path, batches: tuple[int, ...] = (1,)) -> pd.DataFrame:
    """Decode `new_tokens` after each variant's compressed cache (EOS ignored, so every variant decodes the
    same number of steps), at each batch size: the batch is that many copies of the one compressed cache,
    decoded in lockstep (quantized copies are stacked into one layer, see ``engine.PerRowLayer``). One row per
    variant and batch; tokens/s counts every row's tokens. On CUDA also the step time with the host taken
    out (``graph_step``: one step replayed from a CUDA graph) where a step can be captured (dense caches and
    those the decode kernel reads, see ``engine.host_free_step``); NaN elsewhere."""
    torch.set_num_threads(run["threads"])
    card = read_card(model_dir)
    model, tokenizer = load_model(model_dir, run["dtype"], run["device"])
    spec = {"kind": "continuation", "samples": 1, "seed": 0, "continuation_tokens": 2}
    sample = KINDS["continuation"].generate("throughput", spec, tokenizer, context_tokens)[0]
    t0 = time.perf_counter()
    base = prefill(model, sample.prompt.context)
    prefill_s = time.perf_counter() - t0
    rows = []
    for v in variants(run["methods"], run["budgets"]):
        cache = compress(model, base, v)
        held = cache_stats(cache, v, base.length)
        for batch in batches:
            greedy_decode(model, [cache] * batch, sample.prompt.suffix, base.length, 2, stop=False)  # warm-up (cache left as is)
            t0 = time.perf_counter()
            out = greedy_decode(model, [cache] * batch, sample.prompt.suffix, base.length, new_tokens, stop=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(ids) for ids in out)
            graph_s = float("nan")
            if model.device.type == "cuda" and host_free_step([cache] * batch, model.device):
                graph_s, _ = graph_step(model, [cache] * batch, sample.prompt.suffix, base.length, GRAPH_REPLAYS)
            rows.append(
                {
                    "model": card["name"], "context_tokens": context_tokens, "method": v.method, "budget": v.budget,
                    "batch": batch, "new_tokens": len(out[0]), "decode_s": seconds, "tokens_per_s": tokens / seconds,
                    "graph_step_ms": graph_s * 1e3, "graph_tokens_per_s": batch / graph_s,
                    "prefill_s": prefill_s, "kv_bytes": held["kv_bytes"], "kv_tokens_mean": held["kv_tokens_mean"],
                    "decode_path": decode_path(cache, model.device),
                    "dtype": run["dtype"], "device": device_name(run["device"]),
                }
            )
            log.info("%s at batch %d: %.2f tokens/s, %d KV bytes per sequence", v.label, batch, rows[-1]["tokens_per_s"], held["kv_bytes"])
    frame = pd.DataFrame(rows)
    write_parquet(frame, out_path)
    return frame
