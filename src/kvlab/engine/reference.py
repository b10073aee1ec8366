"""The plain reference engine: one variant at a time, one token at a time, written to be read.

This is what `kvlab.engine.sample.evaluate_samples` computes, without any of its speed-ups (no batch of variants,
no drafts, no length buckets, no verification along the full cache's answer, no streamed teacher forcing). It
follows kvpress's pipeline:

1. prefill the context once with the model's own forward and a cache (`prefill`, which also records what a press's
   `compress` reads per layer);
2. per variant, compress a copy of that cache after prefill, with the same objects the fast engine builds
   (`compress`: the variant's press, then its kind's own change: quantized codes, H2O's or MiKV's layers);
3. feed the question tokens in one chunk, then decode greedily, one token per forward, until EOS or the cap;
4. for KL and NLL, feed the question again (to a fresh copy of the compressed cache), then the path one token
   per forward, and read each position's log-probabilities.

tests/test_reference.py holds the fast engine equal to this on every cache kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlab.engine.batch import Batch
from kvlab.engine.compress import compress
from kvlab.engine.prefill import KVCache, Prefilled, prefill, shallow_copy
from kvlab.kernels.layer import KVLayer
from kvlab.methods import Variant
from kvlab.models.structure import is_sliding, stop_ids
from kvlab.tasks.base import Sample


class Reader:
    """One compressed cache, fed tokens at their original positions (`feed`). Each reader works on its own copy: the
    compressed cache itself is never changed, so one cache can be decoded and teacher-forced apart.

    A cache of plain layers (dense or evicted: transformers' own `DynamicLayer`) is driven through the model's own
    forward, `model(input_ids, past_key_values=cache, position_ids=...)`. Only a chunk of several tokens needs a mask:
    after eviction the cache holds fewer entries than the positions it covers, so transformers' causal mask (built from
    positions) would let the chunk see its own later tokens; `_chunk_mask` says what each token may see instead.

    A cache with kvlab's own layers (`KVLayer`: FP8/KIVI codes, H2O's and MiKV's layers, a press's per-head mask) cannot
    be driven that way: its layers need the query handed to them before their update (H2O scores attention), their own
    mask (what a quantized token sees) and kvlab's attention over their codes. Those go through the engine's
    lowest-level forward, a `Batch` of this one row (`Batch.forward`), still one token per call."""

    def __init__(self, model, cache: DynamicCache):
        self.model = model
        self.shift = cache.position_shift if isinstance(cache, KVCache) else 0  # a re-rotated cache decodes from its kept length
        layers = cache.layers
        sliding = any(is_sliding(model, i) for i in range(len(layers)))
        held = {layer.keys.shape[-2] for layer in layers if not isinstance(layer, KVLayer)}
        self.plain = not sliding and not any(isinstance(layer, KVLayer) for layer in layers) and len(held) == 1
        self.batch = None if self.plain else Batch(model, [cache])  # Batch forks the row: `cache` stays as it was
        self.cache = shallow_copy(cache) if self.plain else None

    @torch.no_grad()
    def feed(self, ids: list[int], start: int) -> torch.Tensor:
        """Feed `ids` at original positions start…; the logits (V,) that predict the next token."""
        x = torch.tensor([ids], device=self.model.device)
        if not self.plain:
            return self.batch.forward(x, start)[0, -1]
        positions = torch.arange(start, start + len(ids), device=x.device)[None] + self.shift
        mask = None if len(ids) == 1 else _chunk_mask(self.cache.get_seq_length(), len(ids), self.model.dtype, x.device)
        out = self.model(input_ids=x, past_key_values=self.cache, position_ids=positions,
                         attention_mask={"full_attention": mask}, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]


def _chunk_mask(held: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask (1, 1, n, held + n) for feeding `n` tokens after `held` cached entries: every cached entry, and
    the chunk causally."""
    key = torch.arange(held + n, device=device)
    query = torch.arange(n, device=device)
    allowed = key[None, :] <= held + query[:, None]
    return torch.zeros(1, 1, n, held + n, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


def greedy_answer(model, cache: DynamicCache, tail: list[int], start: int, max_new_tokens: int) -> list[int]:
    """Feed `tail` after `cache` at positions start…, then pick the most likely token and feed it, one at a time,
    until EOS (kept) or `max_new_tokens` tokens."""
    reader, eos = Reader(model, cache), stop_ids(model)
    logits, answer = reader.feed(tail, start), []
    position = start + len(tail)
    while len(answer) < max_new_tokens:
        token = int(logits.argmax())  # the first maximum, as the fast engine's `greedy`
        answer.append(token)
        if token in eos or len(answer) == max_new_tokens:
            break
        logits = reader.feed([token], position)
        position += 1
    return answer


def path_logprobs(model, cache: DynamicCache, tail: list[int], path: list[int], start: int) -> torch.Tensor:
    """Log-probabilities (len(path), V) in float32 the cache gives each token of `path` after `tail`: the tail in one
    chunk, then the path one token per forward (teacher forcing, read as decoding reads it)."""
    reader = Reader(model, cache)
    steps = [reader.feed(tail, start)]
    for i, token in enumerate(path[:-1]):
        steps.append(reader.feed([token], start + len(tail) + i))
    return torch.log_softmax(torch.stack(steps).float(), dim=-1)


@dataclass
class Answer:
    """One variant's answer to one sample, and per token of the KL path (the full cache's answer, or the sample's
    reference text): KL(full ‖ variant) and the variant's NLL of the path's token, in nats."""

    variant: Variant
    tokens: list[int]
    kl: list[float]
    nll: list[float]

    def columns(self) -> dict:
        """The fast engine's per-row summary of these (`teacher.forced_divergence`): mean and max KL, mean NLL."""
        if not self.kl:
            return {}
        return {"kl_vs_full": sum(self.kl) / len(self.kl), "kl_max": max(self.kl), "nll": sum(self.nll) / len(self.nll)}


def base_of(model, sample: Sample, mode: str = "agnostic") -> tuple[Prefilled, list[int]]:
    """The prefilled cache a mode compresses and the tail fed after it: `agnostic`, the context alone (the question
    comes after compression); `aware`, the context then the question (only the suffix comes after). As
    `sample.plan` prefills them, with the same protected prefix."""
    p = sample.prompt
    context = prefill(model, p.context)
    context.span = (max(p.head, p.prefix), len(p.context))
    context.prefix = p.prefix
    if mode == "aware" and p.question:
        return prefill(model, p.question, past=context), list(p.suffix)
    if mode not in ("agnostic", "aware"):
        raise ValueError(f"reference: question mode {mode!r} is not one of agnostic, aware")
    return context, list(p.question + p.suffix)


def evaluate(model, sample: Sample, variants: list[Variant], max_new_tokens: int, mode: str = "agnostic",
             kl: bool = True) -> list[Answer]:
    """Every variant's greedy answer to the sample's first question, one variant at a time, and with `kl` the
    per-token KL and NLL along the sample's reference text if it has one (its answers: none), else along the full
    cache's answer (the variant of kind `full`, which must be there)."""
    full = [v for v in variants if v.kind == "full"]
    if len(full) != 1:
        raise ValueError("the reference needs exactly one 'full' variant as the reference for KL")
    base, tail = base_of(model, sample, mode)
    prose = bool(sample.prompt.reference)
    answers, logp_full, path = {}, None, None
    for variant in [full[0]] + [v for v in variants if v is not full[0]]:  # the full cache first: its answer is the path
        cache = compress(model, base, variant)
        tokens = [] if sample.metric == "none" else greedy_answer(model, cache, tail, base.length, max_new_tokens)
        if variant is full[0]:
            path = list(sample.prompt.reference) if prose else tokens
        kl_tokens, nll = [], []
        if kl and path:
            logp = path_logprobs(model, cache, tail, path, base.length)
            if logp_full is None:
                logp_full = logp
            kl_tokens = (logp_full.exp() * (logp_full - logp)).sum(-1).clamp_min(0).tolist()
            nll = (-logp.gather(-1, torch.tensor(path, device=logp.device)[:, None])[:, 0]).tolist()
        answers[id(variant)] = Answer(variant, tokens, kl_tokens, nll)
    return [answers[id(v)] for v in variants]
