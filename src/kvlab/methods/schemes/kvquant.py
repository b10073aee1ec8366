"""KVQuant-style: pre-RoPE keys per channel (calibrated range) on the calibrated non-uniform grid, the top
outliers of each key vector in fp16, the first `sink_tokens` in full precision; values per token as KIVI's."""

from __future__ import annotations

from kvlab.kernels.layouts import TensorCodes
from kvlab.methods.schemes.base import QuantScheme, calibration_table


class KVQuant(QuantScheme):
    name = "kvquant"
    default_residual = 32

    def problem(self):
        if self.bits not in (2, 4):
            return "bits", f"kvquant uses the calibrated 2- or 4-bit grid, got {self.bits}"
        if "press" in self.params:
            return "press", "kvquant un-rotates keys with every prefill position and cannot follow eviction; use kivi, int8 or fp8 with a press"
        return None

    def needs_calibration(self) -> bool:
        return True

    def _tables(self, layer: int, heads: int, head_dim: int):
        import torch

        bits = self.bits
        grids = calibration_table(self.params["calibration"], "kvquant_grids")
        g = grids[(grids["layer"] == layer) & (grids["bits"] == bits)].sort_values("level")
        if len(g) != 2**bits:
            raise ValueError(f"calibration has no {bits}-bit KVQuant grid for layer {layer}; calibrated bits: {sorted(grids['bits'].unique())}")
        r = calibration_table(self.params["calibration"], "kvquant_ranges")
        r = r[r["layer"] == layer].sort_values(["kv_head", "channel"])
        lo, hi = (torch.tensor(r[c].to_numpy(), dtype=torch.float32).view(heads, head_dim) for c in ("lo", "hi"))
        return torch.tensor(g["value"].to_numpy(), dtype=torch.float32), lo, hi

    def layer_spec(self, layer: int, heads: int, head_dim: int):
        from kvlab.kernels import codecs, kvcache

        levels, lo, hi = self._tables(layer, heads, head_dim)
        key = codecs.GridKeyCodec(self.bits, levels, lo, hi, kvcache.outliers_per_vector(self.params["outliers"], head_dim))
        value = codecs.AffineCodec(self.bits, self.group, "token")
        return kvcache.LayerSpec(key, value, group=self.group, residual=self.residual,
                                 sink_tokens=self.params["sink_tokens"], rope=True)

    def layouts(self, head_dim: int):
        from kvlab.kernels import kvcache

        outliers = kvcache.outliers_per_vector(self.params["outliers"], head_dim)
        return TensorCodes(self.bits, "static", outliers=outliers), TensorCodes(self.bits, "token", self.group)
