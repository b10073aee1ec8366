"""The cache-layer interface (kvlab.kernels.layer): a layer of a new kind declares its traits as class attributes
and the engine's batches honour them, with no other change to the engine."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from kvlab.engine import Batch, compress, prefill
from kvlab.kernels.layer import KVLayer, Masked, fork_layer, hidden_entries, own_layout, wants_query
from kvlab.methods import Variant
from kvlab.tasks import KINDS


class Watching(KVLayer):
    """A dense layer (concatenating, as transformers' DynamicLayer) that records the queries it is handed."""

    wants_query = True
    own_layout = True

    def __init__(self, layer):
        super().__init__()
        self.lazy_initialization(layer.keys, layer.values)
        self.keys, self.values, self.seen = layer.keys, layer.values, []

    def fork(self):
        out = super().fork()
        out.seen = self.seen  # one record for the copies the batch makes
        return out

    def update(self, key_states, value_states, cache_kwargs=None):
        self.seen.append(None if self.pending_query is None else tuple(self.pending_query.shape))
        self.pending_query = None
        return DynamicLayer.update(self, key_states, value_states, cache_kwargs)


class Plain(Watching):
    wants_query = False
    own_layout = False


def test_traits_of_transformers_layers_and_kvlab_layers():
    keys = torch.zeros(1, 2, 5, 4)
    dense = DynamicLayer()
    dense.lazy_initialization(keys, keys)
    assert not wants_query(dense) and not own_layout(dense) and hidden_entries(dense) is None
    hidden = torch.zeros(1, 2, 5, dtype=torch.bool)
    masked = Masked(keys, keys, hidden)
    assert hidden_entries(masked) is hidden and not own_layout(masked)
    copy = fork_layer(masked)
    assert copy is not masked and copy.keys is masked.keys
    with pytest.raises(ValueError, match=r"mask must be bool of the keys' \(batch, heads, tokens\) \(1, 2, 5\), got torch.bool \(1, 2, 4\)"):
        Masked(keys, keys, hidden[..., :4])


@pytest.mark.parametrize("kind", [Watching, Plain])
def test_a_new_layer_kind_is_batched_by_its_traits(tiny, kind):
    """A layer that wants queries gets each step's (1, H_q, n, D) before every update; one with its own layout is
    kept apart from the other rows (engine.PerRowLayer); either way it decodes as the dense rows beside it."""
    from kvlab.engine import PerRowLayer

    model, tokenizer = tiny
    p = KINDS["niah"].generate("niah_single", {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}, tokenizer, 300)[0].prompt
    base = prefill(model, p.context)
    full = compress(model, base, Variant("full", "full", 1.0))
    ours = compress(model, base, Variant("full", "full", 1.0))
    ours.layers = [kind(layer) for layer in ours.layers]
    tail = torch.tensor([p.question + p.suffix])
    batch = Batch(model, [ours, full])
    assert all(isinstance(layer, PerRowLayer) == kind.own_layout for layer in batch.cache.layers)
    logits = batch.forward(tail.expand(2, -1), base.length)
    logits = torch.cat([logits, batch.forward(logits[:, -1:].argmax(-1), base.length + tail.shape[1])], dim=1)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in ours.layers:
        if kind.own_layout:  # the batch's copies recorded each forward: the tail, then one token
            assert layer.seen == [(1, config.num_attention_heads, tail.shape[1], head_dim), (1, config.num_attention_heads, 1, head_dim)]
        else:  # stacked with the dense row into one tensor: its own update never runs
            assert layer.seen == []
