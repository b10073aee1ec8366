"""A dataset template's text outside {context} stays uncompressed, as kvpress compresses only the context it is given:
the text before {context} (with the chat template's head) is the prompt's `prefix`, which no method evicts and which
budgets do not count; the text after it goes with the question. Other tasks' prompts have no prefix."""

import json

import pytest
import torch

from kvlab.engine import compress, prefill
from kvlab.steps.evaluate import run_job
from kvlab.methods import build, variants
from kvlab.tasks import generate

INSTRUCTION = "Answer the question from the documents below with the answer alone, in as few words as possible."
TEMPLATE = INSTRUCTION + "\n\n{context}\n\nQuestion: {question}"
ROWS = [{"id": f"r{i}", "context": f"Document {i}. The code of vault {i} is {1000 + i}. " + "Filler words go here. " * 12,
         "question": f"What is the code of vault {i}?", "answers": [str(1000 + i)]} for i in range(3)]
METHODS = {
    "full": {"kind": "full"},
    "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}},
    "streaming_llm": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}},
    "knorm": {"kind": "kvpress", "press": "KnormPress"},
    "pyramidkv": {"kind": "kvpress", "press": "PyramidKVPress", "kwargs": {"window_size": 16}},
    "rerotated": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}, "wrapper": "KeyRerotationPress"},
    "adakv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}, "wrapper": "AdaKVPress"},
    "h2o": {"kind": "h2o", "recent": 0.5},
    "mikv2": {"kind": "mikv", "scorer": "SnapKVPress", "kwargs": {"window_size": 16}, "bits": 2, "group": 16, "residual": 16},
}


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"kind": "dataset", "path": str(path), "columns": {}, "metric": "qa_f1", "template": TEMPLATE,
            "context_tokens": [0], "samples": 2, "seed": 0}


def test_the_instruction_is_the_uncompressed_prefix_and_the_text_after_the_document_goes_with_the_question(spec, tiny):
    tokenizer = tiny[1]
    for sample in generate("mine", spec, tokenizer, 0):
        p = sample.prompt
        head = tokenizer.decode(p.context[: p.prefix])
        assert head.endswith(INSTRUCTION + "\n\n") or head.endswith(INSTRUCTION), head  # the chat head, then the instruction
        assert tokenizer.decode(p.context[p.prefix :]).startswith("\n\nDocument" if not head.endswith("\n\n") else "Document")
        assert tokenizer.decode(p.question).startswith("\n\nQuestion: What is the code of vault")
        assert sample.row()["prefix_tokens"] == p.prefix > len(INSTRUCTION) // 2
    niah = generate("niah", {"kind": "niah", "context_tokens": [512], "depths": [0.5], "samples": 1, "seed": 0, "keys": 1,
                             "values": 1, "queries": 1, "haystack": "noise", "question_position": "after"}, tokenizer, 512)
    assert niah[0].prompt.prefix == 0 and niah[0].row()["prefix_tokens"] is None  # other tasks: as before


def _kept(base_keys: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(H, T) whether each position's key of `base_keys` (1, H, T, D) is among the kept `keys` (1, H, n, D)."""
    return (base_keys[0, :, :, None, :] == keys[0, :, None, :, :]).all(-1).any(-1)


def test_agnostic_compression_keeps_every_instruction_token(spec, tiny):
    """On the tiny model, each evicting method at a 10% budget, compressing the context before any question: every
    position of the prefix is still in every layer and head, and the rest keeps the budget's share of the document.
    Without the prefix the same presses evict part of the instruction (what the issue saw)."""
    model, tokenizer = tiny
    sample = generate("mine", spec, tokenizer, 0)[0]
    p = sample.prompt
    base = prefill(model, p.context)
    base.prefix = p.prefix
    plain = prefill(model, p.context)  # the same context, as it was compressed before: no prefix
    t = len(p.context)
    lost_before = 0
    for variant in variants(build(METHODS), [0.1]):
        if variant.kind == "full":
            continue
        cache, old = compress(model, base, variant), compress(model, plain, variant)
        for idx, layer in enumerate(cache.layers):
            full_keys = base.cache.layers[idx].keys
            if variant.kind == "mikv":  # kept tokens stay in full precision, first: the layer's sink keys
                keys, n = layer.sink_keys, layer.sink_keys.shape[-2]
            else:
                keys, n = layer.keys, layer.keys.shape[-2]
            kept = _kept(full_keys, keys)
            if getattr(layer, "masked", None) is not None:  # AdaKV hides entries per head instead of freeing them
                kept = ~layer.masked[0]
            assert kept[:, : p.prefix].all(), (variant.label, idx)
            if variant.params.get("press") != "PyramidKVPress" and "wrapper" not in variant.params or \
                    variant.params.get("wrapper") == "KeyRerotationPress":
                assert n == p.prefix + int((t - p.prefix) * 0.1), (variant.label, idx, n)
            old_layer = old.layers[idx]
            if variant.kind != "mikv" and getattr(old_layer, "masked", None) is None:
                lost_before += int((~_kept(full_keys, old_layer.keys)[:, : p.prefix]).sum())
    assert lost_before > 0


def test_a_job_on_a_templated_dataset_keeps_the_prefix_and_prices_it(spec, tiny_dir, tmp_path):
    """Rows carry prefix_tokens; an evicting press holds the prefix plus the budget's share of the rest in both
    question modes, and the byte formula prices exactly that."""
    run = {"methods": build({k: METHODS[k] for k in ("full", "snapkv", "streaming_llm", "h2o")}), "budgets": [0.25],
           "question_modes": ["agnostic", "aware"], "max_new_tokens": 4, "noise_floor_samples": 0, "dtype": "float32",
           "device": "cpu", "threads": 1}
    rows = run_job(tiny_dir, "mine", spec, 0, run, tmp_path / "out.parquet")
    assert (rows["prefix_tokens"] > 0).all()
    evicted = rows[rows["method"] != "full"]
    want = evicted["prefix_tokens"] + ((evicted["compressed_tokens"] - evicted["prefix_tokens"]) * 0.25).astype(int)
    assert (evicted["kv_tokens_mean"] == want).all()
    assert (rows["kv_bytes"] == rows["kv_bytes_formula"]).all()
