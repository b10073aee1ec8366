"""The cost table (article §8) as rows: the article's models, then every evaluated model's card; and the KV bytes
a decode step reads (NSA and MoBA against full attention, §6) and where they exceed the weights' (§8.3)."""

from __future__ import annotations

import pandas as pd

from kvlab.kernels.accounting import (
    ARTICLE_CONTEXT_TOKENS,
    DEEPSEEK_V3_MLA,
    LLAMA_31_70B,
    KVGeometry,
    Scheme,
    article_view_bytes,
    bytes_per_token,
    compression_ratio,
    context_bytes,
)
from kvlab.kernels.reads import LLAMA_3_70B_PARAMS, NSA, MoBA, crossover_tokens, decode_read_bytes, weight_bytes

def human_bytes(n: int) -> str:
    """Format a byte count in binary units with 2 decimals ("40.00 GiB", "512 B").

    Rounds half up, using integer arithmetic only.
    """
    if n < 0:
        raise ValueError("byte count must be >= 0")
    if n < 1024:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    k = 1
    while k < len(units) and n >= 1024 ** (k + 1):
        k += 1
    unit = 1024**k
    hundredths = (n * 100 + unit // 2) // unit
    return f"{hundredths // 100}.{hundredths % 100:02d} {units[k - 1]}"


def article_cost_table() -> list[dict]:
    """Rows of the article's §8 cost table at 128K = 131,072 tokens.

    Each row: ``model``, ``scheme``, ``bytes_per_token`` (steady-state, per
    stored token), ``context_tokens``, ``total_bytes`` (physical view,
    :func:`context_bytes`), ``article_view`` (:func:`article_view_bytes`),
    ``total_human``, ``article_printed`` (the article's 128K figure),
    ``article_printed_per_token`` (its per-token figure, where it prints one)
    and ``note``.  The article's "KB"/"MB"/"GB" are binary units
    (KiB/MiB/GiB).
    """
    t = ARTICLE_CONTEXT_TOKENS
    specs = [
        (LLAMA_31_70B, "bf16", "40 GB", "320 KB/token",
         "Exact: 327,680 B/token = 320 KiB; 42,949,672,960 B = 40 GiB (article's KB/GB are KiB/GiB)."),
        (LLAMA_31_70B, "fp8", "20 GB", None,
         "Exactly half of BF16 = 20 GiB; FP8's static per-head scales are negligible and counted as 0."),
        (LLAMA_31_70B, "int4-g32-r128", "12.5 GB + 40 MB", None,
         "102,400 B/token = 81,920 B codes + 20,480 B group metadata (3.2x vs BF16). The article "
         "quantizes all 131,072 tokens and adds the 128-token BF16 residual on top (article_view = "
         "12.5 GiB + 40 MiB); total_bytes is what KIVI's cache holds: at 131,072 tokens (a multiple of R) "
         "every key is quantized and the newest 128 values are held in BF16 instead of quantized, "
         "27,525,120 B (26.25 MiB) less."),
        (LLAMA_31_70B, "int4-g32-r128+keep0.25", "≈3.1 GB", None,
         "SnapKV 25%: 32,768 of 131,072 tokens kept; the quantized part is one quarter of the "
         "article's 12.5 GiB = 3.125 GiB, most likely what '≈3.1 GB' rounds (without the 40 MiB "
         "residual; with it, article_view = 3.16 GiB). Physical total (KIVI's cache: 128 values in BF16): 3.14 GiB."),
        (DEEPSEEK_V3_MLA, "bf16", "8.8 GB", "70 KB/token",
         "61 layers x 576-element latent x 2 B = 70,272 B/token (68.63 KiB, 70.3 decimal kB); exact "
         "128K total 9,210,691,584 B = 8.58 GiB (9.21 decimal GB). The printed 8.8 GB is a rounding "
         "discrepancy: the article rounds the per-token figure to '70 KB' and multiplies that as "
         "70 KiB x 128 Ki tokens = 8.75 GiB, printed 8.8; no unit convention gives 8.8 from the exact bytes."),
    ]
    rows = []
    for geom, scheme_text, printed, printed_per_token, note in specs:
        scheme = Scheme.parse(scheme_text)
        total = context_bytes(geom, scheme, t)
        rows.append({
            "model": geom.name,
            "scheme": scheme.name,
            "bytes_per_token": bytes_per_token(geom, scheme),
            "context_tokens": t,
            "total_bytes": total,
            "article_view": article_view_bytes(geom, scheme, t),
            "total_human": human_bytes(total),
            "article_printed": printed,
            "article_printed_per_token": printed_per_token,
            "note": note,
        })
    return rows


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
