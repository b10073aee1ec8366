"""Prompt compression, LLMLingua-style (kind prompt_compression): the tokens kept, their self-information, and the
compressed prompt's cache decoding as the short prompt itself would."""

import math

import pytest
import torch

from kvlab.engine import Batch, cache_stats, compress, prefill
from kvlab.engine.compress import SERVICES
from kvlab.engine.prefill import self_information
from kvlab.methods import Variant
from kvlab.methods.prompt import PromptCompression, information, kept_positions
from kvlab.tasks import KINDS


def test_keeps_the_budget_of_the_span_by_information():
    info = [math.inf, 5.0, 1.0, 3.0, 3.0, 0.5, 2.0, 9.0, 0.1]
    # span 1…7 (6 tokens): half is 3 — the scores 5, 3, 3 (position 3 before 4 on the tie: both kept), then 0, 7, 8
    assert kept_positions(info, (1, 7), 0.5, 9) == [0, 1, 3, 4, 7, 8]
    assert kept_positions(info, (1, 7), 1 / 6, 9) == [0, 1, 7, 8]
    assert kept_positions(info, (1, 7), 1.0, 9) == list(range(9))
    with pytest.raises(ValueError, match=r"span \(3, 12\) does not lie in a 9-token prompt"):
        kept_positions(info, (3, 12), 0.5, 9)


@pytest.mark.parametrize("cut", [None, 200])
def test_self_information_is_the_models_next_token_loss(tiny, cut):
    """From the prefill's hidden states, whole or continued (the context's scores, then the question's only)."""
    model, tokenizer = tiny
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"][:300]
    if cut is None:
        info = self_information(model, prefill(model, ids), chunk=64)
    else:
        context = prefill(model, ids[:cut])
        whole = prefill(model, ids[cut:], past=context)
        assert whole.parent is context and whole.hidden.shape[0] == len(ids)
        info = self_information(model, context, chunk=64) + self_information(model, whole, start=cut, chunk=64)
        shared = information(model, whole, SERVICES)  # the context's scores computed once, and kept on it
        torch.testing.assert_close(torch.tensor(shared), torch.tensor(info), rtol=1e-5, atol=1e-5)
        assert context.shared["self_information"] == shared[:cut]
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    want = -logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert info[0] == math.inf and len(info) == len(ids)
    torch.testing.assert_close(torch.tensor(info[1:]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("aware", [False, True])
def test_a_compressed_prompt_decodes_as_the_short_prompt(tiny, aware):
    """The cache holds the template head, the budget's share of the user's text and (aware) the question; fed the
    tail, it gives the logits of the short prompt run from scratch, whose positions start at 0."""
    model, tokenizer = tiny
    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}
    p = KINDS["niah"].generate("niah_single", spec, tokenizer, 300)[0].prompt
    assert 0 < p.head < len(p.context)
    base = prefill(model, p.context)
    base.span = (p.head, len(p.context))
    tail = p.question + p.suffix
    if aware:
        base, tail = prefill(model, p.question, past=base), p.suffix
    variant = Variant("lingua", "prompt_compression", 0.5, {})
    cache = compress(model, base, variant)
    span = len(p.context) - p.head
    kept = kept_positions(self_information(model, prefill(model, base.ids)), base.span, 0.5, base.length)
    assert len(kept) == p.head + round(0.5 * span) + (len(p.question) if aware else 0)
    assert kept[: p.head] == list(range(p.head)) and (not aware or kept[-len(p.question):] == list(range(len(p.context), base.length)))
    assert cache.layers[0].keys.shape[-2] == len(kept) and cache.position_shift == len(kept) - base.length
    assert cache_stats(cache, variant, base.length)["compression_vs_bf16"] == pytest.approx(base.length / len(kept))
    ours = Batch(model, [cache]).forward(torch.tensor([tail]), base.length)[0, -1]
    with torch.no_grad():
        short = model(input_ids=torch.tensor([[base.ids[i] for i in kept] + tail])).logits[0, -1]
    torch.testing.assert_close(ours, short, rtol=1e-4, atol=1e-4)


def test_models_with_sliding_window_layers_are_refused():
    with pytest.raises(ValueError, match="method 'lingua': prompt compression moves positions"):
        PromptCompression({}).apply(None, None, None, Variant("lingua", "prompt_compression", 0.5, {}), [True, False], SERVICES)
