"""llama.cpp's own KV caches (kvlab.engine.llamacpp), run in the engine's environment (.venv-llamacpp, `make
llamacpp-env`) on the shipped Qwen2.5-Coder-0.5B GGUF (resources/gguf/, written from the model's PyPI chunks)."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PY = ROOT / ".venv-llamacpp/bin/python"
GGUF = ROOT / "resources/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 18, 30, 151645, 198, 151644, 77091, 198]  # chat: "What is 2+3?"

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (ENGINE_PY.exists() and GGUF.exists()),
                                 reason="needs make llamacpp-env and resources/gguf/ (the shipped GGUF)")]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    req = {"gguf": str(GGUF), "threads": 2, "n_ctx": 4096,
           "caches": {"f16": ["f16", "f16"], "f16_again": ["f16", "f16"], "q8_0": ["q8_0", "q8_0"], "q4_0": ["q4_0", "q4_0"]},
           "samples": [{"sample_id": "a", "prompt": PROMPT, "max_new_tokens": 8}]}
    (d / "req.json").write_text(json.dumps(req))
    subprocess.run([str(ENGINE_PY), str(ROOT / "src/kvlab/engine/llamacpp.py"), str(d / "req.json"), str(d / "ans.json")],
                   check=True, capture_output=True)
    return json.loads((d / "ans.json").read_text())["caches"]


def kl(p, q):
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return float((np.exp(p) * (p - q)).sum())


def test_full_cache_agrees_with_itself(answers):
    a, b = answers["f16"]["answers"]["a"], answers["f16_again"]["answers"]["a"]
    assert a["ids"] == b["ids"] and len(a["ids"]) > 0
    assert kl(a["logprobs"], b["logprobs"]) == 0.0


def test_quantized_caches_change_the_logits_measurably(answers):
    full = answers["f16"]["answers"]["a"]["logprobs"]
    k8, k4 = kl(full, answers["q8_0"]["answers"]["a"]["logprobs"]), kl(full, answers["q4_0"]["answers"]["a"]["logprobs"])
    assert k8 > 0 and k4 > k8  # q4_0 keeps fewer bits than q8_0


def test_bytes_equal_the_engines_own_figure(answers):
    for name, per_token_layer in (("f16", 2 * 2 * 64 * 2), ("q8_0", 2 * 2 * 2 * 34), ("q4_0", 2 * 2 * 2 * 18)):
        c = answers[name]
        assert c["kv_bytes_formula"] == c["kv_bytes_engine"] == c["kv_cells"] * c["layers"] * per_token_layer
