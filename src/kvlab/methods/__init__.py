"""Methods by name: config entries become variants (a method at one budget) the engine can apply.

Kinds: ``full`` (no compression, the reference) and ``kvpress`` (any press class of kvpress by name).
A new kind is one module with a ``variants(name, spec, budgets)`` function plus one line in KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    """One method at one budget: what the engine applies to a copy of the prefilled cache."""

    method: str  # the config name
    kind: str
    budget: float  # fraction of the context's KV entries kept (1.0 for full)
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.method if self.kind == "full" else f"{self.method}@{self.budget:g}"

    def make_press(self) -> Any:
        """A fresh kvpress press for this variant (None for full)."""
        if self.kind == "full":
            return None
        import kvpress

        cls = getattr(kvpress, self.params["press"])
        return cls(compression_ratio=1.0 - self.budget, **self.params.get("kwargs", {}))


CALIBRATED = "calibrated"  # a kwarg value taken from the model's calibration instead of the config
CALIBRATED_KWARGS = {"n_sink": ("stream_sinks", "n_sink")}  # kwarg -> (calibration table, column)


def uses_calibration(methods: dict) -> bool:
    return any(v == CALIBRATED for m in methods.values() for v in m.get("kwargs", {}).values())


def with_calibration(methods: dict, calibration_dir) -> dict:
    """`methods` with every `calibrated` kwarg replaced by the model's measured value, e.g. StreamingLLM's
    `n_sink` by the leading sink positions calibration found."""
    import pandas as pd
    from pathlib import Path

    out = {}
    for name, spec in methods.items():
        kwargs = dict(spec.get("kwargs", {}))
        for key, value in kwargs.items():
            if value == CALIBRATED:
                table, column = CALIBRATED_KWARGS[key]
                kwargs[key] = int(pd.read_parquet(Path(calibration_dir) / f"{table}.parquet")[column].iloc[0])
        out[name] = {**spec, "kwargs": kwargs} if "kwargs" in spec else spec
    return out


def variants(methods: dict, budgets: list[float]) -> list[Variant]:
    """Expand config `methods` × `budgets` (full runs once, at budget 1.0)."""
    out = []
    for name, spec in methods.items():
        if spec["kind"] == "full":
            out.append(Variant(name, "full", 1.0))
        else:
            params = {k: v for k, v in spec.items() if k != "kind"}
            out.extend(Variant(name, spec["kind"], float(b), params) for b in budgets)
    return out
