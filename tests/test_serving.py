"""A serving engine's KV caches as method kinds (kvlab.methods.serving, kvlab.steps.serve): config checks, the
prompts the engine reads, the rows it gives, the report's verdicts; and, with llama.cpp's environment, a real job."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kvlab.methods import build, engines, variants
from kvlab.methods.serving import LlamaCpp, Vllm, row_bytes, token_bytes, vllm_token_bytes
from kvlab.report.decision import Rule
from kvlab.report.sections import serving as section
from kvlab.state.config import ConfigError, resolve
from kvlab.steps.serve import engine_python, turns

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "config.schema.yaml"
LLAMA = {"kind": "llamacpp", "cache_type_k": "q4_0", "cache_type_v": "q8_0"}
VLLM = {"kind": "vllm", "kv_cache_dtype": "fp8_e4m3"}


@pytest.fixture
def config():
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_the_serving_preset_pairs_each_cache_type_with_kvlab_twins(config):
    out = resolve({**config, "preset": "serving"}, SCHEMA)
    llama = {n: m for n, m in out["methods"].items() if m["kind"] == "llamacpp"}
    assert {(m["cache_type_k"], m["cache_type_v"]) for m in llama.values()} == {("q8_0", "q8_0"), ("q4_0", "q8_0"), ("q4_0", "q4_0")}
    assert all(out["methods"][m["kvlab_twin"]]["kind"] == "quant" for m in llama.values() if "kvlab_twin" in m)
    assert set(out["tasks"]) == {"qa_mix", "chat_mix"}
    assert engines(build(out["methods"])) == ["llamacpp"]


@pytest.mark.parametrize("entry,key,says", [
    ({**LLAMA, "cache_type_k": "q3_0"}, "cache_type_k", "q3_0"),
    ({**LLAMA, "kvlab_twin": "nosuch"}, "kvlab_twin", "'nosuch' is not a method kvlab's engine runs"),
    ({**LLAMA, "kvlab_twin": "other"}, "kvlab_twin", "'other' is not a method kvlab's engine runs"),
])
def test_a_bad_engine_method_stops_with_one_line(config, entry, key, says):
    config["methods"]["mine"] = entry
    config["methods"]["other"] = dict(LLAMA)
    with pytest.raises(ConfigError) as error:
        resolve(config, SCHEMA)
    assert "\n" not in str(error.value) and "mine" in str(error.value) and key in str(error.value) and says in str(error.value)


def test_llamacpp_needs_a_gguf_model(config):
    config["methods"]["mine"] = dict(LLAMA)
    config["models"] = {"hubbed": {"source": "hub", "repo_id": "Qwen/Qwen2.5-0.5B-Instruct"}}
    with pytest.raises(ConfigError, match=r"model 'hubbed' has source hub; evaluate a pypi-gguf model or leave the method out"):
        resolve(config, SCHEMA)


@pytest.mark.parametrize("fast,stops", [(False, True), (True, False)])
def test_vllm_fp8_on_a_cpu_without_avx512_stops_before_any_job(config, monkeypatch, fast, stops):
    """vLLM's own check (its CPU attention refuses an FP8 cache without AVX-512 or AMX), made at config time."""
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: fast)
    config["methods"]["fp8_vllm"] = dict(VLLM)
    if not stops:
        assert resolve(config, SCHEMA)["methods"]["fp8_vllm"]["kv_cache_dtype"] == "fp8_e4m3"
        return
    with pytest.raises(ConfigError) as error:
        resolve(config, SCHEMA)
    said = str(error.value)
    assert "\n" not in said and "methods.fp8_vllm" in said and "without AVX-512 or AMX" in said and "device: cuda" in said
    config["device"] = "cuda"  # on a GPU vLLM's CUDA backends take FP8 (the GPU itself is checked before the first job)
    assert resolve(config, SCHEMA)["methods"]["fp8_vllm"]["kind"] == "vllm"


def test_the_serving_vllm_preset_stops_on_an_avx2_cpu_and_only_when_it_is_run(config, monkeypatch):
    """Its FP8 caches are refused where this machine cannot run them, before any job; the other presets, which are
    checked too, still run here."""
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: False)
    with pytest.raises(ConfigError) as error:
        resolve({**config, "preset": "serving_vllm"}, SCHEMA)
    assert str(error.value).startswith("preset 'serving_vllm': key 'methods.vllm_fp8_e4m3': vLLM's CPU backend refuses")
    assert resolve({**config, "preset": "serving"}, SCHEMA)["preset"] == "serving"
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: True)
    out = resolve({**config, "preset": "serving_vllm"}, SCHEMA)
    assert {m["kv_cache_dtype"] for m in out["methods"].values() if m["kind"] == "vllm"} == {"fp8_e4m3", "fp8_e5m2"}
    assert out["methods"]["vllm_fp8_e4m3"]["kvlab_twin"] == "fp8" and set(out["tasks"]) == {"qa_mix", "chat_mix"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_vllm_16_bit_caches_stop_on_the_cpu_and_run_on_a_gpu(config, monkeypatch, dtype):
    """vLLM's CPU attention supports auto and FP8 caches only; it takes a 16-bit one without a word and reads it as the
    model's float32 (answers garbage), so kvlab refuses it there, AVX-512 or not."""
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: True)
    config["methods"]["half_vllm"] = {"kind": "vllm", "kv_cache_dtype": dtype}
    with pytest.raises(ConfigError) as error:
        resolve(config, SCHEMA)
    said = str(error.value)
    assert "\n" not in said and "methods.half_vllm" in said and f"no {dtype} KV cache" in said and "device: cuda" in said
    config["methods"]["half_vllm"] = {"kind": "vllm", "kv_cache_dtype": "auto"}
    assert resolve(config, SCHEMA)["methods"]["half_vllm"]["kv_cache_dtype"] == "auto"
    config["device"] = "cuda"
    config["methods"]["half_vllm"] = {"kind": "vllm", "kv_cache_dtype": dtype}
    assert resolve(config, SCHEMA)["methods"]["half_vllm"]["kv_cache_dtype"] == dtype


def test_vllm_needs_no_gguf_and_takes_only_its_dtypes(config, monkeypatch):
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: True)
    config["methods"]["v"] = dict(VLLM)
    config["models"] = {"hubbed": {"source": "hub", "repo_id": "Qwen/Qwen2.5-0.5B-Instruct"}}
    del config["presets"]["serving"], config["presets"]["serving_vllm"]  # their llama.cpp methods need a GGUF model
    assert engines(build(resolve(config, SCHEMA)["methods"])) == ["vllm"]
    config["methods"]["v"] = {"kind": "vllm", "kv_cache_dtype": "int3"}
    with pytest.raises(ConfigError, match="methods.v.*int3"):
        resolve(config, SCHEMA)


def test_vllm_bytes_are_its_cache_specs():
    """vLLM's page of a full-attention layer: block_size × kv_heads × head_size × 2 (K and V) × the dtype's bytes."""
    assert vllm_token_bytes("fp8_e4m3", "bfloat16", 24, 2, 64) == 24 * 2 * 2 * 64
    assert vllm_token_bytes("auto", "float32", 24, 2, 64) == 4 * vllm_token_bytes("fp8", "float32", 24, 2, 64)
    assert vllm_token_bytes("bfloat16", "float32", 24, 2, 64) == 24 * 2 * 2 * 64 * 2
    info = {"kv_cache_dtype": "fp8_e5m2", "dtype": "bfloat16", "layers": 24, "kv_heads": 2, "head_dim": 64}
    Vllm.check_bytes("v", {**info, "token_bytes_engine": 6144})
    with pytest.raises(RuntimeError, match="vLLM's cache spec gives 6145 bytes per token for cache v, kvlab's formula 6144"):
        Vllm.check_bytes("v", {**info, "token_bytes_engine": 6145})
    fp8 = Vllm({"kv_cache_dtype": "fp8_e4m3"}).storage
    assert fp8["scheme"] == "vLLM fp8_e4m3" and fp8["bits"] == 8 and Vllm({"kv_cache_dtype": "auto"}).storage["bits"] is None


def test_kvlab_jobs_and_engine_jobs_split_the_methods(config):
    config["methods"]["q4"] = dict(LLAMA)
    methods = build(resolve(config, SCHEMA)["methods"])
    ours = variants(methods, [0.5], "niah_single")
    theirs = variants(methods, [0.5], "niah_single", engine="llamacpp")
    assert "q4" not in {v.method for v in ours} and {v.kind for v in theirs} == {"full", "llamacpp"}
    assert [v.method for v in theirs if v.kind == "full"] == [v.method for v in ours if v.kind == "full"]
    assert [v.budget for v in theirs] == [1.0, 1.0]  # a cache type evicts nothing: one budget


def test_block_bytes_are_llamacpps():
    assert row_bytes("q4_0", 64) == 36 and row_bytes("q8_0", 64) == 68 and row_bytes("f16", 64) == 128
    assert token_bytes(("q4_0", "q8_0"), 24, 2, 64) == 24 * 2 * (36 + 68)
    with pytest.raises(ValueError, match="packs 32 values per block; a head of 80 does not divide: use f16"):
        row_bytes("q4_0", 80)
    k4 = LlamaCpp({"cache_type_k": "q4_0", "cache_type_v": "q4_0"}).storage
    assert k4["scheme"] == "llama.cpp q4_0/q4_0" and k4["bits"] == 4.5  # 18 bytes per 32 values


def test_the_engine_reads_the_prompts_kvlab_reads(tiny):
    """Each turn's token ids are those kvlab's engine feeds (context, question, suffix, then each later turn after the
    earlier ones); prose is read along its reference text and answers nothing."""
    from kvlab.tasks import generate

    _, tokenizer = tiny
    spec = {"kind": "multi_turn", "context_tokens": [512], "depths": [0.3], "samples": 1, "seed": 0}
    (s,) = generate("multi_turn", resolve_task(spec), tokenizer, 512)
    one, two = turns(s, 8)
    p = s.prompt
    assert one.ids == p.context + p.question + p.suffix and one.path is None and one.cap == 8
    assert two.ids == one.ids + p.followups[0].ids and two.gold == p.followups[0].gold and two.number == 2
    prose = {"kind": "continuation", "context_tokens": [256], "continuation_tokens": 16, "samples": 1, "seed": 0}
    (c,) = generate("prose_kl", resolve_task(prose), tokenizer, 256)
    (read,) = turns(c, 8)
    assert read.path == c.prompt.reference and len(read.path) == 16 and read.cap == 0


def resolve_task(spec: dict) -> dict:
    """`spec` as a config's task of its own, its defaults filled."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["tasks"]["t"] = spec
    return resolve(config, SCHEMA)["tasks"]["t"]


def rows(model: str, method: str, scores: list[float], kind: str = "llamacpp", **extra) -> list[dict]:
    return [{"model": model, "shape": "retrieval", "task": "t", "task_kind": "dataset", "context_tokens": 0,
             "question_mode": "agnostic", "method": method, "method_kind": kind, "budget": 1.0, "sample_id": f"s{i}",
             "turn": 1, "score": s, "full_score": 1.0, "draw": i, "round": 1, "kv_fraction_bf16": 0.3, "kl_vs_full": None,
             "scheme": None, "press": None, "wrapper": None, "bits": None, "key_axis": None, "value_axis": None,
             "policy": None, "press_kwargs": None, "depth": None, "prompt_sha1": f"h{i}", "max_samples": len(scores),
             "round_s": 1.0, "stopped_by": "max_samples", **extra} for i, s in enumerate(scores)]


def test_a_verdict_transfers_only_when_both_are_decided_alike():
    n = 80
    answers = pd.DataFrame(rows("m@llamacpp", "q8", [1.0] * n) + rows("m@llamacpp", "q4", [0.0] * n)
                           + rows("m", "int8", [1.0] * n, kind="quant") + rows("m", "kivi4", [1.0] * n, kind="quant"))
    serving = pd.DataFrame([{"engine_model": "m@llamacpp", "engine": "llama.cpp 0.3.36", "model": "m", "shape": "retrieval",
                             "method": method, "scheme": method, "kvlab_twin": twin, "sample_id": f"s{i}", "turn": 1,
                             "draw": i, "same_answer": same} for method, twin, same in (("q8", "int8", 1.0), ("q4", "kivi4", 0.0))
                            for i in range(n)])
    v = section.verdicts({"serving": serving, "answers": answers}, Rule()).set_index("method")
    assert v.loc["q8", ["decision", "twin_decision", "verdict"]].tolist() == ["safe", "safe", "transfers"]
    assert v.loc["q4", ["decision", "twin_decision", "verdict"]].tolist() == ["unsafe", "safe", "does not transfer"]
    assert section.transfers("inconclusive", "safe") == "inconclusive" and section.transfers("safe", None) == "no kvlab twin"
    f = section.fidelity({"serving": serving}, Rule()).set_index("method")
    assert f.loc["q8", "agree_points"] == 100 and f.loc["q8", "agree_low"] > 95 and f.loc["q8", "differ"] == "within tolerance"
    assert f.loc["q8", "agree_high"] == 100 and f.loc["q4", "agree_low"] == 0  # a share's bounds stay within 0-100
    assert f.loc["q4", "agree_points"] == 0 and f.loc["q4", "agree_high"] <= 100 - Rule().tolerance_points
    assert f.loc["q4", "differ"] == "beyond tolerance" and f.loc["q4", "samples"] == n


def has_env(engine: str) -> bool:
    """Whether the engine's environment is built (`make <engine>-env`, or KVLAB_<ENGINE>_PYTHON set)."""
    try:
        return bool(engine_python(engine))
    except FileNotFoundError:
        return False


@pytest.mark.integration
@pytest.mark.skipif(not has_env("llamacpp"), reason="needs llama.cpp's environment (make llamacpp-env)")
def test_a_serving_job_answers_kvlabs_prompts_with_llamacpps_caches(qwen_dir, tmp_path):
    """The real engine on the real model: rows for llama.cpp's f16 (the full) and q8_0 caches on the samples kvlab's job
    draws; the f16 rows agree with themselves, the bytes are the block layout's, the answers are scored."""
    from kvlab.methods import build
    from kvlab.models.acquire import write_gguf
    from kvlab.steps.serve import run_serving_job

    from conftest import QWEN_SPEC

    write_gguf("qwen", QWEN_SPEC, tmp_path / "q.gguf")
    spec = resolve_task({"kind": "niah", "context_tokens": [256], "depths": [0.5], "samples": 2, "seed": 0})
    methods = build({"full": {"kind": "full"}, "q8": {"kind": "llamacpp", "cache_type_k": "q8_0", "cache_type_v": "q8_0"}})
    run = {"methods": methods, "budgets": [1.0], "question_modes": ["agnostic"], "max_new_tokens": 12, "threads": 2,
           "device": "cpu", "dtype": "float32"}
    out = run_serving_job("llamacpp", qwen_dir, tmp_path / "q.gguf", "niah", spec, 256, run, tmp_path / "rows.parquet")
    assert set(out["model"]) == {"qwen2.5-0.5b@llamacpp"} and len(out) == 4
    full, q8 = out[out["method"] == "full"], out[out["method"] == "q8"]
    assert (full["kl_vs_full"] == 0).all() and full["diverged_at"].isna().all() and (full["compression_vs_bf16"] == 1).all()
    assert (q8["kl_vs_full"] > 0).all() and np.allclose(q8["kv_bytes"], q8["kv_tokens_mean"] * 24 * 2 * 2 * 68)
    assert list(q8["sample_id"]) == list(full["sample_id"]) and q8["score"].between(0, 1).all()
    assert full["score"].mean() == 1.0  # the 7-digit needle at 256 tokens: llama.cpp's f16 finds it
