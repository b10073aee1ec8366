"""Prompt compression, LLMLingua-style (Jiang et al. 2023, "LLMLingua"; the article's §7), in the engine: before
the prompt is cached, the evaluated model scores every token's self-information, −log p(token | the tokens before
it), and the least informative tokens of the compressible span are dropped down to the budget; the kept tokens are
prefilled again as a prompt of their own, at positions 0…m−1, and the tail continues at m.

Config: ``{kind: prompt_compression}``; runs at every budget: the share of the span's tokens kept. The span is the
user's text before the question (`Prompt.head` tokens of chat template before it and the question itself are
always kept); in question-aware mode the question follows the span and is kept. Token by token, by one score, as
LLMLingua's token-level step (its budget controller, coarse demonstration-level pass and iterative segments are not
reproduced); the scorer is the evaluated model. The llmlingua package loads its own scorer model from the hub and
returns text, not the token positions kept under this model's tokenizer, hence this module.
"""

from __future__ import annotations

from kvlab.methods.base import MethodKind, Services


def kept_positions(info: list[float], span: tuple[int, int], budget: float, length: int) -> list[int]:
    """Positions 0…length−1 kept: everything outside `span` (start, end), and in it the round(budget × its length)
    tokens of highest self-information `info` (earlier first on ties), in order."""
    start, end = span
    if not 0 <= start <= end <= length or len(info) < end:
        raise ValueError(f"prompt compression: span {span} does not lie in a {length}-token prompt with {len(info)} scores")
    keep = max(0, min(end - start, round(budget * (end - start))))
    ranked = sorted(range(start, end), key=lambda i: (-info[i], i))[:keep]
    return sorted([*range(start), *ranked, *range(end, length)])


class PromptCompression(MethodKind):
    """Drop the prompt's least informative tokens before caching it."""

    name = "prompt_compression"

    @property
    def evicts(self) -> bool:
        return True  # runs at every budget: the share of the span kept

    def formula_bytes(self, geom, dtype: str, budget: float, tokens: int, held: float, prefix: int = 0) -> int:
        """The dense bytes of the shorter prompt: how many tokens it kept depends on each prompt's template head
        and question, so the count is the one held."""
        return super().formula_bytes(geom, dtype, 1.0, int(held), held)

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Replace `cache` (a copy of the full prefill `base`) by the prefill of the tokens kept."""
        if any(sliding):
            raise ValueError(f"method '{variant.method}': prompt compression moves positions, which this model's "
                             "sliding-window layers cannot follow in a batch; use a model without them")
        short = shortened(model, base, variant.budget, services)
        cache.layers = services.shallow_copy(short.cache).layers
        cache.position_shift = short.length - base.length


def information(model, base, services: Services) -> list[float]:
    """Self-information of every token of `base`, computed once per prefill and shared by every budget. A
    continuation (the question after the context) extends its parent's scores: under a causal model a token's score
    does not depend on what follows it."""
    if "self_information" not in base.shared:
        known = information(model, base.parent, services) if base.parent is not None else []
        base.shared["self_information"] = known + services.self_information(model, base, start=len(known))
    return base.shared["self_information"]


def shortened(model, base, budget: float, services: Services):
    """The prefill of the tokens of `base` kept at `budget` (kept in `base.shared`, without captures: nothing
    compresses it further). When the span lies inside the parent prefill (the question-aware prompt continues the
    context), the tokens kept are the parent's plus every later one, so the parent's short prefill is continued
    instead of prefilling the kept context again."""
    key = ("prompt_compression", budget)
    if key not in base.shared:
        span = base.span or (0, base.length)
        parent = base.parent
        if parent is not None and parent.span == base.span and span[1] <= parent.length:
            short = services.prefill(model, base.ids[parent.length :], past=shortened(model, parent, budget, services))
        else:
            kept = kept_positions(information(model, base, services), span, budget, base.length)
            short = services.prefill(model, [base.ids[i] for i in kept])
        short.captures = []
        base.shared[key] = short
    return base.shared[key]
