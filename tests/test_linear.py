"""Packed linear layers (kvlab.kernels.linear) against torch's ``linear``, their reference."""

import pytest
import torch
from torch import nn

from kvlab.kernels.linear import PackedLinear, pack_linears, packable

BF16 = packable(torch.empty(1, dtype=torch.bfloat16))


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((1, 96), (3, 96), (2, 5, 96), (300, 96))]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16, reason="bf16 is packed only on a bf16-capable CPU (AVX512-BF16 or AMX)"))])
def test_packed_product_is_linear(dtype, bias):
    """bf16: oneDNN's GEMM either way, so bitwise; fp32: oneDNN against MKL, within fp32 rounding."""
    torch.manual_seed(1)
    ref = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(ref.weight, ref.bias)
    assert torch.equal(packed.weight, ref.weight) and packed.weight.layout == torch.strided  # what kvpress may read
    with torch.no_grad():
        for x in inputs(dtype):
            out, want = packed(x), ref(x)
            assert out.shape == want.shape == (*x.shape[:-1], 200) and out.dtype == dtype
            if dtype == torch.bfloat16:
                assert torch.equal(out, want)
            else:
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(packed(inputs(dtype)[0] + 1), ref(inputs(dtype)[0]))  # the comparison can fail


def test_packed_model_answers_as_the_plain_one(tiny, tiny_dir):
    """A job's model (kvlab.steps.evaluate.load_model) has every linear layer packed, the LM head too with its tied
    embeddings kept: its logits within fp32 rounding of the same weights loaded plainly, greedy tokens identical."""
    from kvlab.steps.evaluate import load_model

    model, _ = tiny
    plain = load_model(tiny_dir, "float32", "cpu", verify=False, pack=False)[0]
    linears = [name for name, m in plain.named_modules() if type(m) is nn.Linear]
    assert len(linears) == 7 * plain.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down; the LM head
    assert all(type(model.get_submodule(name)) is PackedLinear for name in linears)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, plain(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_pack_linears_replaces_only_packable_layers():
    net = nn.Sequential(nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 4).half(), nn.ReLU()), nn.Embedding(3, 8))
    assert pack_linears(net) == 1
    assert type(net[0]) is PackedLinear and type(net[1][0]) is nn.Linear  # fp16 has no packed kernel: left as is
    with pytest.raises(ValueError, match="float16 weight on cpu has no packed oneDNN kernel"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.float16))


def test_packed_linear_benchmark_times_both_ways(tmp_path, monkeypatch):
    """benchmarks/packed_linear.py: one row per dtype, weight and row count, both timings, the two results equal
    within rounding; a dtype without a packed kernel is skipped, not timed."""
    import importlib.util
    from pathlib import Path

    import pandas as pd

    path = Path(__file__).parents[1] / "benchmarks" / "packed_linear.py"
    spec = importlib.util.spec_from_file_location("packed_linear_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "WEIGHTS", {"small": (40, 24), "wide": (300, 24)})
    monkeypatch.setattr(bench, "ROWS", (1, 8))
    monkeypatch.setattr(bench, "per_call", lambda job, budget_s=0.3: (job(), 1e-3)[1])
    out = bench.main(["--dtypes", "float32", "float16", "--out", str(tmp_path / "p.parquet")])
    assert out.equals(pd.read_parquet(tmp_path / "p.parquet"))
    assert sorted(zip(out["weight"], out["rows"])) == [("small", 1), ("small", 8), ("wide", 1), ("wide", 8)]
    assert set(out["dtype"]) == {"float32"} and (out["max_abs_diff"] < 1e-5).all()
    assert out["linear_gbs"].tolist() == pytest.approx([40 * 24 * 4 / 1e6] * 2 + [300 * 24 * 4 / 1e6] * 2)
