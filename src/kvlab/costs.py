"""The cost table (article §8) as rows: the article's models, then every evaluated model's card."""

from __future__ import annotations

import pandas as pd

from kvlab.kernels.accounting import (
    KVGeometry,
    Scheme,
    article_cost_table,
    bytes_per_token,
    compression_ratio,
    context_bytes,
    human_bytes,
)

# Storage schemes priced for each evaluated model (the article's §8 rows, plus 2-bit).
MODEL_SCHEMES = ("bf16", "fp8", "int4-g32-r128", "int2-g32-r128", "int4-g32-r128+keep0.25")


def cost_rows(cards: list[dict], context_tokens: int) -> pd.DataFrame:
    rows = [{"source": "article", **r} for r in article_cost_table()]
    for card in cards:
        geom = KVGeometry.from_card(card)
        tokens = min(context_tokens, card["max_position_embeddings"])
        for text in MODEL_SCHEMES:
            scheme = Scheme.parse(text)
            total = context_bytes(geom, scheme, tokens)
            rows.append(
                {
                    "source": "model",
                    "model": card["name"],
                    "scheme": text,
                    "bytes_per_token": bytes_per_token(geom, scheme),
                    "context_tokens": tokens,
                    "total_bytes": total,
                    "total_human": human_bytes(total),
                    "ratio_vs_bf16": compression_ratio(geom, scheme, tokens),
                    "note": _note(card),
                }
            )
    return pd.DataFrame(rows)


def _note(card: dict) -> str:
    sliding = card["layer_types"].count("sliding")
    if sliding:
        return f"{sliding} of {card['num_layers']} layers are sliding-window ({card['sliding_window']} tokens): capped there"
    return ""
