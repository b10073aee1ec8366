"""The quantization-scheme interface of `kind: quant` (registered in `kvlab.methods.schemes.SCHEMES`).

A scheme turns the entry's parameters into the storage of one full-attention layer (a
`kvlab.kernels.kvcache.LayerSpec`: a codec per tensor, group, residual window, sinks) and into what the byte
formula counts (`kvlab.kernels.layouts.TensorCodes` per tensor). Kernels and torch are imported inside the
methods: config validation builds schemes without loading them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

from kvlab.methods.press import Problem


@lru_cache(maxsize=8)
def calibration_table(calibration_dir: str, name: str):
    """One calibration table of a model (a DataFrame), read once per process."""
    from kvlab.util.io import read_parquet

    return read_parquet(Path(calibration_dir) / f"{name}.parquet")


class QuantScheme(ABC):
    """One quantization scheme applied to an entry's `params` (schema defaults filled: bits 4, group 32), read once
    into typed fields: `bits` per code, `group` (tokens or channels per scale), `residual` R (the newest tokens kept
    in full precision). The codecs and the byte layouts are made from these fields."""

    name: ClassVar[str]
    default_residual: ClassVar[int] = 0  # R when the entry sets none: 0 quantizes every token, as deployed caches do
    fixed_bits: ClassVar[int | None] = None  # a scheme whose codes have one width whatever the entry says

    def __init__(self, params: dict):
        self.params = params
        self.bits: int = self.fixed_bits or params["bits"]
        self.group: int | None = params.get("group")  # the schema fills 32; fp8 and int8 use none
        self.residual: int = params.get("residual", self.default_residual)

    @property
    def axes(self) -> tuple[str | None, str | None]:
        """(key, value) quantization axes for the rows, where a scheme lets the config choose them."""
        return None, None

    @property
    def storage(self) -> dict:
        key_axis, value_axis = self.axes
        return {"scheme": self.name, "bits": self.bits, "key_axis": key_axis, "value_axis": value_axis, "policy": None}

    def problem(self) -> Problem:
        """A problem of the entry the schema cannot express (key under the method, message), or None."""
        return None

    def needs_calibration(self) -> bool:
        return False

    @abstractmethod
    def layer_spec(self, layer: int, heads: int, head_dim: int):
        """The `kvcache.LayerSpec` of full-attention layer `layer` (`heads` KV heads of `head_dim`)."""

    @abstractmethod
    def layouts(self, head_dim: int):
        """(key, value) `TensorCodes`: what the byte formula counts for one layer of this scheme's codes."""
