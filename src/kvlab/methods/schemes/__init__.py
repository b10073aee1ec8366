"""Quantization schemes of `kind: quant`, by the config's `scheme` name. A new scheme: its module here (a
`kvlab.methods.schemes.base.QuantScheme`) and one line in `SCHEMES` (the config's `scheme` choices are its keys);
any parameter of its own goes in `kvlab.methods.quantized.Quant.Params`."""

from kvlab.methods.schemes.base import QuantScheme
from kvlab.methods.schemes.fp8 import FP8
from kvlab.methods.schemes.ggml import GGML
from kvlab.methods.schemes.int8 import INT8
from kvlab.methods.schemes.kivi import KIVI
from kvlab.methods.schemes.kvquant import KVQuant
from kvlab.methods.schemes.lmdeploy import LMDeploy

SCHEMES: dict[str, type[QuantScheme]] = {s.name: s for s in (FP8, GGML, INT8, KIVI, KVQuant, LMDeploy)}
