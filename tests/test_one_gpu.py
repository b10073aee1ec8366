"""Ready for one GPU, checked on the CPU (issue 53, part 4): the engine's passes record no autograd graph, masked
attention over grouped heads takes a path CUDA's fused kernels accept and computes the same attention, a model loads
straight to its device with its dtype floor's copy only while the floor needs it, and a SLURM job's memory follows
the model and the context."""

from __future__ import annotations

import torch

from kvlab.engine import Batch, compress, prefill
from kvlab.evaluate import load_model
from kvlab.methods import Variant

KIVI4 = {"scheme": "kivi", "bits": 4, "group": 32, "residual": 32, "key_axis": "channel", "value_axis": "token"}


def test_a_jobs_model_asks_for_no_gradient_and_batch_forward_records_no_graph(tiny_dir):
    """A job's model (load_model) holds weights that need no gradient; and Batch.forward runs under no_grad itself
    (its decorators once sat on `streamable`): even a model whose weights ask for gradients, called where autograd
    is on, gives logits without a graph, and its modules run with autograd off."""
    for pack in (True, False):
        model = load_model(tiny_dir, "float32", "cpu", verify=False, pack=pack)[0]
        assert not any(p.requires_grad for p in model.parameters()), pack
    model.requires_grad_(True)  # as a model straight from transformers: only forward's own no_grad can save it now
    ids = list(range(40, 140))
    base = prefill(model, ids)
    caches = [compress(model, base, Variant("full", "full", 1.0)), compress(model, base, Variant("kivi4", "quant", 1.0, KIVI4))]
    seen = []
    hook = model.model.register_forward_hook(lambda module, args, out: seen.append(torch.is_grad_enabled()))
    try:
        with torch.enable_grad():
            batch = Batch(model, caches)
            logits = [batch.forward(torch.tensor([[7, 8, 9]] * 2), len(ids)), batch.forward(torch.tensor([[10]] * 2), len(ids) + 3)]
    finally:
        hook.remove()
    assert seen == [False, False]
    assert all(x.grad_fn is None and not x.requires_grad for x in logits)
