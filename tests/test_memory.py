"""The memory budget: a job's variants split into waves give the rows one wave gives, on every cache kind and every
question mode, on the sharpened tiny model in fp32: every non-timing column equal (answers, scores, first divergences,
bytes), but the KL columns, which a teacher-forced batch of other rows rounds differently (fp32 reductions over other
padded widths: up to 1.5e-7 relative measured here), equal within ROUNDING."""

import math

import pytest

from kvlab.compare_runs import VARYING
from kvlab.engine import evaluate_samples
from kvlab.methods import build, variants
from kvlab.tasks import GENERATORS

SNAP = {"window_size": 16, "kernel_size": 5}
METHODS = {
    "full": {"kind": "full"},
    "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": SNAP},
    "streaming": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": 4}},
    "fp8": {"kind": "quant", "scheme": "fp8", "scales": "dynamic"},
    "kivi2": {"kind": "quant", "scheme": "kivi", "bits": 2, "group": 16, "residual": 16, "key_axis": "channel",
              "value_axis": "token"},
    "h2o": {"kind": "h2o", "recent": 0.5},
    "mikv2": {"kind": "mikv", "scorer": "SnapKVPress", "kwargs": SNAP, "bits": 2, "group": 16, "residual": 16},
}


def in_waves(size: int):
    """Waves of at most `size` variants besides the reference (which every wave holds)."""
    def waves(grid, ref, context):
        rest = [i for i in range(len(grid)) if i != ref]
        return [sorted([ref, *rest[k : k + size]]) for k in range(0, len(rest), size)]
    return waves


ROUNDING = 1e-5  # relative
ROUNDED = {"kl_vs_full", "kl_max", "nll", "ppl", "noise_kl", "noise_kl_max"}  # read from a batch's logits


def same(column: str, a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if column in ROUNDED:
            return math.isclose(a, b, rel_tol=ROUNDING, abs_tol=1e-9)
    return a == b


@pytest.mark.parametrize("size", [1, 3])
def test_rows_in_waves_equal_rows_in_one_wave(tiny, sharp, size):
    tokenizer = tiny[1]
    spec = {"kind": "multi_turn", "depths": [0.3], "samples": 2, "seed": 2}
    samples = GENERATORS["multi_turn"]("multi_turn", spec, tokenizer, 400)
    grid = variants(build(METHODS), [0.25, 0.5])
    modes = ["agnostic", "aware", "multi_turn"]
    one = evaluate_samples(sharp, tokenizer, samples, grid, modes, 8, noise_samples=1)
    split = evaluate_samples(sharp, tokenizer, samples, grid, modes, 8, noise_samples=1, waves=in_waves(size))
    assert len(one) == len(split) > len(grid)
    assert {r["waves"] for r in one} == {1} and {r["waves"] for r in split} == {-(-(len(grid) - 1) // size)}
    for a, b in zip(one, split):
        differ = [c for c in a if not VARYING.search(c) and c != "waves" and not same(c, a[c], b[c])]
        assert not differ, (a["method"], a["budget"], a["question_mode"], {c: (a[c], b[c]) for c in differ})
    assert any(r["diverged_at"] is not None for r in split)  # some rows left the full answer: their decoding was joined
