"""Decode-attention microbenchmark: one query token per sequence against a cache of T tokens in one layer with
the model's head shape, per storage format and path, timed on the device. Rows: milliseconds per call on the
device (``ms``: the call replayed from a CUDA graph) and called from Python (``call_ms``: with its host work), and
the bandwidth achieved in ``ms`` counting the bytes the path must read (the cache as stored, plus the query and
output).

Paths:
  - ``sdpa``: torch's scaled_dot_product_attention over the dense cache in the model dtype (GQA inside the kernel);
  - ``flash``: FlashAttention's ``flash_attn_with_kvcache``, when the ``flash_attn`` package is installed;
  - ``triton``: kvlab's kernel over the packed codes (kvlab.kernels.triton_decode), FP8 / INT4 / INT2 (KIVI);
  - ``dequantize``: the same codes dequantized to the model dtype, then SDPA — what transformers' and kvpress's
    quantized caches do at every step.
Caches hold random normal keys and values (attention cost does not depend on the values).
"""

from __future__ import annotations

import importlib.util
import logging
import statistics
import time

import pandas as pd
import torch

from kvlab.util.columns import DECODE_KERNEL_COLUMNS
from kvlab.util.hardware import device_name
from kvlab.kernels import codecs, decode_attention, kvcache

log = logging.getLogger(__name__)

COLUMNS = list(DECODE_KERNEL_COLUMNS)


def formats(group: int, residual: int) -> dict[str, kvcache.LayerSpec | None]:
    """The storage formats timed: None is the dense cache in the model dtype."""
    kivi = lambda bits: kvcache.LayerSpec(  # noqa: E731
        codecs.AffineCodec(bits, group, "channel"), codecs.AffineCodec(bits, group, "token"), group=group, residual=residual
    )
    return {"dense": None, "fp8": kvcache.LayerSpec(codecs.FP8Codec(), codecs.FP8Codec(), group=1, residual=0),
            "int4": kivi(4), "int2": kivi(2)}


FLUSH_BYTES = 256 << 20  # more than any GPU's last-level cache (H100/H200: 50/60 MB)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median milliseconds of `fn()` after a warm-up call (compilation, autotuning), (device, call):
      - device: on CUDA, the call captured once in a CUDA graph and the graph replayed: the kernels' own time,
        with no Python or launch latency before or between them (what a graph-replaying server pays);
      - call: `fn()` called from Python, so where its host work (argument checks, launches) outlasts the
        kernels, the device waits and the time shows it (what eager decoding pays per layer and step).
    On CUDA, a 256 MB buffer is overwritten before each timed call, so every call reads its cache from device
    memory, not from L2 (an INT4 cache of a few tens of MB would otherwise stay in L2 between calls while a
    bf16 one would not). On the CPU both are the call's wall time."""
    fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        wall = statistics.median(samples)
        return wall, wall
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    medians = []
    for run in (graph.replay, fn):
        samples = []
        for _ in range(repeats):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        medians.append(statistics.median(samples))
    return medians[0], medians[1]


def bench(card: dict, spec: dict, device: str, dtype: torch.dtype) -> pd.DataFrame:
    """Rows for every (format, path, context, batch) of `spec` (config `decode_kernels`), at the head shape
    `spec` gives or else `card`'s (the model's)."""
    dev = torch.device(device)
    shape = spec.get("shape") or {}
    heads = shape.get("kv_heads", card["num_kv_heads"])
    q_heads = shape.get("query_heads", card["num_query_heads"])
    dim = shape.get("head_dim", card["head_dim"])
    if q_heads % heads:
        raise ValueError(f"decode_kernels.shape: query_heads {q_heads} is not a multiple of kv_heads {heads}")
    if not decode_attention.head_dim_fits(dim):
        raise ValueError(f"decode_kernels: head_dim {dim} has no Triton decode kernel; it reads power-of-two head dims "
                         f"from 16 to 256 (set decode_kernels.shape, e.g. {{kv_heads: 8, query_heads: 32, head_dim: 128}})")
    scaling = dim**-0.5
    has_flash = dev.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    rows = []
    for tokens in spec["context_tokens"]:
        for batch in spec["batches"]:
            g = torch.Generator(device=dev).manual_seed(tokens + batch)
            keys = torch.randn(batch, heads, tokens, dim, generator=g, device=dev, dtype=dtype)
            values = torch.randn(batch, heads, tokens, dim, generator=g, device=dev, dtype=dtype)
            q = torch.randn(batch, q_heads, dim, generator=g, device=dev, dtype=dtype)
            new_k, new_v = keys[:, :, -1:], values[:, :, -1:]
            out_bytes = batch * q_heads * dim * 4  # the merged float32 output
            for name, layer_spec in formats(spec["group"], spec["residual"]).items():
                if layer_spec is None:
                    calls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                        q[:, :, None], keys, values, scale=scaling, enable_gqa=True)}
                    if has_flash:
                        from flash_attn import flash_attn_with_kvcache

                        kt, vt, qt = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous(), q[:, None]
                        calls["flash"] = lambda: flash_attn_with_kvcache(qt, kt, vt, softmax_scale=scaling)
                    read = sum(map(kvcache.tensor_nbytes, (keys, values, q))) + batch * q_heads * dim * keys.element_size()
                    bits = 8 * keys.element_size()
                else:
                    layer = kvcache.layer_from_dense(keys[:, :, :-1], values[:, :, :-1], layer_spec)
                    calls = {
                        "triton": lambda: decode_attention.decode_attention(q, layer, new_k, new_v, scaling, fused=True),
                        "dequantize": lambda: torch.nn.functional.scaled_dot_product_attention(
                            q[:, :, None], *layer.full(new_k, new_v), scale=scaling, enable_gqa=True),
                    }
                    if not decode_attention.supported(layer):  # FP8 before sm_89: no kernel reads it there
                        del calls["triton"]
                    read = layer.nbytes() + sum(map(kvcache.tensor_nbytes, (q, new_k, new_v))) + out_bytes
                    bits = layer_spec.key.bits if hasattr(layer_spec.key, "bits") else 8
                for path, fn in calls.items():
                    ms, call_ms = timed(fn, dev, spec["repeats"])
                    rows.append({
                        "model": card["name"], "format": name, "path": path, "bits": bits, "context_tokens": tokens,
                        "batch": batch, "kv_heads": heads, "query_heads": q_heads, "head_dim": dim, "ms": ms,
                        "call_ms": call_ms, "bytes_read": read, "gb_per_s": read / ms / 1e6,
                        "dtype": str(dtype).removeprefix("torch."), "device": device_name(device),
                    })
                    log.info("%s/%s T=%d B=%d: %.3f ms (%.3f ms called from Python), %.1f GB/s", name, path, tokens, batch,
                             ms, call_ms, rows[-1]["gb_per_s"])
    return pd.DataFrame(rows, columns=COLUMNS)


def decode_kernels(model_dir, spec: dict, run: dict, out_path) -> pd.DataFrame:
    """The benchmark for one model (rule decode_kernels), written as Parquet."""
    from kvlab.util.io import write_parquet
    from kvlab.models.card import read_card

    torch.set_num_threads(run["threads"])
    frame = bench(read_card(model_dir), spec, run["device"], getattr(torch, run["dtype"]))
    write_parquet(frame, out_path)
    return frame


def main(argv: list[str] | None = None) -> None:
    """Command line for a bare GPU machine (torch, triton, transformers, pandas and pyarrow; no workflow):
    python -m kvlab.steps.kernel_bench --shape 2,14,64 --out rows.parquet"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvlab.steps.kernel_bench", description=main.__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", required=True, help="kv_heads,query_heads,head_dim (repeatable)")
    ap.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--group", type=int, default=32, choices=[32, 64, 128], help="KIVI group (the tile sizes the kernel reads)")
    ap.add_argument("--residual", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = {"context_tokens": [int(x) for x in args.contexts.split(",")], "batches": [int(x) for x in args.batches.split(",")],
            "group": args.group, "residual": args.residual, "repeats": args.repeats}
    frames = []
    for shape in args.shape:
        try:
            heads, q_heads, dim = (int(x) for x in shape.split(","))
        except ValueError:
            ap.error(f"--shape {shape!r}: expected three integers kv_heads,query_heads,head_dim, e.g. 8,32,128")
        card = {"name": f"shape {heads}/{q_heads}/{dim}", "num_kv_heads": heads, "num_query_heads": q_heads, "head_dim": dim}
        frames.append(bench(card, spec, args.device, getattr(torch, args.dtype)))
    pd.concat(frames, ignore_index=True).to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
