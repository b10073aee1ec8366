"""The cost table (article §8) as rows: the article's models, then every evaluated model's card; and the KV bytes
a decode step reads (NSA and MoBA against full attention, §6) and where they exceed the weights' (§8.3)."""

from __future__ import annotations

import pandas as pd

from kvlab.kernels.accounting import (
    ARTICLE_CONTEXT_TOKENS,
    LLAMA_31_70B,
    KVGeometry,
    Scheme,
    article_cost_table,
    bytes_per_token,
    compression_ratio,
    context_bytes,
    human_bytes,
)
from kvlab.kernels.reads import LLAMA_3_70B_PARAMS, NSA, MoBA, crossover_tokens, decode_read_bytes, weight_bytes

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


def _models(cards: list[dict]) -> list[tuple[KVGeometry, int, int, int]]:
    """(geometry, parameters, maximum context, input-embedding parameters) of the article's Llama-3-70B (vocabulary
    128256 × hidden 8192) and of every evaluated model's card (its parameters counted from the loaded tensors by
    rule acquire_model)."""
    return [(LLAMA_31_70B, LLAMA_3_70B_PARAMS, ARTICLE_CONTEXT_TOKENS, 128_256 * 8_192)] + [
        (KVGeometry.from_card(c), int(c["n_params"]), int(c["max_position_embeddings"]),
         int(c["vocab_size"]) * int(c["hidden_size"])) for c in cards]


def read_rows(cards: list[dict], sparse: dict) -> pd.DataFrame:
    """KV bytes read per decode step, full attention vs NSA and MoBA (config `report.sparse_reads`), for each
    model at each configured context up to its maximum."""
    nsa, moba = NSA(**sparse["nsa"]), MoBA(**sparse["moba"])
    rows = []
    for geom, _, max_context, _ in _models(cards):
        for tokens in (t for t in sparse["context_tokens"] if t <= max_context):
            full = decode_read_bytes(geom, tokens)
            kv, scored = moba.read_tokens(tokens)
            for name, method, what in (
                ("full", None, f"all {tokens:,} tokens"),
                ("nsa", nsa, " + ".join(f"{k} {v:,}" for k, v in nsa.branch_tokens(tokens).items())),
                ("moba", moba, f"{kv:,} tokens of {min(moba.top_k, -(-tokens // moba.block))} blocks + "
                               f"{scored:,} block mean keys"),
            ):
                read = decode_read_bytes(geom, tokens, method)
                rows.append({"model": geom.name, "context_tokens": tokens, "method": name, "kv_bytes_read": read,
                             "read_human": human_bytes(read), "fewer_bytes_than_full": full / read,
                             "read_per_layer_and_kv_head": what, "note": _sliding_note(geom)})
    return pd.DataFrame(rows)


def crossover_rows(cards: list[dict], crossover: dict) -> pd.DataFrame:
    """Per model, weight format and KV scheme (config `report.crossover`): the shortest context whose KV reads per
    decode step of one sequence exceed the weight bytes."""
    rows = []
    for geom, params, max_context, embedding in _models(cards):
        counted = f"the input embedding ({embedding / params:.1%} of the parameters) counted whole; a step reads one row"
        for bits in crossover["weight_bits"]:
            weights = weight_bytes(params, bits)
            for text in crossover["kv_schemes"]:
                scheme = Scheme.parse(text)
                at = crossover_tokens(geom, scheme, weights)
                beyond = at is None or at > max_context
                rows.append({"model": geom.name, "parameters": params,
                             "weight_format": "bf16" if bits == 16 else f"{bits}-bit", "weight_bytes": weights,
                             "kv_scheme": scheme.name, "kv_bytes_per_token": bytes_per_token(geom, scheme),
                             "crossover_tokens": at, "max_context": max_context,
                             "note": counted + (f"; beyond the model's {max_context:,}-token context" if beyond else "")})
    return pd.DataFrame(rows).astype({"crossover_tokens": "Int64"})


def _sliding_note(geom: KVGeometry) -> str:
    if geom.sliding_layers:
        return f"{geom.sliding_layers} of {geom.layers} layers read only their {geom.sliding_window}-token window"
    return ""
