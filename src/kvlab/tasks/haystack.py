"""Haystacks: the filler a needle hides in. `noise` repeats short synthetic sentences (RULER's essay-free
variant); `prose` is consecutive sentences of the King James Bible from an offset chosen by the sample's seed."""

from __future__ import annotations

import random

from kvlab.util.corpus import kjv_sentences

NOISE = (
    "The river runs slowly past the old stone mill.",
    "A bell rings somewhere across the quiet town.",
    "The wind moves through the tall summer grass.",
    "Clouds drift over the hills toward the sea.",
    "An old dog sleeps in the shade of the porch.",
    "The baker opens the shop before the sun is up.",
    "Rain taps gently on the roof of the barn.",
    "A cart rolls along the road to the market.",
)
KINDS = ("noise", "prose")


class Filler:
    """One sample's haystack: a start offset drawn once from `rng`, then any number of sentences from it
    (length fitting asks for many different counts of the same haystack)."""

    def __init__(self, kind: str, rng: random.Random):
        if kind not in KINDS:
            raise ValueError(f"haystack '{kind}' is unknown; use one of {', '.join(KINDS)}")
        self.kind = kind
        self.pool = NOISE if kind == "noise" else kjv_sentences()
        self.start = rng.randrange(len(self.pool))

    def take(self, n: int) -> list[str]:
        return [self.pool[(self.start + j) % len(self.pool)] for j in range(n)]

    def span(self, n: int) -> tuple | None:
        """The stretch of corpus `take(n)` returns, as `Sample.clash` compares them: (pool, start, n, pool size); None
        for the noise haystack, which every sample shares by design (RULER's noise haystack is one repeated text)."""
        return None if self.kind == "noise" else (self.kind, self.start, n, len(self.pool))
