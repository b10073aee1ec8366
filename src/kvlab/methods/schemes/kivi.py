"""KIVI: keys per channel in groups of G tokens, values per token in groups of G channels, asymmetric min–max,
recent tokens in full precision; `key_axis` / `value_axis` swap the axes for the 2-bit ablation.

`policy` says which recent tokens stay in full precision (``kvlab.kernels.layouts.coded_tokens``): ``kivi``
(the default) streams as KIVI's own code does: keys R at a time once R are held (0 to R − 1 stay), values one
at a time beyond the newest R; ``together`` is kvlab's earlier policy: keys and values move together in whole
groups beyond the newest R (R to R + G − 1 stay)."""

from __future__ import annotations

from kvlab.kernels.layouts import TensorCodes, kivi_residual_problem
from kvlab.methods.schemes.base import QuantScheme


class KIVI(QuantScheme):
    name = "kivi"
    default_residual = 32

    @property
    def axes(self) -> tuple[str, str]:
        return self.params["key_axis"], self.params["value_axis"]

    @property
    def policy(self) -> str:
        return self.params.get("policy", "kivi")

    @property
    def storage(self) -> dict:
        return {**super().storage, "policy": self.policy}

    def problem(self):
        bits, group = self.bits, self.group
        if group > 1 and group % (8 // bits):
            return "group", f"{bits}-bit codes pack {8 // bits} per byte; group must be a multiple of that"
        if self.policy == "kivi" and "channel" in self.axes and (problem := kivi_residual_problem(self.residual, group)):
            return "residual", f"{problem} (or set policy: together)"
        return None

    def layer_spec(self, layer: int, heads: int, head_dim: int):
        from kvlab.kernels import codecs, kvcache

        (key_axis, value_axis), group = self.axes, self.group
        return kvcache.LayerSpec(codecs.AffineCodec(self.bits, group, key_axis), codecs.AffineCodec(self.bits, group, value_axis),
                                 group=group, residual=self.residual, policy=self.policy)

    def layouts(self, head_dim: int):
        (key_axis, value_axis), group = self.axes, self.group
        return TensorCodes(self.bits, key_axis, group), TensorCodes(self.bits, value_axis, group)
