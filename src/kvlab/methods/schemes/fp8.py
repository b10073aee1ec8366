"""FP8 E4M3, every token at once: static per-(layer, KV head) scales from calibration, or one dynamic
per-tensor scale per layer set at prefill (`scales: calibrated | dynamic`)."""

from __future__ import annotations

from kvlab.kernels.layouts import TensorCodes
from kvlab.methods.schemes.base import QuantScheme, calibration_table


class FP8(QuantScheme):
    name = "fp8"
    fixed_bits = 8

    def needs_calibration(self) -> bool:
        return self.params["scales"] == "calibrated"

    def _scales(self, layer: int, tensor: str):
        import torch

        from kvlab.kernels import quant

        if not self.needs_calibration():
            return None
        t = calibration_table(self.params["calibration"], "fp8_scales")
        rows = t[(t["layer"] == layer) & (t["tensor"] == tensor)].sort_values("kv_head")
        # a head calibration saw all zero keeps |x| up to FP8_MIN_PEAK, not a 1e-12 scale that saturates everything
        return torch.tensor(rows["scale"].to_numpy(), dtype=torch.float32).clamp_min(quant.FP8_MIN_PEAK / quant.FP8_MAX)

    def layer_spec(self, layer: int, heads: int, head_dim: int):
        from kvlab.kernels import codecs, kvcache

        key, value = (codecs.FP8Codec(self._scales(layer, t)) for t in ("key", "value"))
        return kvcache.LayerSpec(key, value, group=1, residual=self.residual)

    def layouts(self, head_dim: int):
        codes = TensorCodes(8, "static" if self.needs_calibration() else "tensor")
        return codes, codes
