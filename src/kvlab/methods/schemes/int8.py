"""INT8 per token: asymmetric min–max over each head's channels, every token at once (R = 0 unless set)."""

from __future__ import annotations

from kvlab.kernels.layouts import TensorCodes
from kvlab.methods.schemes.base import QuantScheme


class PerTokenInt(QuantScheme):
    """Per (token, KV head) asymmetric integers over the head's D channels, one fp16 scale and zero point each,
    both tensors alike, each token quantized as it is written (group 1)."""

    def layer_spec(self, layer: int, heads: int, head_dim: int):
        from kvlab.kernels import codecs, kvcache

        codec = codecs.AffineCodec(self.bits, head_dim, "token")
        return kvcache.LayerSpec(codec, codec, group=1, residual=self.residual)

    def layouts(self, head_dim: int):
        codes = TensorCodes(self.bits, "token", head_dim)
        return codes, codes


class INT8(PerTokenInt):
    name = "int8"
    fixed_bits = 8
