"""How long an arithmetic answer must be allowed to run: the full cache's answers to the arithmetic task, decoded once
up to a long cap, then scored as if cut at each shorter cap (greedy decoding is the same up to any cap, so one decode
serves every cap). The rows behind `max_new_tokens` of the arithmetic task in config.yaml.

    .venv/bin/python benchmarks/arithmetic_cap.py [--samples 20] [--caps 96 128 192 256 384 512] \
        [--model-dir resources/models/qwen2.5-0.5b] [--out results/bench/arithmetic_cap.parquet]

One row per cap: problems, answers finished (EOS) within the cap, answers right when cut there, the model and dtype.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from kvlab.engine import decode_references, prefill, stop_ids
from kvlab.steps.evaluate import load_model
from kvlab.util.hardware import compute_dtype
from kvlab.util.io import write_parquet
from kvlab.tasks import KINDS
from kvlab.tasks.scoring import score


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="resources/models/qwen2.5-0.5b")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caps", type=int, nargs="+", default=[96, 128, 192, 256, 384, 512])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/bench/arithmetic_cap.parquet")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = compute_dtype(args.dtype, "cpu")
    model, tokenizer = load_model(args.model_dir, dtype, "cpu")
    spec = {"kind": "arithmetic", "context_tokens": [256], "samples": args.samples, "seed": args.seed}
    samples = KINDS["arithmetic"].generate("arithmetic", spec, tokenizer, 256)
    requests = []
    for sample in samples:
        base = prefill(model, sample.prompt.context)
        requests.append((base.cache, sample.prompt.question + sample.prompt.suffix, base.length))
    t0 = time.perf_counter()
    answers, _ = decode_references(model, requests, max(args.caps))
    seconds = time.perf_counter() - t0
    eos = stop_ids(model)
    rows = []
    for cap in sorted(args.caps):
        cut = [answer[:cap] for answer in answers]
        rows.append({
            "model": args.model_dir.rstrip("/").split("/")[-1], "dtype": dtype, "cap": cap, "problems": len(samples),
            "finished": sum(any(t in eos for t in c) for c in cut),
            "right": sum(score(s.metric, tokenizer.decode(c, skip_special_tokens=True), s.gold) for s, c in zip(samples, cut)),
            "mean_tokens": sum(map(len, cut)) / len(cut), "decode_s": seconds,
        })
    frame = pd.DataFrame(rows)
    write_parquet(frame, args.out)
    print(frame.to_string(index=False))
    return frame


if __name__ == "__main__":
    main()
