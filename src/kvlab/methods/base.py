"""The method-kind interface. A config entry `methods.NAME` becomes a :class:`MethodKind` of its `kind`
(registered in `kvlab.methods.KINDS`), which owns everything kind-specific:

- its parameters (its `Params`, declared once: kvlab.util.params makes the config schema's branch of the kind from them)
  and their checks beyond the schema (:meth:`problem`, called by config validation);
- whether it evicts (then it runs at every budget) and whether it reads the model's calibration;
- what it does to a copy of the prefilled cache after any press has evicted (:meth:`apply`);
- how its kept entries are stored: the row columns (:attr:`storage`) and the byte layout the accounting
  formula counts (:meth:`layouts`);
- which measured caches it refuses (:meth:`check_cache`).

Modules holding kinds import torch and the kernels inside their methods only: config validation (every
snakemake start) constructs kinds without loading them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from kvlab.methods.press import PRESS_NAME, Problem, press_problem
from kvlab.util.params import param


@dataclass(kw_only=True)
class MethodParams:
    """The keys of a method entry besides `kind`: every kind's `Params` subclasses this."""

    tasks: list[str] | None = param(None, "run this method on these tasks only (default every task); the full reference runs "
                                    "everywhere", minItems=1, uniqueItems=True)
def region_keep(budget: float, tokens: int, prefix: int) -> float:
    """The share of all `tokens` to keep so that the first `prefix` are kept whole and `budget` of the others, counted
    as kvpress counts (int(n × budget)): prefix + int((tokens − prefix) × budget) tokens, nudged up by a thousandth of a
    token so that flooring `tokens` × the share gives that count exactly. `budget` itself when there is no prefix."""
    if not prefix:
        return budget
    return min(1.0, (prefix + int((tokens - prefix) * budget) + 1e-3) / tokens)


NO_STORAGE = {"scheme": None, "bits": None, "key_axis": None, "value_axis": None, "policy": None}


class Services(Protocol):
    """What the engine lends a kind's `apply` beyond the cache (kvlab.engine.compress.SERVICES), so that no kind
    imports the engine: a prefill of token ids (continuing `past`, a Prefilled), the self-information of a
    prefill's tokens from `start` on, and a copy of a cache that shares its tensors."""

    def prefill(self, model, ids: list[int], past=None): ...

    def self_information(self, model, base, start: int = 0) -> list[float]: ...

    def shallow_copy(self, cache): ...


class MethodKind:
    """A method entry of one kind. `params` is the entry as validated (schema defaults filled) without `kind`
    and `tasks`. The base class is a cache left as prefilled, evicted by a kvpress press when it has one."""

    name: ClassVar[str]
    Params: ClassVar[type] = MethodParams  # its parameters (kvlab.util.params); a kind with none of its own keeps these
    engine: ClassVar[str | None] = None  # None: kvlab's engine runs it; else the serving engine that does (methods.serving)

    def __init__(self, params: dict):
        self.params = params

    @property
    def evicts(self) -> bool:
        """Whether it keeps a fraction of the context, and so runs at every budget (any method with a press)."""
        return "press" in self.params

    def formula_bytes(self, geom, dtype: str, budget: float, tokens: int, held: float, prefix: int = 0) -> int:
        """The byte formula of a dense cache this kind leaves after a `tokens` prompt at `budget` (the row's
        kv_bytes_formula, beside the measured bytes; quantized kinds' rows carry the engine's own): the budget's
        share of the context at the run's dtype (`geom`: kvlab.kernels.accounting.KVGeometry), the `prefix`'s tokens
        kept whole beside it (`region_keep`). `held`: the tokens the cache was measured to hold per layer, for kinds
        whose count only the prompt decides."""
        from kvlab.kernels.accounting import Scheme, context_bytes

        return context_bytes(geom, Scheme.dense(dtype).with_keep(region_keep(budget, tokens, prefix)), tokens)

    @property
    def quantized(self) -> bool:
        """Whether its cache layers hold codes (such rows are batched layer by layer, one row each)."""
        return False

    def problem(self) -> Problem:
        """The first problem of the entry that the schema cannot express, or None. A press's own checks are
        made here for every kind that takes one (`kvlab.methods.press.press_problem`)."""
        return press_problem(self.params) if "press" in self.params else None

    def refusal(self, device: str) -> str | None:
        """Why this machine cannot run the entry on `device`, and what would (one line; the selected preset's methods
        are asked before any job, kvlab.state.config), or None; the base refuses none."""
        return None

    def needs_calibration(self) -> bool:
        """Whether it reads the model's calibration tables (then `params['calibration']` is their folder)."""
        return False

    @property
    def storage(self) -> dict:
        """Row columns: how kept entries are stored (scheme, bits per element, KIVI-style axes)."""
        return dict(NO_STORAGE)

    def apply(self, model, cache, base, variant, sliding: list[bool], services: Services) -> None:
        """Change a copy of the prefilled cache (`base`: engine.Prefilled) after any press evicted from it; leave
        the layers where `sliding` is True (sliding-window layers) alone; `services`: what the engine lends."""

    def layouts(self, head_dim: int):
        """(key, value) `kvlab.kernels.layouts.TensorCodes` of a layer of codes, for the byte formula; None
        for a kind whose layers are dense or not counted by the formula."""
        return None

    def check_cache(self, stats: dict, method: str) -> None:
        """Raise ValueError (one line, naming `method`) where the compressed cache, as measured (`stats`: the
        engine's cache_stats), is one the entry refuses; the base refuses none."""


class Full(MethodKind):
    """The uncompressed reference: the prefilled cache as it is (exactly one per config)."""

    name = "full"


class KVPress(MethodKind):
    """Any press class of kvpress, by name, with its keyword arguments (and an optional kvpress wrapper)."""

    name = "kvpress"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        press: str = param(doc="a kvpress press class name, e.g. SnapKVPress", pattern=PRESS_NAME)
        kwargs: dict = param({}, "keyword arguments of the press (compression_ratio is set from `budgets`)")
        wrapper: str | None = param(
            None, "a kvpress wrapper press built around `press`: KeyRerotationPress (kept keys re-rotated to positions 0…n-1, "
            "decoding continues at n), MergingPress (evicted values merged into their most similar kept token), …", pattern=PRESS_NAME)
        wrapper_kwargs: dict | None = param(None, "keyword arguments of the wrapper (its `press` is set for you)")
        layer_budgets: Literal["calibrated"] | None = param(
            None, "per-layer budgets from the model's calibration (layer_budget: the share of keys holding 90% of each layer's "
            "attention), scaled so the layers keep `budget` of the context on average")
