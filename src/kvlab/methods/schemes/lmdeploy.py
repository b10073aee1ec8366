"""LMDeploy/TurboMind-style KV quantization (its `quant_policy` 4 and 8): INT4 or INT8 per KV head and per
token, asymmetric, with a scale and zero point per (token, head) and no full-precision residual: every token
is quantized when it is written, decoded ones included. The layout that serving engine ships, beside KIVI's
per-channel keys. At 8 bits it stores what `int8` stores."""

from __future__ import annotations

from kvlab.methods.schemes.int8 import PerTokenInt


class LMDeploy(PerTokenInt):
    name = "lmdeploy"

    def problem(self):
        if self.bits not in (4, 8):
            return "bits", f"lmdeploy quantizes KV to 4 or 8 bits (quant_policy 4 / 8), got {self.bits}"
        return None
