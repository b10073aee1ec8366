"""The fast engine (kvlab.engine.sample.evaluate_samples: variants batched, verified decoding, drafts, length buckets,
streamed teacher forcing) against the plain reference (kvlab.engine.reference: one variant, one token at a time), on
every cache kind: dense, evicted, quantized, H2O, MiKV.

Both run on the sharpened tiny model in fp32 on the CPU (the random tiny model at its own scale answers every prompt
alike; `conftest.sharpened`). They differ only in how they feed the same compressed caches (in a batch or alone, a
path in one pass or token by token), so they differ only by fp32 rounding: the answers must be equal token for token,
and KL and NLL equal within TOL."""

import pytest
import torch

from kvlab.engine import evaluate_samples
from kvlab.engine.reference import Reader, evaluate, greedy_answer, path_logprobs
from kvlab.engine import compress, prefill
from kvlab.methods import Variant, build, variants
from kvlab.tasks import KINDS

SNAP = {"window_size": 16, "kernel_size": 5}
METHODS = {  # one method per cache kind
    "full": {"kind": "full"},  # dense
    "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": SNAP},  # evicted
    "streaming": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}},  # evicted
    "fp8": {"kind": "quant", "scheme": "fp8", "scales": "dynamic"},  # quantized, every token
    "kivi2": {"kind": "quant", "scheme": "kivi", "bits": 2, "group": 16, "residual": 16, "key_axis": "channel",
              "value_axis": "token"},  # quantized, residual window
    "h2o": {"kind": "h2o", "recent": 0.5},  # evicts while decoding
    "mikv2": {"kind": "mikv", "scorer": "SnapKVPress", "kwargs": SNAP, "bits": 2, "group": 16, "residual": 16},
}
BUDGET = 0.25
TOKENS = 8
# fp32 rounding of a pass of many tokens against one token per pass, and of a batch against one row: on 4 samples ×
# these 7 variants (2-core EPYC, torch CPU kernels) the largest gap was 6.2e-6 (streaming's kl_max), most below 1e-6;
# the tolerance leaves room for other CPUs' kernels.
TOL = 1e-4


@pytest.fixture(scope="module")
def samples(tiny):
    spec = {"kind": "niah", "depths": [0.3, 0.7], "samples": 1, "seed": 1}
    return KINDS["niah"].generate("niah_single", spec, tiny[1], 400)


@pytest.fixture(scope="module")
def grid():
    return variants(build(METHODS), [BUDGET])


@pytest.fixture(scope="module")
def reference(sharp, samples, grid):
    return [evaluate(sharp, sample, grid, TOKENS) for sample in samples]


def test_fast_engine_equals_the_reference_on_every_cache_kind(tiny, sharp, samples, grid, reference):
    model, tokenizer = sharp, tiny[1]
    fast = evaluate_samples(model, tokenizer, samples, grid, ["agnostic"], TOKENS)  # both samples as one run
    kinds = set()
    for sample, answers in zip(samples, reference):
        mine = {(r["method"], r["budget"]): r for r in fast if r["sample_id"] == sample.sample_id}
        assert len(mine) == len(grid)
        for answer in answers:
            v, row = answer.variant, mine[(answer.variant.method, answer.variant.budget)]
            kinds.add(v.kind)
            assert row["new_tokens"] == len(answer.tokens), v.label
            assert row["prediction"] == tokenizer.decode(answer.tokens, skip_special_tokens=True), v.label
            for column, value in answer.columns().items():
                assert row[column] == pytest.approx(value, abs=TOL), (v.label, column)
    assert kinds == {"full", "kvpress", "quant", "h2o", "mikv"}


def test_the_answers_depend_on_the_cache(reference):
    """Otherwise the comparison above would hold for any engine: the sharpened model's answers change with what a
    cache kept (here most variants leave the full cache's answer at its first token), and KL is 0 for the full cache
    only."""
    answers = reference[0]
    assert len({tuple(a.tokens) for a in answers}) >= 4
    assert answers[0].variant.kind == "full" and max(answers[0].kl) == pytest.approx(0.0, abs=1e-7)
    assert all(max(a.kl) > 1e-3 for a in answers if a.variant.kind != "full")


def test_plain_forward_equals_the_model_without_a_cache_to_compress(sharp, samples):
    """A dense cache read by `Reader` (the model's own forward, one token at a time) gives what one forward pass over
    the whole sequence gives: the chunk mask and positions are right."""
    model = sharp
    p = samples[0].prompt
    base = prefill(model, p.context)
    cache = compress(model, base, Variant("full", "full", 1.0))
    assert Reader(model, cache).plain
    snap = compress(model, base, Variant("snapkv", "kvpress", BUDGET, {"press": "SnapKVPress", "kwargs": SNAP}))
    assert Reader(model, snap).plain  # evicted caches too go through the model's own forward; KVLayer kinds do not
    assert not Reader(model, compress(model, base, Variant("h2o", "h2o", BUDGET, {"recent": 0.5}))).plain
    tail = p.question + p.suffix
    answer = greedy_answer(model, cache, tail, base.length, TOKENS)
    logp = path_logprobs(model, cache, tail, answer, base.length)
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([p.context + tail + answer[:-1]]), logits_to_keep=len(answer)).logits[0]
    torch.testing.assert_close(logp, torch.log_softmax(whole.float(), -1), rtol=0, atol=TOL)
