"""Calibration: what a model's KV cache and attention look like on real prose, before any compression.

One forward pass per calibration sequence (the default attention implementation) records, per layer:
the residual stream entering the layer (massive activations), the attention input and RoPE tables, and
the cache (post-RoPE keys, values). Pre-RoPE keys are recomputed from the attention input with the layer's
own projection (and key norm, where the model has one). Attention weights are computed only for a subset
of query positions, from the recorded queries and keys, so calibration costs about one prefill per sequence.

Outputs (one Parquet table each, all read back by the report and by later rules):
  key_channels   per (layer, KV head, channel, tensor ∈ key_pre_rope | key_post_rope | value): absmax,
                 mean |x|, p99.9 |x|, and the channel's outlier score (absmax / median absmax of its head)
  massive        per (layer, position class ∈ first | delimiter | other): the largest hidden-state magnitude,
                 where it occurs (position, token, channel) and the median per-token maximum
  sinks          per (layer, query head, sink position): attention mass on token 0 and on every position
                 that takes at least `sink_threshold` of the mass in that layer, averaged over query positions
  concentration  per layer: mean attention entropy and the mean fraction of visible keys holding 90% of mass
  fp8_scales     per (layer, KV head, key | value): absmax and the static E4M3 scale absmax / 448
  kvquant_ranges per (layer, KV head, channel): the pre-RoPE key range [lo, hi] (token 0, the sink, left out)
  kvquant_grids  per (layer, bits): the non-uniform grid on range-normalized pre-RoPE keys (1-D k-means)
  layer_budget   per layer: a measured budget weight (mean 1) for PyramidKV-style allocation
  stream_sinks   per model: the leading sink positions StreamingLLM should keep
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from kvlab.state.config import CALIBRATION_TABLES
from kvlab.util.corpus import kjv_sentences, prose_ids
from kvlab.engine import attention_layers, capture, decoder_layers, is_sliding, project
from kvlab.util.io import write_parquet
from kvlab.kernels.codecs import rotate
from kvlab.models.card import read_card

log = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
GRID_BITS = (2, 3, 4)


def calibration_sequences(tokenizer, sequences: int, tokens: int, seed: int) -> list[list[int]]:
    """`sequences` runs of `tokens` tokens of prose from the calibration share of the corpus (never the
    share the evaluation tasks draw from), each starting at a seeded sentence, with the tokenizer's BOS."""
    pool = kjv_sentences("calibration")
    rng = random.Random(f"calibration:{seed}")
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    return [prose_ids(tokenizer, pool, rng.randrange(len(pool)), tokens, bos)[0][:tokens] for _ in range(sequences)]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, d) rotated by the (B, T, d) tables (the half-split convention of Llama/Qwen/Gemma)."""
    return rotate(x, cos[:, None], sin[:, None])


@torch.no_grad()
def attention_rows(model, idx: int, module, cap, keys: torch.Tensor, queries_at: torch.Tensor) -> torch.Tensor:
    """Attention probabilities (B, Hq, Q, T) of layer `idx` for the query positions `queries_at`, computed
    from the layer's own projections and the cached (post-RoPE) keys, with the causal (and sliding) mask."""
    q = project(module, cap.hidden_states[:, queries_at], "q")
    q = apply_rope(q, cap.cos[:, queries_at], cap.sin[:, queries_at])
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * module.scaling
    cap_value = getattr(module.config, "attn_logit_softcapping", None)
    if cap_value:
        scores = torch.tanh(scores / cap_value) * cap_value
    j = torch.arange(keys.shape[-2], device=keys.device)
    hidden = j[None, :] > queries_at[:, None]
    window = getattr(module.config, "sliding_window", None)
    if is_sliding(model, idx) and window:
        hidden |= j[None, :] <= queries_at[:, None] - window
    scores = scores.masked_fill(hidden[None, None], float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


def channel_stats(x: torch.Tensor, layer: int, tensor: str) -> pd.DataFrame:
    """x (N, H, d) for one layer → one row per (head, channel)."""
    a = x.abs().float()
    absmax = a.amax(0)  # (H, d)
    mean = a.mean(0)
    p999 = torch.quantile(a.transpose(0, 2).reshape(-1, a.shape[0]), 0.999, dim=1).view(a.shape[2], a.shape[1]).T
    score = absmax / absmax.median(dim=1, keepdim=True).values.clamp_min(1e-12)
    h, d = absmax.shape
    return pd.DataFrame({
        "layer": layer, "kv_head": np.repeat(np.arange(h), d), "channel": np.tile(np.arange(d), h), "tensor": tensor,
        "absmax": absmax.flatten().numpy(), "mean_abs": mean.flatten().numpy(), "p999_abs": p999.flatten().numpy(),
        "outlier_score": score.flatten().numpy(),
    })


def is_delimiter(text: str) -> bool:
    return text.strip() == "" or all(not c.isalnum() for c in text.strip())


def sink_rows(probs: torch.Tensor, layer: int, sequence: int, tokens: list[str], threshold: float) -> pd.DataFrame:
    """probs (Hq, Q, T) of one sequence → rows for the leading positions 0–3 and every position whose mass
    (mean over heads and query positions) is at least `threshold`."""
    mass = probs.mean(1)  # (Hq, T)
    overall = mass.mean(0)
    positions = sorted({0, 1, 2, 3} | {int(p) for p in torch.nonzero(overall >= threshold).flatten()})
    return pd.DataFrame([
        {"layer": layer, "sequence": sequence, "head": h, "position": p, "token": tokens[p], "mass": float(mass[h, p]),
         "is_delimiter": is_delimiter(tokens[p]), "is_sink": bool(overall[p] >= threshold)}
        for p in positions for h in range(mass.shape[0])
    ])


def concentration(probs: torch.Tensor) -> tuple[float, float]:
    """Mean entropy (nats) of the attention rows (..., T), and mean fraction of visible keys that hold
    90% of each row's mass."""
    p = probs.clamp_min(1e-30)
    entropy = -(probs * p.log()).sum(-1)
    visible = (probs > 0).sum(-1).clamp_min(1)
    ranked = probs.sort(dim=-1, descending=True).values.cumsum(-1)
    needed = (ranked < 0.9).sum(-1) + 1
    return float(entropy.mean()), float((needed / visible).float().mean())


@torch.no_grad()
def calibrate(model, tokenizer, sequences: list[list[int]], query_positions: int, sink_threshold: float) -> dict[str, pd.DataFrame]:
    """Every table of the module docstring, from the given token sequences (all of one length)."""
    layers = attention_layers(model)
    n = len(layers)
    lengths = {len(s) for s in sequences}
    if len(lengths) != 1:
        raise ValueError(f"calibration sequences must share one length, got {sorted(lengths)}")
    (T,) = lengths
    if query_positions < 1 or T < 8:
        raise ValueError(f"calibration needs at least 8 tokens per sequence and 1 query position (got {T}, {query_positions})")
    # query positions spread over the later 7/8 of the sequence, so every query sees a long context
    queries_at = torch.linspace(T // 8, T - 1, min(query_positions, T - T // 8)).round().long().unique()
    keys_pre, keys_post, values, residual = ([[] for _ in range(n)] for _ in range(4))
    sinks, conc = [], np.zeros((n, 3))
    blocks = decoder_layers(model)
    for s, seq in enumerate(sequences):
        store, inputs = [], []
        handles = [
            b.register_forward_pre_hook(lambda m, a, kw: inputs.append(a[0] if a else kw["hidden_states"]), with_kwargs=True)
            for b in blocks
        ]
        try:
            with capture(model, store):
                model.model(input_ids=torch.tensor([seq], device=model.device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        tokens = [tokenizer.decode([t]) for t in seq]
        for i, module in enumerate(layers):
            cap = store[i]
            pre = project(module, cap.hidden_states, "k")  # (1, Hkv, T, d)
            post = apply_rope(pre, cap.cos, cap.sin)
            keys_pre[i].append(pre[0].transpose(0, 1))
            keys_post[i].append(post[0].transpose(0, 1))
            values[i].append(module.v_proj(cap.hidden_states).view(T, -1, module.head_dim))
            residual[i].append(inputs[i][0])
            p = attention_rows(model, i, module, cap, post, queries_at)[0]  # (Hq, Q, T)
            sinks.append(sink_rows(p, i, s, tokens, sink_threshold))
            conc[i] += (*concentration(p), float(p[..., 0].mean()))
    classes = position_classes(sequences, tokenizer)
    conc /= len(sequences)
    tables = {
        "key_channels": pd.concat(
            [channel_stats(torch.cat(xs[i]), i, name) for i in range(n)
             for name, xs in (("key_pre_rope", keys_pre), ("key_post_rope", keys_post), ("value", values))],
            ignore_index=True,
        ),
        "massive": pd.concat([massive_rows(torch.stack(residual[i]), i, sequences, classes, tokenizer) for i in range(n)], ignore_index=True),
        "sinks": pd.concat(sinks, ignore_index=True),
        "concentration": pd.DataFrame({
            "layer": range(n), "sliding": [is_sliding(model, i) for i in range(n)],
            "entropy": conc[:, 0], "keys90_fraction": conc[:, 1], "token0_mass": conc[:, 2],
        }),
    }
    tables.update(fed_forward(tables, keys_pre, keys_post, values, sink_threshold))
    return tables


def position_classes(sequences: list[list[int]], tokenizer) -> np.ndarray:
    """(S, T) labels: 'first' for position 0, 'delimiter' for whitespace/punctuation tokens, else 'other'."""
    delimiter = {t: is_delimiter(tokenizer.decode([t])) for seq in sequences for t in set(seq)}
    out = np.array([["delimiter" if delimiter[t] else "other" for t in seq] for seq in sequences], dtype=object)
    out[:, 0] = "first"
    return out


def massive_rows(h: torch.Tensor, layer: int, sequences: list[list[int]], classes: np.ndarray, tokenizer) -> pd.DataFrame:
    """h (S, T, hidden): the residual stream entering `layer` → one row per position class."""
    per_token, channel = h.abs().float().max(-1)  # (S, T)
    rows = []
    for cls in ("first", "delimiter", "other"):
        where = torch.from_numpy(classes == cls)
        if not where.any():
            continue
        vals = per_token.masked_fill(~where, -1)
        s, t = divmod(int(vals.argmax()), vals.shape[1])
        rows.append({
            "layer": layer, "position_class": cls, "max_abs": float(vals[s, t]),
            "median_token_max": float(per_token[where].median()), "position": t,
            "token": tokenizer.decode([sequences[s][t]]), "channel": int(channel[s, t]), "tokens": int(where.sum()),
        })
    return pd.DataFrame(rows)


def fed_forward(tables: dict, keys_pre, keys_post, values, sink_threshold: float) -> dict[str, pd.DataFrame]:
    """What later stages consume: FP8 scales, KVQuant grids, a per-layer budget profile, StreamingLLM sinks."""
    scales, grids, ranges = [], [], []
    for i in range(len(keys_pre)):
        for name, xs in (("key", keys_post[i]), ("value", values[i])):
            absmax = torch.cat(xs).abs().amax(dim=(0, 2))  # per KV head
            scales += [{"layer": i, "kv_head": h, "tensor": name, "absmax": float(a), "scale": float(a) / FP8_E4M3_MAX}
                       for h, a in enumerate(absmax)]
        # KVQuant-style keys: every channel mapped onto [-1, 1] by its own calibrated range (asymmetric, so a
        # channel's offset costs no levels), then one non-uniform grid per layer fitted to the pooled values.
        # Token 0 (the attention sink, kept in full precision at run time) is left out of both.
        pre = torch.cat([x[1:] for x in keys_pre[i]]).float()  # (N, H, d)
        lo, hi = pre.amin(0), pre.amax(0)
        h, d = lo.shape
        ranges.append(pd.DataFrame({
            "layer": i, "kv_head": np.repeat(np.arange(h), d), "channel": np.tile(np.arange(d), h),
            "lo": lo.flatten().numpy(), "hi": hi.flatten().numpy(),
        }))
        normalized = (2 * (pre - lo) / (hi - lo).clamp_min(1e-12) - 1).flatten()
        sample = normalized[:: max(1, normalized.numel() // 1_000_000)].double()
        for bits in GRID_BITS:
            grid = lloyd_grid(sample, 2**bits)
            grids += [{"layer": i, "bits": bits, "level": k, "value": float(v)} for k, v in enumerate(grid)]
    conc = tables["concentration"]
    budget = conc[["layer", "keys90_fraction", "entropy"]].copy()
    budget["budget_weight"] = budget["keys90_fraction"] / budget["keys90_fraction"].mean()
    n_sink = leading_sinks(tables["sinks"], len(keys_pre), sink_threshold)
    stream = pd.DataFrame([{
        "n_sink": n_sink, "token0_mass_mean": float(conc["token0_mass"].mean()),
        "token0_mass_max": float(conc["token0_mass"].max()), "layers": len(keys_pre),
    }])
    return {
        "fp8_scales": pd.DataFrame(scales), "kvquant_ranges": pd.concat(ranges, ignore_index=True),
        "kvquant_grids": pd.DataFrame(grids), "layer_budget": budget, "stream_sinks": stream,
    }


def lloyd_grid(x: torch.Tensor, levels: int, iterations: int = 30) -> torch.Tensor:
    """`levels` sorted values minimizing the squared error of rounding `x` to the nearest (1-D k-means,
    Lloyd's iterations from equal-mass quantiles). KVQuant weights this fit by each entry's sensitivity
    (Fisher information); we fit it unweighted."""
    grid = torch.quantile(x, (torch.arange(levels, dtype=x.dtype) + 0.5) / levels)
    for _ in range(iterations):
        cell = torch.bucketize(x, (grid[1:] + grid[:-1]) / 2)
        sums = torch.zeros_like(grid).index_add_(0, cell, x)
        counts = torch.zeros_like(grid).index_add_(0, cell, torch.ones_like(x))
        grid = torch.where(counts > 0, sums / counts.clamp_min(1), grid)
    return grid.sort().values


def leading_sinks(sinks: pd.DataFrame, layers: int, threshold: float) -> int:
    """How many leading positions (0, 1, …) are sinks — mass ≥ `threshold`, averaged over heads and
    sequences — in at least half of the layers: the count StreamingLLM should keep."""
    leading = sinks[sinks["position"] < 4].groupby(["layer", "position"])["mass"].mean().reset_index()
    share = leading[leading["mass"] >= threshold].groupby("position")["layer"].nunique() / layers
    n = 0
    while n in share.index and share[n] >= 0.5:
        n += 1
    return n


def run_job(model_dir, spec: dict, run: dict, out_dir) -> dict[str, pd.DataFrame]:
    """Calibrate the model in `model_dir` with `spec` (sequences, tokens, query_positions, sink_threshold,
    seed); write every table as `out_dir/{table}.parquet` (each file atomically)."""
    from kvlab.steps.evaluate import load_model

    torch.set_num_threads(run["threads"])
    card = read_card(model_dir)
    model, tokenizer = load_model(model_dir, run["dtype"], run["device"])
    seqs = calibration_sequences(tokenizer, spec["sequences"], spec["tokens"], spec["seed"])
    log.info("%s: %d sequences × %d tokens", card["name"], len(seqs), spec["tokens"])
    tables = calibrate(model, tokenizer, seqs, spec["query_positions"], spec["sink_threshold"])
    assert tuple(tables) == CALIBRATION_TABLES, f"calibrate() returned {tuple(tables)}"
    for name, frame in tables.items():
        frame.insert(0, "model", card["name"])
        write_parquet(frame, Path(out_dir) / f"{name}.parquet")
    return tables
