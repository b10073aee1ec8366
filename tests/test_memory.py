"""The memory budget: a job's variants split into waves give the rows one wave gives, on every cache kind and every
question mode, on the sharpened tiny model in fp32: every non-timing column equal (answers, scores, first divergences,
bytes), but the KL columns, which a teacher-forced batch of other rows rounds differently (fp32 reductions over other
padded widths: up to 1.5e-7 relative measured here), equal within ROUNDING."""

import math

import pytest

from kvlab.tools.compare_runs import VARYING
from kvlab.engine import Reading, Scope, evaluate_samples
from kvlab.methods import build, variants
from kvlab.tasks import KINDS

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
    samples = KINDS["multi_turn"].generate("multi_turn", spec, tokenizer, 400)
    grid = variants(build(METHODS), [0.25, 0.5])
    modes = ["agnostic", "aware", "multi_turn"]
    one = evaluate_samples(sharp, tokenizer, samples, grid, modes, 8, Reading(noise_samples=1))
    split = evaluate_samples(sharp, tokenizer, samples, grid, modes, 8, Reading(noise_samples=1), Scope(waves=in_waves(size)))
    assert len(one) == len(split) > len(grid)
    assert {r["waves"] for r in one} == {1} and {r["waves"] for r in split} == {-(-(len(grid) - 1) // size)}
    for a, b in zip(one, split):
        differ = [c for c in a if not VARYING.search(c) and c != "waves" and not same(c, a[c], b[c])]
        assert not differ, (a["method"], a["budget"], a["question_mode"], {c: (a[c], b[c]) for c in differ})
    assert any(r["diverged_at"] is not None for r in split)  # some rows left the full answer: their decoding was joined


# --- the memory model (kvlab.state.memory) ---

from kvlab.state.memory import ARTICLE_MODELS, GB, MemoryBudgetError, Row, Shape, estimate, main  # noqa: E402

LONG = [Row(1.0, None), Row(1.0, 8), Row(1.0, 4), Row(1.0, 2), Row(0.25, None), Row(0.25, None), Row(0.25, None)]


def test_shapes_count_the_published_parameters_and_kv_bytes():
    """Llama-3.1-8B has 8.03B parameters, Qwen2.5-7B 7.62B (their model cards); Llama's bf16 KV at 128K is 16 GiB
    (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes = 128 KiB a token)."""
    llama, qwen = (Shape.from_config(ARTICLE_MODELS[m]) for m in ("llama3.1-8b", "qwen2.5-7b"))
    assert round(llama.params / 1e9, 2) == 8.03
    assert round(qwen.params / 1e9, 2) == 7.62
    assert llama.kv(131072, 2) == 16 * 2**30
    gemma = Shape.from_config({"num_hidden_layers": 4, "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "sliding_window": 16,
                               "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    assert gemma.kv(1000, 2) == 2 * (1000 + 3 * 16) * 1 * 4 * 2  # sliding layers hold their window


def test_waves_fit_the_budget_and_hold_the_reference():
    shape = Shape.from_config(ARTICLE_MODELS["llama3.1-8b"])
    one = estimate(shape, "bfloat16", 32768, LONG, 0)
    assert one.waves == [list(range(len(LONG)))]
    least = one.least
    last = None
    for share in (0.9, 0.6, 0.3, 0.0):
        budget = least + share * (one.peak - least)
        est = estimate(shape, "bfloat16", 32768, LONG, 0, budget=budget)
        assert est.peak <= budget and all(0 in w for w in est.waves)
        assert sorted({i for w in est.waves for i in w}) == list(range(len(LONG)))
        assert last is None or len(est.waves) >= last
        last = len(est.waves)
    assert last > 1
    with pytest.raises(MemoryBudgetError, match=r"a 32768-token sample needs at least [\d.]+ GB beside the model .* budget leaves 1\.0 GB"):
        estimate(shape, "bfloat16", 32768, LONG, 0, budget=1 * GB)


def test_a_job_whose_budget_fits_no_variant_stops_before_any_work(tiny_dir, tmp_path):
    from kvlab.steps.evaluate import run_job
    from kvlab.methods import build

    run = {"methods": build({"full": {"kind": "full"}, "kivi2": METHODS["kivi2"]}), "budgets": [0.5],
           "question_modes": ["agnostic"], "max_new_tokens": 4, "noise_floor_samples": 0, "dtype": "float32",
           "device": "cpu", "threads": 1, "memory": {"budget_gb": 0.01}}
    out = tmp_path / "job.parquet"
    with pytest.raises(MemoryBudgetError, match=r"memory budget 0\.0 GB \(\d+\.\d GB of it the loaded model\)"):
        run_job(tiny_dir, "niah_single", {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 0}, 512, run, out)
    assert list(tmp_path.iterdir()) == []  # nothing written, no checkpoint


def test_the_cli_sizes_the_article_models(capsys):
    assert main(["--model", "llama3.1-8b", "--context", "32768", "--preset", "long", "--device-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "loaded model 16.06 GB of 80.0 GB" in out and "niah_single: 7 variants" in out and "fits in " in out
    assert main(["--model", "llama3.1-8b", "--context", "131072", "--preset", "long", "--device-gb", "24"]) == 1
    assert "does not fit: needs at least" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "llama3.1-8b", "--context", "32768"])  # a GPU's size must be given
    assert "--device-gb: the GPU's memory in GB" in capsys.readouterr().err


def test_free_memory_is_the_jobs_cgroup_limit_where_one_is_set(tmp_path):
    from kvlab.state.memory import available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_bytes("cpu", tmp_path / "none", meminfo) == 20000000 * 1024  # no cgroup: the machine's
    (tmp_path / "memory.max").write_text(f"{8 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{3 * 2**30}\n")
    assert available_bytes("cpu", tmp_path, meminfo) == 5 * 2**30  # a SLURM job's --mem, less what it holds
    (tmp_path / "memory.max").write_text("max\n")
    assert available_bytes("cpu", tmp_path, meminfo) == 20000000 * 1024
