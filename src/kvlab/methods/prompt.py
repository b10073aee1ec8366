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

from kvlab.methods.base import MethodKind


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

    def formula_bytes(self, geom, dtype: str, budget: float, tokens: int, held: float) -> int:
        """The dense bytes of the shorter prompt: how many tokens it kept depends on each prompt's template head
        and question, so the count is the one held."""
        return super().formula_bytes(geom, dtype, 1.0, int(held), held)

    def apply(self, model, cache, base, variant, sliding: list[bool]) -> None:
        """Replace `cache` (a copy of the full prefill `base`) by the prefill of the tokens kept."""
        from kvlab.engine.prefill import prefill, self_information

        if any(sliding):
            raise ValueError(f"method '{variant.method}': prompt compression moves positions, which this model's "
                             "sliding-window layers cannot follow in a batch; use a model without them")
        info = base.shared.get("self_information")  # the same at every budget
        if info is None:
            info = base.shared["self_information"] = self_information(model, base.ids)
        kept = kept_positions(info, base.span or (0, base.length), variant.budget, base.length)
        short = prefill(model, [base.ids[i] for i in kept])
        cache.layers = short.cache.layers
        cache.position_shift = len(kept) - base.length
