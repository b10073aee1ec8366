"""The model card: the facts about a model's KV cache that later rules read (``card.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CARD_NAME = "card.json"


def card_from_config(config: Any, *, name: str, source: dict, sha256: str, dtype: str, n_params: int) -> dict:
    """Build the card dict from a transformers config (text config for multimodal wrappers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * layers)
    sliding_window = getattr(text, "sliding_window", None)
    kinds = ["sliding" if t == "sliding_attention" else "full" for t in layer_types]
    rope = getattr(text, "rope_parameters", None) or {}
    return {
        "name": name,
        "architecture": text.model_type,
        "num_layers": layers,
        "num_query_heads": heads,
        "num_kv_heads": int(text.num_key_value_heads),
        "head_dim": head_dim,
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "layer_types": kinds,
        "sliding_window": int(sliding_window) if sliding_window and "sliding" in kinds else None,
        "rope": _jsonable(rope),
        "max_position_embeddings": int(text.max_position_embeddings),
        "dtype": dtype,
        "n_params": int(n_params),
        "source": source,
        "sha256": sha256,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def read_card(model_dir: str | Path) -> dict:
    """Read ``card.json`` from an acquired model folder."""
    path = Path(model_dir) / CARD_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: acquire the model first (rule acquire_model)")
    return json.loads(path.read_text())


def write_card(model_dir: str | Path, card: dict) -> None:
    (Path(model_dir) / CARD_NAME).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
