"""KIVI: keys per channel in groups of G tokens, values per token in groups of G channels, asymmetric min–max,
the newest R tokens in full precision; `key_axis` / `value_axis` swap the axes for the 2-bit ablation."""

from __future__ import annotations

from kvlab.kernels.layouts import TensorCodes
from kvlab.methods.schemes.base import QuantScheme


class KIVI(QuantScheme):
    name = "kivi"
    default_residual = 32

    @property
    def axes(self) -> tuple[str, str]:
        return self.params["key_axis"], self.params["value_axis"]

    def problem(self):
        bits, group = self.bits, self.params["group"]
        if group > 1 and group % (8 // bits):
            return "group", f"{bits}-bit codes pack {8 // bits} per byte; group must be a multiple of that"
        return None

    def layer_spec(self, layer: int, heads: int, head_dim: int):
        from kvlab.kernels import codecs, kvcache

        (key_axis, value_axis), group = self.axes, self.params["group"]
        return kvcache.LayerSpec(codecs.AffineCodec(self.bits, group, key_axis), codecs.AffineCodec(self.bits, group, value_axis),
                                 group=group, residual=self.residual)

    def layouts(self, head_dim: int):
        (key_axis, value_axis), group = self.axes, self.params["group"]
        return TensorCodes(self.bits, key_axis, group), TensorCodes(self.bits, value_axis, group)
