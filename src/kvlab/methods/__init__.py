"""Methods by name: config entries become variants (a method at one budget) the engine can apply.

Each `kind` is a class (``kvlab.methods.base.MethodKind``) registered in `KINDS`: ``full`` (no compression,
the reference), ``kvpress`` (any press class of kvpress by name), ``h2o`` (``kvlab.methods.h2o``: H2O as
published, scoring at every decoding step), and the quantized caches ``quant`` (by `scheme`,
``kvlab.methods.schemes``; it composes with a press), ``hf_quantized`` (``kvlab.methods.quantized``) and
``block_sparse`` (``kvlab.methods.block_sparse``: decode-time block selection over a cache kept whole) and
``cross_layer`` (``kvlab.methods.cross_layer``: layers reading an earlier layer's K/V, CLA post hoc) and
``prompt_compression`` (``kvlab.methods.prompt``: LLMLingua-style token dropping before the prompt is cached) and
``mikv`` (``kvlab.methods.mikv``: what a press would evict kept as low-bit codes, the rest in full precision), and
a serving engine's own cache, ``llamacpp`` and ``vllm`` (``kvlab.methods.serving``: llama.cpp's cache types and
vLLM's cache dtypes, each run by its engine). A
method that evicts runs at every budget; one that does not runs once, at budget 1.0. A new kind: its module
(a `MethodKind` declaring its parameters in its `Params`, from which kvlab.state.config makes the kind's branch of the
config schema) and one line in `KINDS` (README "Extending kvlab").

A config entry becomes a typed `Method` once (`build`, after the config is validated): its kind object holds the
entry's parameters, checked, and everything below (the engine, the byte accounting, the kernels' codecs) reads
that object. Snakemake hands the `Method`s to the jobs inside the rule's params, so a job builds none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvlab.methods.base import Full, KVPress, MethodKind
from kvlab.methods.block_sparse import BlockSparse
from kvlab.methods.cross_layer import CrossLayer
from kvlab.methods.h2o import H2O
from kvlab.methods.mikv import MiKV
from kvlab.methods.prompt import PromptCompression
from kvlab.methods.quantized import HFQuantized, Quant
from kvlab.methods.serving import LlamaCpp, Vllm

KINDS: dict[str, type[MethodKind]] = {k.name: k for k in (Full, KVPress, H2O, Quant, HFQuantized, BlockSparse, CrossLayer, PromptCompression,
                                                          MiKV, LlamaCpp, Vllm)}


def kind_of(entry: dict) -> MethodKind:
    """The kind object of a config entry (with its `kind`; `tasks` is not the kind's)."""
    return KINDS[entry["kind"]]({k: v for k, v in entry.items() if k not in ("kind", "tasks")})


@dataclass(frozen=True, repr=False)
class Method:
    """A config method entry, typed: its name, the entry (validated, schema defaults filled) and its kind object,
    built once here and shared by every variant of the method. Its repr is the entry's, so Snakemake's params
    check (which compares reprs) sees the same params as when jobs received the plain entries."""

    name: str
    entry: dict
    kind: MethodKind = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "kind", kind_of(self.entry))

    def __repr__(self) -> str:
        return repr(self.entry)

    @property
    def tasks(self) -> list[str] | None:
        """The tasks it runs on (its optional `tasks` list); None: every task."""
        return self.entry.get("tasks")

    def runs_on(self, task: str | None) -> bool:
        """Whether it runs on `task` (every method when task is None)."""
        return task is None or self.tasks is None or task in self.tasks

    @property
    def evicts(self) -> bool:
        """Whether it keeps a fraction of the context (and so runs at every budget)."""
        return self.kind.evicts

    def uses_calibration(self) -> bool:
        """Whether it reads the model's calibration: a `calibrated` kwarg or layer_budgets, or its kind's tables."""
        return (any(v == CALIBRATED for v in self.entry.get("kwargs", {}).values()) or self.kind.needs_calibration()
                or self.entry.get("layer_budgets") == CALIBRATED)

    def calibrated(self, calibration_dir) -> Method:
        """This method with every `calibrated` value taken from the model's calibration in `calibration_dir`:
        kwargs such as StreamingLLM's `n_sink` (the leading sink positions calibration found), per-layer budgets,
        and for a kind that reads calibration tables (FP8 scales, KVQuant grids) their folder as `calibration`.
        Itself when it reads none."""
        if not self.uses_calibration():
            return self
        from pathlib import Path

        from pandas import read_parquet  # kvlab.util.io lies below the method kinds, but this module imports it not at all

        entry = dict(self.entry)
        if "kwargs" in entry:
            kwargs = dict(entry["kwargs"])
            for key, value in kwargs.items():
                if value == CALIBRATED:
                    table, column = CALIBRATED_KWARGS[key]
                    kwargs[key] = int(read_parquet(Path(calibration_dir) / f"{table}.parquet")[column].iloc[0])
            entry["kwargs"] = kwargs
        if self.kind.needs_calibration():
            entry["calibration"] = str(calibration_dir)
        if entry.get("layer_budgets") == CALIBRATED:
            table = read_parquet(Path(calibration_dir) / "layer_budget.parquet").sort_values("layer")
            entry["layer_budgets"] = [float(w) for w in table["budget_weight"]]
        return replace(self, entry=entry)

    def variants(self, budgets: list[float]) -> list[Variant]:
        """The method at every budget when it evicts, else once at budget 1.0; each shares this kind object."""
        return [Variant(self.name, self.entry["kind"], float(b), self.kind.params, impl=self.kind)
                for b in (budgets if self.evicts else [1.0])]


def build(entries: Mapping[str, dict]) -> dict[str, Method]:
    """The config's `methods` (name: entry, validated) as typed `Method`s, in config order."""
    return {name: Method(name, entry) for name, entry in entries.items()}


@dataclass(frozen=True)
class Variant:
    """One method at one budget: what the engine applies to a copy of the prefilled cache. `impl`, the kind
    object, comes from the variant's `Method` (`Method.variants`); built from `kind` and `params` when not given."""

    method: str  # the config name
    kind: str
    budget: float  # fraction of the context's KV entries kept (1.0 for full)
    params: dict = field(default_factory=dict)
    impl: MethodKind = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.impl is None:
            object.__setattr__(self, "impl", KINDS[self.kind](self.params))

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


def uses_calibration(methods: Mapping[str, Method]) -> bool:
    """Whether any of `methods` reads the model's calibration (then its jobs take the calibration as input)."""
    return any(m.uses_calibration() for m in methods.values())


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


def with_calibration(methods: Mapping[str, Method], calibration_dir) -> dict[str, Method]:
    """`methods` with their `calibrated` values taken from the model's calibration (`Method.calibrated`)."""
    return {name: m.calibrated(calibration_dir) for name, m in methods.items()}


def for_task(methods: Mapping[str, Method], task: str | None) -> dict[str, Method]:
    """The methods that run on `task` (each one's optional `tasks` list); all when task is None."""
    return {name: m for name, m in methods.items() if m.runs_on(task)}


def variants(methods: Mapping[str, Method], budgets: list[float], task: str | None = None,
             engine: str | None = None) -> list[Variant]:
    """Expand `methods` × `budgets` (methods that evict nothing run once, at budget 1.0); with `task`, only the
    methods that run on it; those kvlab's engine runs (`engine` None), or the full reference and the methods of the
    serving engine `engine` (kvlab.methods.serving)."""
    return [v for m in for_task(methods, task).values() if m.kind.engine == engine or m.kind.name == "full"
            for v in m.variants(budgets)]


def engines(methods: Mapping[str, Method]) -> list[str]:
    """The serving engines some of `methods` run on (kvlab.methods.serving), in config order."""
    return list(dict.fromkeys(m.kind.engine for m in methods.values() if m.kind.engine is not None))
