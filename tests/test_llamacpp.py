"""llama.cpp's own KV caches (kvlab.engine.llamacpp), run in the engine's environment (.venv-llamacpp, `make
llamacpp-env`) on the shipped Qwen2.5-Coder-0.5B GGUF (resources/gguf/qwen2.5-0.5b.gguf, rule gguf)."""

import json
import subprocess
from pathlib import Path

import pytest

from kvlab.methods.serving import token_bytes

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PY = ROOT / ".venv-llamacpp/bin/python"
GGUF = ROOT / "resources/gguf/qwen2.5-0.5b.gguf"
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 18, 30, 151645, 198, 151644, 77091, 198]  # chat: "What is 2+3?"
IM_END = 151645

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (ENGINE_PY.exists() and GGUF.exists()),
                                 reason="needs make llamacpp-env and resources/gguf/qwen2.5-0.5b.gguf (snakemake resources/gguf/qwen2.5-0.5b.gguf)")]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    req = {"gguf": str(GGUF), "threads": 2, "n_ctx": 4096, "eos": [IM_END], "reference": "f16",
           "caches": {"f16": ["f16", "f16"], "f16_again": ["f16", "f16"], "q8_0": ["q8_0", "q8_0"], "q4_0": ["q4_0", "q4_0"]},
           "prompts": [{"id": "a", "prompt": PROMPT, "max_new_tokens": 8, "path": None},
                       {"id": "prose", "prompt": PROMPT[:10], "max_new_tokens": 0, "path": PROMPT[10:]}]}
    (d / "req.json").write_text(json.dumps(req))
    subprocess.run([str(ENGINE_PY), str(ROOT / "src/kvlab/engine/llamacpp.py"), str(d / "req.json"), str(d / "ans.json")],
                   check=True, capture_output=True)
    return json.loads((d / "ans.json").read_text())["caches"]


def test_full_cache_agrees_with_itself(answers):
    a, b = answers["f16"]["answers"]["a"], answers["f16_again"]["answers"]["a"]
    assert a["ids"] == b["ids"] and 0 < len(a["ids"]) <= 8
    assert b["diverged_at"] is None and b["kl_vs_full"] == 0.0 and b["kl_max"] == 0.0
    assert a["tf_tokens"] == len(a["ids"])  # KL read along the reference's own answer
    assert answers["f16_again"]["answers"]["prose"]["kl_vs_full"] == 0.0


def test_quantized_caches_change_the_logits_measurably(answers):
    for prompt in ("a", "prose"):
        k8, k4 = (answers[c]["answers"][prompt]["kl_vs_full"] for c in ("q8_0", "q4_0"))
        assert 0 < k8 < k4  # q4_0 keeps fewer bits than q8_0
    prose = answers["q8_0"]["answers"]["prose"]
    assert prose["ids"] == [] and prose["tf_tokens"] == len(PROMPT) - 10  # read along its own path, nothing decoded


def test_an_answer_that_leaves_the_reference_continues_on_its_own(answers):
    ref = answers["f16"]["answers"]["a"]["ids"]
    for cache in ("q8_0", "q4_0"):
        a = answers[cache]["answers"]["a"]
        if a["diverged_at"] is None:
            assert a["ids"] == ref
        else:
            d = a["diverged_at"]
            assert a["ids"][:d] == ref[:d] and a["ids"][d] != ref[d] and len(a["ids"]) <= 8


def test_bytes_equal_the_engines_own_figure(answers):
    for name in ("f16", "q8_0", "q4_0"):
        c = answers[name]
        per_token = token_bytes((c["type_k"], c["type_v"]), c["layers"], c["kv_heads"], c["head_dim"])
        assert (c["layers"], c["kv_heads"], c["head_dim"]) == (24, 2, 64)
        assert c["kv_cells"] == 4096 and round(c["kv_cells"] * per_token / 2**20, 2) == c["kv_mib_engine"]
    assert token_bytes(("q4_0", "q4_0"), 24, 2, 64) * 4096 == 14_155_776  # 18 bytes per 32 values
    assert token_bytes(("q8_0", "q8_0"), 24, 2, 64) * 4096 == 26_738_688  # 34 bytes per 32 values
