"""Model introspection: decoder and attention layers, sliding-window layers, pre-RoPE projections, stop ids. Below
the engine and the method kinds, which both use it."""

from __future__ import annotations

import torch

from kvlab.kernels import codecs


def language_model(model) -> torch.nn.Module:
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def decoder_layers(model) -> torch.nn.ModuleList:
    return language_model(model).layers


def attention_layers(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in decoder_layers(model)]


def is_sliding(model, layer_idx: int) -> bool:
    """Sliding-window layers keep their own window; compression leaves them alone (and the report says so)."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    return bool(types) and types[layer_idx] == "sliding_attention"

def project(module, hidden: torch.Tensor, which: str) -> torch.Tensor:
    """Pre-RoPE queries or keys (B, H, T, d) of one attention layer from its input hidden states."""
    proj = getattr(module, f"{which}_proj")
    x = proj(hidden).view(hidden.shape[0], hidden.shape[1], -1, module.head_dim).transpose(1, 2)
    norm = getattr(module, f"{which}_norm", None)  # Gemma 3 normalizes q and k before RoPE
    return norm(x) if norm is not None else x


def queries(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention's post-RoPE queries (B, Hq, T, d), recomputed from its input (for attention scores)."""
    return codecs.rotate(project(module, hidden, "q"), cos[:, None], sin[:, None])

def stop_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])
