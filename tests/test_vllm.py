"""vLLM's own KV caches (kvlab.engine.vllm_runner), run in the engine's environment (.venv-vllm, `make vllm-env`, or
KVLAB_VLLM_PYTHON) on the shipped Qwen2.5-0.5B folder; the runner's KL over the tokens vLLM returns, in the main venv."""

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from kvlab.methods.serving import vllm_token_bytes
from kvlab.util.hardware import avx512_or_amx

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "src/kvlab/engine/vllm_runner.py"
ENGINE_PY = Path(os.environ.get("KVLAB_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
MODEL = ROOT / "resources/models/qwen2.5-0.5b"
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 18, 30, 151645, 198, 151644, 77091, 198]  # chat: "What is 2+3?"
IM_END = 151645

spec = importlib.util.spec_from_file_location("vllm_runner", RUNNER)  # runs in vLLM's env; its KL needs no vllm
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)


def logp(probs: dict) -> dict:
    return {str(t): math.log(p) for t, p in probs.items()}


def test_kl_over_every_token_is_the_exact_kl():
    p, q = {1: 0.5, 2: 0.3, 3: 0.2}, {1: 0.2, 2: 0.5, 3: 0.3}
    exact = sum(a * math.log(a / q[t]) for t, a in p.items())
    assert runner.kl_binned(logp(p), logp(q)) == pytest.approx(exact, rel=1e-12)
    assert runner.kl_binned(logp(p), logp(p)) == 0.0


def test_kl_over_the_tokens_both_keep_is_a_lower_bound():
    """The tokens outside both scorings' top lists go to one bin: grouping outcomes never raises a KL."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        p, q = (torch.softmax(3 * torch.randn(200, generator=g, dtype=torch.float64), 0) for _ in range(2))
        exact = float((p * (p / q).log()).sum())
        top = lambda d, k: {str(int(t)): math.log(float(d[t])) for t in d.argsort(descending=True)[:k]}  # noqa: E731
        bound = runner.kl_binned(top(p, 16), top(q, 16))
        assert 0.0 <= bound <= exact + 1e-12


def test_first_difference():
    assert runner.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert runner.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert runner.first_difference([1, 2], [1, 2, 3]) == 2  # one ending first


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    if not (ENGINE_PY.exists() and MODEL.is_dir()):
        pytest.skip("needs vLLM's environment (make vllm-env, or KVLAB_VLLM_PYTHON) and resources/models/qwen2.5-0.5b")
    d = tmp_path_factory.mktemp("vllm")
    caches = {"full": "auto", "full_again": "auto", **({"fp8": "fp8_e4m3"} if avx512_or_amx() else {})}
    req = {"model": str(MODEL), "dtype": "float32", "device": "cpu", "threads": 2, "n_ctx": 256, "eos": [IM_END],
           "reference": "full", "caches": caches,
           "prompts": [{"id": "a", "prompt": PROMPT, "max_new_tokens": 8, "path": None, "continues": False},
                       {"id": "prose", "prompt": PROMPT[:10], "max_new_tokens": 0, "path": PROMPT[10:], "continues": False}]}
    (d / "req.json").write_text(json.dumps(req))
    done = subprocess.run([str(ENGINE_PY), str(RUNNER), str(d / "req.json"), str(d / "ans.json")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((d / "ans.json").read_text())


@pytest.mark.integration
def test_full_cache_agrees_with_itself(answers):
    assert answers["engine"].startswith("vLLM ")
    a, b = answers["caches"]["full"]["answers"]["a"], answers["caches"]["full_again"]["answers"]["a"]
    assert a["ids"] == b["ids"] and 0 < len(a["ids"]) <= 8
    assert b["diverged_at"] is None and b["kl_vs_full"] == 0.0 and b["kl_max"] == 0.0
    assert a["tf_tokens"] == len(a["ids"])  # KL read along the reference's own answer
    prose = answers["caches"]["full_again"]["answers"]["prose"]
    assert prose["kl_vs_full"] == 0.0 and prose["ids"] == [] and prose["tf_tokens"] == len(PROMPT) - 10


@pytest.mark.integration
def test_bytes_are_vllms_cache_spec(answers):
    """Qwen2.5-0.5B: 24 layers, 2 KV heads of 64; the auto cache holds the model's float32."""
    for cache in answers["caches"].values():
        assert (cache["layers"], cache["kv_heads"], cache["head_dim"]) == (24, 2, 64)
        bytes_ = vllm_token_bytes(cache["kv_cache_dtype"], "float32", 24, 2, 64)
        assert cache["token_bytes_engine"] == bytes_
        assert cache["kv_mib_engine"] == pytest.approx(cache["kv_cells"] * bytes_ / 2**20, abs=0.005)
    assert answers["caches"]["full"]["token_bytes_engine"] == 24 * 2 * 2 * 64 * 4


@pytest.mark.integration
@pytest.mark.skipif(not avx512_or_amx(), reason="vLLM's CPU backend runs an FP8 cache only with AVX-512 or AMX")
def test_fp8_cache_changes_the_logits_measurably(answers):
    fp8 = answers["caches"]["fp8"]
    assert fp8["token_bytes_engine"] == 24 * 2 * 2 * 64
    for prompt in ("a", "prose"):
        assert 0 < fp8["answers"][prompt]["kl_vs_full"] < 1
