"""Damaged files are refused with one line naming the file and the fix: model weights that differ from the
digests card.json recorded, truncated safetensors and truncated Parquet files."""

import json

import pandas as pd
import pytest
import torch

from conftest import TINY_SPEC
from kvlab.util.io import DamagedFileError, read_parquet
from kvlab.models.acquire import acquire
from kvlab.models.card import read_card
from kvlab.models.integrity import ModelIntegrityError, file_sha256, verify_weights


@pytest.fixture
def model_dir(tmp_path):
    out = tmp_path / "models" / "tiny"
    acquire("tiny", TINY_SPEC, out)
    return out


def test_card_records_every_weight_file(model_dir):
    card = read_card(model_dir)
    assert card["weights"] == {"model.safetensors": file_sha256(model_dir / "model.safetensors")}
    verify_weights(model_dir)  # an intact model passes


def flip(path, offset, n=256):
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_weight_bytes_are_refused_before_anything_is_written(model_dir, tmp_path):
    from kvlab.steps.evaluate import load_model, run_job

    weights = model_dir / "model.safetensors"
    flip(weights, weights.stat().st_size // 2)  # inside the tensor data: the file still loads, with wrong values
    with pytest.raises(ModelIntegrityError) as info:
        load_model(model_dir, "float32", "cpu")
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{weights}: sha256 ") and "differs from card.json" in text
    assert "snakemake --forcerun acquire_model" in text and f"delete {model_dir}" in text
    out = tmp_path / "results" / "eval.parquet"
    with pytest.raises(ModelIntegrityError):
        run_job(model_dir, "t", {}, 128, {"threads": 1, "dtype": "float32", "device": "cpu"}, out)
    assert not out.parent.exists()


def test_truncated_safetensors_is_named(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelIntegrityError, match=r"model\.safetensors: not a valid safetensors file: .*truncated"):
        verify_weights(model_dir)


def test_missing_or_extra_weight_files_are_refused(model_dir):
    (model_dir / "model-extra.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    with pytest.raises(ModelIntegrityError, match="model-extra.safetensors: weight file not listed in card.json"):
        verify_weights(model_dir)
    (model_dir / "model-extra.safetensors").unlink()
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelIntegrityError, match="model.safetensors: weight file listed in card.json is missing"):
        verify_weights(model_dir)


def test_a_tiny_card_without_weights_uses_its_sha256(model_dir):
    """Cards written before the `weights` field: a tiny model's `sha256` is its weight file's."""
    card = read_card(model_dir)
    del card["weights"]
    (model_dir / "card.json").write_text(json.dumps(card))
    flip(model_dir / "model.safetensors", 5000)
    with pytest.raises(ModelIntegrityError, match="differs from card.json"):
        verify_weights(model_dir)


def test_truncated_parquet_is_named(tmp_path):
    from kvlab.steps.collect import _concat

    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    pd.DataFrame({"x": torch.arange(100).tolist()}).to_parquet(good)
    bad.write_bytes(good.read_bytes()[:-20])
    assert read_parquet(good)["x"].tolist() == list(range(100))
    for call in (lambda: read_parquet(bad), lambda: _concat([good, bad])):
        with pytest.raises(DamagedFileError) as info:
            call()
        text = str(info.value)
        assert "\n" not in text and text.startswith(f"{bad}: not a readable Parquet file")
        assert "delete it and rerun the rule that writes it" in text


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_truncated_json_files_are_named(model_dir, name):
    """A truncated config or tokenizer file is refused with the weights, in one line naming it and the fix (before
    transformers would fail on it with an error that names no fix)."""
    path = model_dir / name
    if not path.is_file():
        pytest.skip(f"the tiny model has no {name}")
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    with pytest.raises(ModelIntegrityError) as info:
        verify_weights(model_dir)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path}: not valid JSON") and "snakemake --forcerun acquire_model" in text


def test_missing_config_json_is_named(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelIntegrityError, match=r"config\.json: missing; re-acquire it"):
        verify_weights(model_dir)
