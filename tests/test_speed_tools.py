"""The evaluation speed tools: `dtype: auto`, the profile of one job and the A/B timing of one job."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from conftest import ROOT
from kvlab.util import hardware


@pytest.mark.parametrize("amx,avx512,expected", [(True, False, "bfloat16"), (False, True, "bfloat16"),
                                                  (False, False, "float32")])
def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch, amx, avx512, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512)
    assert hardware.compute_dtype("auto", "cpu") == expected
    assert hardware.compute_dtype("float32", "cpu") == "float32"  # a forced dtype is kept
    assert hardware.compute_dtype("bfloat16", "cpu") == "bfloat16"
    kind = "AMX" if amx else "AVX512-BF16" if avx512 else "no native bf16"  # rows name the CPU and its bf16 kind
    assert hardware.device_name("cpu") == f"cpu ({hardware.cpu_model()}, {kind}, {torch.get_num_threads()} threads)"
    if Path("/proc/cpuinfo").exists():
        assert f"model name\t: {hardware.cpu_model()}" in Path("/proc/cpuinfo").read_text()


def smoke_config(tmp_path, methods: list[str]) -> str:
    """The repository's config with the smoke preset's methods cut to `methods` (none reads a calibration)."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    smoke = config["presets"]["smoke"]
    smoke["methods"] = {name: smoke["methods"][name] for name in methods}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_profile_splits_a_job_into_phases_and_operators(tiny_dir, tmp_path, monkeypatch):
    from kvlab.tools import profile_eval
    from kvlab.tools.profile_eval import main

    monkeypatch.setattr(profile_eval, "MATMUL_SHAPES", ((64, 64, 64),))  # the peak's own test is below; at the engine's shapes it takes 14 s
    config = smoke_config(tmp_path, ["full", "snapkv", "kivi2", "h2o"])
    out = main(["--model-dir", str(tiny_dir), "--task", "niah_single", "--ctx", "512", "--preset", "smoke",
                "--config", config, "--dtype", "float32", "--threads", "1", "--repeats", "2",
                "--out", str(tmp_path / "p.parquet")])
    assert out.equals(pd.read_parquet(tmp_path / "p.parquet"))
    from kvlab.util.hardware import bf16_matmul_native

    assert set(out["dtype"]) == {"float32"} and set(out["threads"]) == {1}  # the command line's, not the config's 2
    assert set(out["cpu_kind"]) == {"bf16-capable" if bf16_matmul_native("cpu") else "fp32 only (no AVX512-BF16 or AMX)"}
    phases = out[out["kind"] == "phase"].set_index("name")
    # one prefill per question mode's compression (context, then the question after it), every variant compressed
    assert phases.loc["prefill", "calls"] == 2 and phases.loc["compress", "calls"] == 2 * out["variants"].iloc[0]
    # the full answers of both compressions decoded together (one batch of references), each then verified; their
    # noise floor read from that decoding's own steps, none stepped again (no noise_floor call)
    assert phases.loc["decode_reference", "calls"] == 1 and phases.loc["noise_floor", "calls"] == 0
    assert phases.loc["teacher_forced", "calls"] == 2
    # every pass of the model (a prefill, or a batched step: Batch.forward) runs attention once per layer; the passes
    # that hold quantized or H2O rows update them once per layer
    model = json.loads((tiny_dir / "config.json").read_text())
    layers, passes = model["num_hidden_layers"], phases.loc["prefill", "calls"] + phases.loc["forward", "calls"]
    assert phases.loc["attention", "calls"] == layers * passes
    assert phases.loc["rows_update", "calls"] in range(layers, layers * phases.loc["forward", "calls"] + 1, layers)
    # the forward phase times the engine's batched passes (Batch.forward) whole: the masks they build and the
    # quantized rows' updates they run happen inside them and nowhere else (once it timed only `streamable`)
    inside = phases.loc["masks", "seconds"] + phases.loc["rows_update", "seconds"]
    assert phases.loc["masks", "calls"] > 0 and phases.loc["forward", "seconds"] >= inside > 0
    wall = out.set_index("name").loc["profiled_wall_s", "seconds"]
    assert (phases["seconds"] <= wall).all()
    ops = out[out["kind"] == "operator"]
    roof = out[out["kind"] == "roofline"].set_index("name")
    # the matmul operators' self time is the time their rate is read over
    assert ops.set_index("name").loc["matmul", "seconds"] == pytest.approx(roof.loc["matmul_gflops", "seconds"])
    # every prompt token goes through every layer's projections at least once (2 flops per weight); the context's
    # prefill attends causally: query i to i + 1 keys, 2 x (D_qk + D_v) flops a pair, in every query head and layer
    from kvlab.tasks import generate
    from kvlab.tools.bench_eval import job_settings
    from transformers import AutoTokenizer

    spec, _ = job_settings(Path(config), "niah_single", "smoke")
    prompt = generate("niah_single", spec, AutoTokenizer.from_pretrained(tiny_dir), 512)[0].prompt
    hidden, heads, kv_heads, dim = (model[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    weights = layers * (hidden * dim * (2 * heads + 2 * kv_heads) + 3 * hidden * model["intermediate_size"])
    assert roof.loc["matmul_gflop", "value"] >= 2 * weights * prompt.tokens / 1e9
    n = len(prompt.context)
    causal_gflop = layers * heads * n * (n + 1) // 2 * 2 * (2 * dim) / 1e9
    # each call at the slower of its flops at the peak and its bytes at the bandwidth: no less than either floor
    assert roof.loc["roofline_floor_s", "seconds"] >= max(
        roof.loc["matmul_floor_s", "seconds"], roof.loc["matmul_gbytes", "value"] / roof.loc["peak_bandwidth_gbs", "value"])
    # one sample, profiled whole: the job's flops counted by FlopCounterMode are the profiler's own count
    assert set(out["samples"]) == set(out["profiled_samples"]) == {1}
    rate = roof.loc["matmul_gflops"]  # the profiled sample's flops over their seconds, the packed linears' from shapes
    assert rate["value"] * rate["seconds"] == pytest.approx(roof.loc["matmul_gflop", "value"])
    assert roof.loc["matmul_floor_s", "seconds"] == pytest.approx(
        roof.loc["matmul_gflop", "value"] / roof.loc["peak_matmul_gflops", "value"])
    wall = out.set_index("name").loc["wall_s"]  # the median of two runs, with the fastest and the slowest beside it
    assert wall["calls"] == 2 and wall["low"] <= wall["seconds"] <= wall["high"]
    assert roof.loc["wall_over_floor", "value"] == pytest.approx(wall["seconds"] / roof.loc["matmul_floor_s", "seconds"])
    assert roof.loc["wall_over_floor", "high"] == pytest.approx(wall["high"] / roof.loc["matmul_floor_s", "seconds"])
    # attention's products: counted in every layer's SDPA call, and added to the matmuls' floor
    assert roof.loc["attention_gflop", "value"] >= causal_gflop
    assert roof.loc["attention_gflop", "calls"] == phases.loc["attention", "calls"]  # one SDPA kernel per layer and pass
    assert roof.loc["matmul_attention_floor_s", "seconds"] == pytest.approx(
        (roof.loc["matmul_gflop", "value"] + roof.loc["attention_gflop", "value"]) / roof.loc["peak_matmul_gflops", "value"])


def test_peak_matmul_rate_counts_the_flops_it_times(monkeypatch):
    """The roof: 2·M·K·N flops per product over the seconds the products took, the best shape's rate."""
    import kvlab.tools.profile_eval as pe

    clock = iter(range(100))
    monkeypatch.setattr(pe, "MATMUL_SHAPES", ((4, 3, 5), (2, 2, 2)))
    monkeypatch.setattr(pe.time, "perf_counter", lambda: float(next(clock)))  # each timing spans exactly 1 s
    assert pe.peak_matmul_gflops(torch.float32, repeats=10) == pytest.approx(2 * 4 * 3 * 5 * 10 / 1e9)


def test_bench_eval_times_the_pipeline_job(tiny_dir, tmp_path):
    from kvlab.tools.bench_eval import main

    summary = main(["--model-dir", str(tiny_dir), "--task", "recency", "--ctx", "512", "--preset", "smoke",
                    "--config", smoke_config(tmp_path, ["full", "snapkv", "kivi2"]), "--label", "here",
                    "--out", str(tmp_path / "b.parquet")])
    rows = pd.read_parquet(tmp_path / "b.rows.parquet")
    (row,) = summary.to_dict("records")
    assert row["rows"] == len(rows) > 0 and row["s_per_row"] == pytest.approx(row["wall_s"] / len(rows))
    assert row["label"] == "here" and row["dtype"] == "float32"  # the smoke preset forces fp32
    assert row["peak_rss_mb"] > 100  # this process holds torch and the model at least


def test_counted_matmuls_are_their_flops_and_bytes_and_only_them():
    """MatmulCounter over a job: 2·M·K·N flops per product (mm, addmm, bmm), as FlopCounterMode counts them, and the
    bytes of operands and result (an expanded operand once); nothing for elementwise operators."""
    from torch.utils.flop_counter import FlopCounterMode

    from kvlab.tools.profile_eval import counted_products, roofline_rows

    a, b, bias = torch.randn(6, 5), torch.randn(5, 7), torch.randn(7)

    def job():
        torch.nn.functional.linear(a, b.T, bias)  # addmm
        torch.bmm(a[None].expand(3, -1, -1), b[None].expand(3, -1, -1))  # bmm, 3 products
        (a @ b).exp().sum()  # mm, then elementwise work that has no flops here

    counted = counted_products(job)
    calls = counted.calls
    assert not counted.attention
    flops = 2 * 6 * 5 * 7
    assert calls == {(flops, 4 * (7 + 30 + 35 + 42)): 1, (3 * flops, 4 * (30 + 35 + 3 * 42)): 1, (flops, 4 * (30 + 35 + 42)): 1}
    counter = FlopCounterMode(display=False)
    with counter:
        job()
    assert sum(f * n for (f, _), n in calls.items()) == counter.get_total_flops() == 5 * flops
    roof = {r["name"]: r for r in roofline_rows(calls, (1.0, 1.0), peak=1e-7, bandwidth=1e-7, walls=[50.0, 40.0, 42.88])}
    # at 100 flop/s and 100 B/s: the addmm and the mm wait for their bytes (4.56 and 4.28 s against 4.2 s of flops),
    # the bmm for its flops (12.6 s against 7.64 s of bytes)
    assert roof["roofline_floor_s"]["seconds"] == pytest.approx(4.56 + 12.6 + 4.28)
    assert roof["matmul_floor_s"]["seconds"] == pytest.approx(21.0) and roof["matmul_gbytes"]["value"] == pytest.approx(1648e-9)
    assert roof["wall_over_roofline"]["value"] == pytest.approx(2.0) and roof["wall_over_floor"]["value"] == pytest.approx(42.88 / 21)
    # three runs: the ratio is the median run's, the fastest and slowest beside it; no attention counted, no rows for it
    assert roof["wall_over_floor"]["low"] == pytest.approx(40 / 21) and roof["wall_over_floor"]["high"] == pytest.approx(50 / 21)
    assert "attention_gflop" not in roof


def test_counted_matmuls_count_packed_linear_layers():
    """A packed layer's product (kvlab.kernels.linear), which FlopCounterMode does not see: 2·M·K·N flops and the
    bytes of input, packed weight, bias and output."""
    from kvlab.kernels.linear import PackedLinear
    from kvlab.tools.profile_eval import counted_products

    x, w, bias = torch.randn(2, 3, 5), torch.randn(7, 5), torch.randn(7)
    packed = PackedLinear(w, bias)
    assert counted_products(lambda: packed(x)).calls == {(2 * 6 * 5 * 7, 4 * (30 + 35 + 7 + 42)): 1}


def test_attention_products_are_the_pairs_each_mask_lets_through():
    """MatmulCounter.attention: 2·(D_qk + D_v) flops per query-key pair an SDPA call must compute (no matmul operator
    shows them): every pair without a mask, the lower triangle of a causal prefill, the entries an additive or a
    boolean mask leaves, broadcast over rows and heads; the engine's folded grouped-query call counts what the plain
    call over every query head counts. The floor adds them to the matmuls' at the same peak."""
    from collections import Counter

    from kvlab.engine.attention import _grouped
    from kvlab.tools.profile_eval import counted_products, roofline_rows

    torch.manual_seed(0)
    b, hq, hkv, n, keys, d, dv = 2, 4, 2, 3, 6, 8, 8
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, keys, d), torch.randn(b, hkv, keys, dv)
    allowed = torch.rand(b, 1, n, keys) > 0.4
    allowed[..., 0] = True  # every query sees a key
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    per_pair = 2 * (d + dv)
    cases = {
        "every pair": (lambda: sdpa(q, k, v, enable_gqa=True), b * hq * n * keys),
        "causal prefill": (lambda: sdpa(q, k[:, :, :n], v[:, :, :n], is_causal=True, enable_gqa=True), b * hq * (1 + 2 + 3)),
        "additive mask": (lambda: sdpa(q, k, v, attn_mask=additive, enable_gqa=True), hq * int(allowed.sum())),
        "boolean mask": (lambda: sdpa(q, k, v, attn_mask=allowed, enable_gqa=True), hq * int(allowed.sum())),
        "folded heads": (lambda: _grouped(q.bfloat16(), k.bfloat16(), v.bfloat16(), additive.bfloat16(), 0.0, None),
                         hq * int(allowed.sum())),
    }
    for name, (job, pairs) in cases.items():
        counted = counted_products(job)
        assert sum(f * c for (f, _), c in counted.attention.items()) == per_pair * pairs, name
        assert sum(counted.attention.values()) == 1 and not counted.calls, name
    attention = Counter({(300, 0): 1})  # 3 s at 100 flop/s, the matmuls' 200 flops 2 s
    roof = {r["name"]: r for r in roofline_rows(Counter({(200, 0): 1}), (1.0, 1.0), peak=1e-7, bandwidth=1.0,
                                                walls=[10.0], attention=attention)}
    assert roof["matmul_floor_s"]["seconds"] == pytest.approx(2.0)
    assert roof["matmul_attention_floor_s"]["seconds"] == pytest.approx(5.0) and roof["attention_gflop"]["calls"] == 1
    assert roof["wall_over_matmul_attention_floor"]["value"] == pytest.approx(2.0)


def _faults_writing(mb: int) -> int:
    """Minor page faults of allocating an `mb` MB tensor and writing every byte of it."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="glibc's mallopt and page-fault counts: Linux")
def test_freed_memory_is_reused_without_page_faults():
    """A freed 256 MB block (above glibc's largest mmap threshold) comes back to the next allocation with its pages
    still mapped: without `keep_freed_memory` each allocation maps 65,536 fresh 4 KB pages and faults on every one."""
    assert hardware.keep_freed_memory()
    _faults_writing(256)  # the first allocation grows the heap: its pages fault once
    assert _faults_writing(256) < 1_000
