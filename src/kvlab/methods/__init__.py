"""Methods by name: config entries become variants (a method at one budget) the engine can apply.

Each `kind` is a class (``kvlab.methods.base.MethodKind``) registered in `KINDS`: ``full`` (no compression,
the reference), ``kvpress`` (any press class of kvpress by name), ``h2o`` (``kvlab.methods.h2o``: H2O as
published, scoring at every decoding step), and the quantized caches ``quant`` (by `scheme`,
``kvlab.methods.schemes``; it composes with a press), ``hf_quantized`` (``kvlab.methods.quantized``) and
``block_sparse`` (``kvlab.methods.block_sparse``: decode-time block selection over a cache kept whole) and
``cross_layer`` (``kvlab.methods.cross_layer``: layers reading an earlier layer's K/V, CLA post hoc) and
``prompt_compression`` (``kvlab.methods.prompt``: LLMLingua-style token dropping before the prompt is cached) and
``mikv`` (``kvlab.methods.mikv``: what a press would evict kept as low-bit codes, the rest in full precision). A
method that evicts runs at every budget; one that does not runs once, at budget 1.0. A new kind: its module
(a `MethodKind`), one line in `KINDS`, and its branch in workflow/config.schema.yaml (README "Add a method").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvlab.methods.base import Full, KVPress, MethodKind
from kvlab.methods.block_sparse import BlockSparse
from kvlab.methods.cross_layer import CrossLayer
from kvlab.methods.h2o import H2O
from kvlab.methods.mikv import MiKV
from kvlab.methods.prompt import PromptCompression
from kvlab.methods.quantized import HFQuantized, Quant

KINDS: dict[str, type[MethodKind]] = {k.name: k for k in (Full, KVPress, H2O, Quant, HFQuantized, BlockSparse, CrossLayer, PromptCompression,
                                                          MiKV)}


def kind_of(spec: dict) -> MethodKind:
    """The kind object of a config entry (with its `kind`; `tasks` is not the kind's)."""
    return KINDS[spec["kind"]]({k: v for k, v in spec.items() if k not in ("kind", "tasks")})


@dataclass(frozen=True)
class Variant:
    """One method at one budget: what the engine applies to a copy of the prefilled cache."""

    method: str  # the config name
    kind: str
    budget: float  # fraction of the context's KV entries kept (1.0 for full)
    params: dict = field(default_factory=dict)

    @cached_property
    def impl(self) -> MethodKind:
        """The kind object, built once per variant (the engine and the accounting ask it often)."""
        return KINDS[self.kind](self.params)

    @property
    def evicts(self) -> bool:
        return self.impl.evicts

    @property
    def label(self) -> str:
        return f"{self.method}@{self.budget:g}" if self.evicts else self.method

    @property
    def quantized(self) -> bool:
        return self.impl.quantized

    @property
    def storage(self) -> dict:
        """How the kept entries are stored, for result rows: scheme, bits per element, KIVI axes."""
        return self.impl.storage

    @property
    def rerotates(self) -> bool:
        """Whether kept keys are re-rotated to consecutive positions 0…n-1 (kvpress's KeyRerotationPress, as
        StreamingLLM assigns positions within the cache); decoding then continues at position n, not at the
        prompt's length (as kvpress's pipeline does)."""
        return self.params.get("wrapper") == "KeyRerotationPress"

    def make_press(self) -> Any:
        """A fresh kvpress press for this variant (None when it evicts nothing); see `press.make_press`."""
        from kvlab.methods.press import make_press

        return make_press(self.params, self.budget)


CALIBRATED = "calibrated"  # a kwarg value taken from the model's calibration instead of the config
CALIBRATED_KWARGS = {"n_sink": ("stream_sinks", "n_sink")}  # kwarg -> (calibration table, column)


def uses_calibration(methods: dict) -> bool:
    return any(
        v == CALIBRATED for m in methods.values() for v in m.get("kwargs", {}).values()
    ) or any(kind_of(m).needs_calibration() or m.get("layer_budgets") == CALIBRATED for m in methods.values())


def layer_budgets(budget: float, weights: list[float], sliding: list[bool]) -> list[float]:
    """Per-layer fractions kept whose mean over the compressed (non-sliding) layers is `budget`, in proportion
    to `weights` (calibration's `layer_budget.budget_weight`: how many keys a layer's attention needs); a layer
    never keeps more than all its tokens — what it cannot take is shared among the others in proportion."""
    idx = [i for i, s in enumerate(sliding) if not s]
    w = {i: max(float(weights[i]), 1e-6) for i in idx}
    out, free, total = {}, set(idx), budget * len(idx)
    while free:
        scale = (total - sum(out.values())) / sum(w[i] for i in free)
        full = {i for i in free if w[i] * scale >= 1.0}
        if not full:
            out.update({i: w[i] * scale for i in free})
            break
        out.update({i: 1.0 for i in full})
        free -= full
    return [out.get(i, 1.0) for i in range(len(sliding))]


def with_calibration(methods: dict, calibration_dir) -> dict:
    """`methods` with every `calibrated` kwarg replaced by the model's measured value, e.g. StreamingLLM's
    `n_sink` by the leading sink positions calibration found. Quantized methods that read calibration tables
    (FP8 scales, KVQuant grids) get the folder as `calibration`."""
    from pathlib import Path

    from pandas import read_parquet  # kvlab.io lies below the method kinds, but this module imports it not at all

    out = {}
    for name, spec in methods.items():
        kwargs = dict(spec.get("kwargs", {}))
        for key, value in kwargs.items():
            if value == CALIBRATED:
                table, column = CALIBRATED_KWARGS[key]
                kwargs[key] = int(read_parquet(Path(calibration_dir) / f"{table}.parquet")[column].iloc[0])
        out[name] = {**spec, "kwargs": kwargs} if "kwargs" in spec else dict(spec)
        if kind_of(spec).needs_calibration():
            out[name]["calibration"] = str(calibration_dir)
        if spec.get("layer_budgets") == CALIBRATED:
            table = read_parquet(Path(calibration_dir) / "layer_budget.parquet").sort_values("layer")
            out[name]["layer_budgets"] = [float(w) for w in table["budget_weight"]]
    return out


def evicts(spec: dict) -> bool:
    """Whether a method entry keeps a fraction of the context (and so runs at every budget)."""
    return kind_of(spec).evicts


def runs_on(spec: dict, task: str | None) -> bool:
    """Whether a method entry runs on `task` (its optional `tasks` list; every method when task is None)."""
    return task is None or task in spec.get("tasks", [task])


def variants(methods: dict, budgets: list[float], task: str | None = None) -> list[Variant]:
    """Expand config `methods` × `budgets` (methods without a press run once, at budget 1.0); with `task`,
    only the methods that run on it (a method's optional `tasks` list)."""
    out = []
    for name, spec in methods.items():
        if not runs_on(spec, task):
            continue
        kind = kind_of(spec)
        if kind.evicts:
            out.extend(Variant(name, spec["kind"], float(b), kind.params) for b in budgets)
        else:
            out.append(Variant(name, spec["kind"], 1.0, kind.params))
    return out
