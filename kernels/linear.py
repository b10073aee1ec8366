"""Linear layers whose weights are packed once for the CPU's oneDNN GEMM.

A decode step multiplies a few token rows by every weight of the model, so its matmuls are bound by how fast the
GEMM streams the weights. ``torch.nn.functional.linear`` hands oneDNN (bf16) or MKL (fp32) a plain row-major weight
at every call, which the library re-lays out or reads in a layout made for large M; the same product over a weight
packed once for the kernel is 1.5-4.6x faster at 1-16 rows, and no slower at 512 (`benchmarks/packed_linear.py`,
rows in results/bench/packed_linear.parquet; 2-core AVX512-BF16 EPYC: at 8 rows the MLP's gate projection 0.48 ->
0.21 ms in bf16 and 1.70 -> 0.37 ms in fp32, the LM head 18.3 -> 12.0 ms and 90.5 -> 19.6 ms).

torch packs weights this way itself when ``torch.compile`` freezes a CPU model (inductor's mkldnn fusion pass calls
the same two operators, ``mkldnn._reorder_linear_weight`` and ``mkldnn._linear_pointwise``). Compiling the
engine's many dynamic shapes would cost far more than it saves, and the public ``torch.utils.mkldnn.to_mkldnn``
keeps an unpacked oneDNN weight and converts every input and output (on the console, slower than the packed
product at 1, 8 and 512 rows in both dtypes), so kvlab calls the two operators directly. ``torch.nn.functional.linear`` is the reference beside it:

- bf16: torch's CPU ``linear`` runs oneDNN's bf16 GEMM as well, and the packed product equals it bitwise
  (tests/test_linear.py);
- fp32: ``linear`` runs MKL's SGEMM, oneDNN's sums in another order: equal within fp32 rounding, not bitwise. A job
  loads its model once and packs it (``kvlab.steps.evaluate.load_model``), so every answer and KL of a job, batched or
  one method at a time, goes through the same kernel.
"""

from __future__ import annotations

import torch
from torch import nn

# The rows the packed layout is made for: a decode step's few rows (prefill's hundreds run as fast, measured).
ROWS_HINT = 8


def packable(weight: torch.Tensor) -> bool:
    """Whether this CPU's oneDNN multiplies `weight`'s dtype natively: bf16 where the CPU has AVX512-BF16 or AMX
    (elsewhere oneDNN would emulate it), fp32 wherever oneDNN is built in."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class PackedLinear(nn.Module):
    """``linear(x, weight, bias)`` with `weight` (out_features, in_features) packed once for oneDNN (inference only:
    no gradient)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = ROWS_HINT):
        super().__init__()
        if not packable(weight):
            raise ValueError(f"PackedLinear: a {weight.dtype} weight on {weight.device} has no packed oneDNN kernel "
                             f"here; packable weights are CPU float32, or bfloat16 on a bf16-capable CPU")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        self.bias = None if bias is None else bias.detach().clone()  # its own copy (not a view of a weights file's map)

    @property
    def weight(self) -> torch.Tensor:
        """The weight (out_features, in_features) as a plain tensor, unpacked at each access: for code that reads a
        layer's weight (kvpress's CriticalKV and KVzip presses read `o_proj.weight`)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` of `model` by its ``PackedLinear`` (in place); the number replaced. A
    replaced layer's own weight is freed unless something else holds it (an LM head tied to the embeddings keeps
    the embeddings' weight, and adds its packed copy)."""
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and packable(child.weight)]
    for parent, name, child in todo:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(todo)
