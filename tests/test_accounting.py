"""Exact byte accounting of KV caches (kvlab.kernels.accounting)."""

import pytest

from kvlab.steps.costs import article_cost_table, human_bytes
from kvlab.kernels.accounting import (
    DEEPSEEK_V3_MLA,
    LLAMA_31_70B,
    KVGeometry,
    Scheme,
    article_view_bytes,
    bytes_per_token,
    compression_ratio,
    context_bytes,
    kept_tokens,
)

T128K = 131_072
BF16, FP8 = Scheme.bf16(), Scheme.fp8()
INT4 = Scheme.parse("int4-g32-r128")
INT4_KEEP = Scheme.parse("int4-g32-r128+keep0.25")


def _assert_exact_int(x):
    assert type(x) is int


# ----------------------------------------------------------------- geometry


def test_llama_bf16_per_token_and_128k():
    assert bytes_per_token(LLAMA_31_70B, BF16) == 327_680
    assert context_bytes(LLAMA_31_70B, BF16, T128K) == 42_949_672_960
    assert context_bytes(LLAMA_31_70B, BF16, T128K) == 40 * 1024**3


def test_fp8_is_exactly_half():
    assert bytes_per_token(LLAMA_31_70B, FP8) == 327_680 // 2
    assert context_bytes(LLAMA_31_70B, FP8, T128K) == 21_474_836_480
    assert 2 * context_bytes(LLAMA_31_70B, FP8, T128K) == context_bytes(LLAMA_31_70B, BF16, T128K)


def test_int4_g32_per_token_codes_plus_metadata():
    g = LLAMA_31_70B
    codes = g.layers * g.kv_heads * 2 * g.head_dim * 4 // 8
    meta = g.layers * g.kv_heads * (g.head_dim * 4 // 32 + (g.head_dim // 32) * 4)
    assert (codes, meta) == (81_920, 20_480)
    assert bytes_per_token(g, INT4) == 102_400 == codes + meta


# Llama-3.1-70B INT4 G=32, per token over all layers: quantized keys 40,960 B codes + 10,240 B metadata = 51,200;
# quantized values the same; one tensor in BF16 163,840.
KEY_Q = VALUE_Q = 51_200
TENSOR_BF16 = 163_840


def test_int4_residual_and_128k_total_counts_residual_once():
    total = context_bytes(LLAMA_31_70B, INT4, T128K)
    # KIVI's cache at 131,072 tokens (a multiple of R = 128): every key quantized, the newest 128 values in BF16
    assert total == 131_072 * KEY_Q + (131_072 - 128) * VALUE_Q + 128 * TENSOR_BF16 == 13_436_190_720
    # kvlab's earlier policy (together): the newest 128 tokens of both in BF16, the rest in whole groups
    together = context_bytes(LLAMA_31_70B, Scheme.parse("int4-g32-r128-together"), T128K)
    assert together == (131_072 - 128) * 102_400 + 41_943_040 == 13_450_608_640


def test_kivi_policy_formula_against_the_issues_hand_count():
    """T = 200, R = G = 32, D = 64, 2 KV heads, 2-bit: KIVI stores 192 keys and 168 values as codes (8 keys and
    32 values in BF16): 27,520 B; the together policy 160 of both (40 in BF16): 35,840 B."""
    g = KVGeometry("one-layer", layers=1, kv_heads=2, head_dim=64)
    per_head = lambda k, v: k * 16 + k // 32 * 64 * 4 + v * 16 + v * 2 * 4 + (200 - k + 200 - v) * 64 * 2  # noqa: E731
    assert context_bytes(g, Scheme.parse("int2-g32-r32"), 200) == 2 * per_head(192, 168) == 27_520
    assert context_bytes(g, Scheme.parse("int2-g32-r32-together"), 200) == 2 * per_head(160, 160) == 35_840


def test_kivi_policy_needs_a_residual_in_whole_groups():
    with pytest.raises(ValueError, match="residual must be a positive multiple of group 32, got 48"):
        Scheme.parse("int4-g32-r48")
    assert Scheme.parse("int4-g32-r48-together").residual == 48


def test_int4_article_view_adds_residual_on_top():
    view = article_view_bytes(LLAMA_31_70B, INT4, T128K)
    assert view == 131_072 * 102_400 + 41_943_040 == 13_463_715_840
    assert view - 41_943_040 == 12 * 1024**3 + 512 * 1024**2  # 12.5 GiB
    assert view - context_bytes(LLAMA_31_70B, INT4, T128K) == 128 * VALUE_Q + 128 * TENSOR_BF16 == 27_525_120


def test_int4_keep_quarter():
    assert kept_tokens(INT4_KEEP, T128K) == 32_768
    # article view: exactly a quarter of the quantized part, residual on top
    view = article_view_bytes(LLAMA_31_70B, INT4_KEEP, T128K)
    assert view - 41_943_040 == 131_072 * 102_400 // 4
    # physical view (KIVI's cache, 32,768 a multiple of R): the newest 128 kept values in BF16 instead
    assert context_bytes(LLAMA_31_70B, INT4_KEEP, T128K) == 32_768 * KEY_Q + (32_768 - 128) * VALUE_Q + 128 * TENSOR_BF16


def test_mla():
    assert bytes_per_token(DEEPSEEK_V3_MLA, BF16) == 61 * 576 * 2 == 70_272
    assert context_bytes(DEEPSEEK_V3_MLA, BF16, T128K) == 9_210_691_584
    assert human_bytes(9_210_691_584) == "8.58 GiB"


def test_compression_ratio():
    assert compression_ratio(LLAMA_31_70B, INT4) == 3.2
    assert 327_680 / 102_400 == 3.2
    assert compression_ratio(LLAMA_31_70B, FP8, T128K) == 2.0
    assert compression_ratio(LLAMA_31_70B, INT4, T128K) == 42_949_672_960 / 13_436_190_720
    assert compression_ratio(LLAMA_31_70B, INT4_KEEP) == 12.8


def test_byte_counts_are_exact_ints():
    for scheme in (BF16, FP8, INT4, INT4_KEEP, Scheme.parse("int2-g32-r32")):
        for geom in (LLAMA_31_70B, DEEPSEEK_V3_MLA):
            _assert_exact_int(bytes_per_token(geom, scheme))
            _assert_exact_int(context_bytes(geom, scheme, 1000))
            _assert_exact_int(article_view_bytes(geom, scheme, 1000))
    tokens = 2**55 + 4  # not a float64: through a float it rounds to 2**55, and its quarter loses a token
    assert kept_tokens(INT4_KEEP, tokens) == tokens // 4
    for geom in (LLAMA_31_70B, DEEPSEEK_V3_MLA):
        assert context_bytes(geom, BF16, tokens) == tokens * bytes_per_token(geom, BF16)


def test_qwen25_05b_from_card():
    geom = KVGeometry.from_card(
        {"name": "Qwen2.5-0.5B", "num_layers": 24, "num_kv_heads": 2, "head_dim": 64}
    )
    assert bytes_per_token(geom, BF16) == 12_288
    assert context_bytes(geom, BF16, 1000) == 12_288_000


def test_gemma3_sliding_window_card():
    layer_types = (["sliding"] * 5 + ["full"]) * 3
    geom = KVGeometry.from_card({
        "name": "gemma-3-270m", "num_layers": 18, "num_kv_heads": 1, "head_dim": 256,
        "layer_types": layer_types, "sliding_window": 512,
    })
    assert (geom.full_layers, geom.sliding_layers, geom.sliding_window) == (3, 15, 512)
    per_layer_token = 2 * 1 * 256 * 2
    assert bytes_per_token(geom, BF16) == 18 * per_layer_token  # full-attention figure
    assert context_bytes(geom, BF16, 4096) == (3 * 4096 + 15 * 512) * per_layer_token == 20_447_232
    # below the window every layer holds everything
    assert context_bytes(geom, BF16, 300) == 18 * 300 * per_layer_token


def test_from_card_latent_and_bad_layer_types():
    geom = KVGeometry.from_card(
        {"name": "ds", "num_layers": 61, "num_kv_heads": 128, "head_dim": 128, "latent_dim": 576}
    )
    assert bytes_per_token(geom, BF16) == 70_272
    with pytest.raises(ValueError):
        KVGeometry.from_card({"name": "x", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
                              "layer_types": ["full"], "sliding_window": 4})


# ------------------------------------------------------------------- scheme


def test_parse_accepted_forms():
    assert Scheme.parse("bf16") == Scheme.bf16()
    assert Scheme.parse("fp8") == Scheme.fp8()
    s = Scheme.parse("int2-g32-r32")
    assert (s.name, s.bits, s.group, s.residual, s.keep_fraction) == ("int2-g32-r32", 2, 32, 32, 1.0)
    assert Scheme.parse("int4-g32-r128") == Scheme.int(4, 32, 128)
    assert (INT4_KEEP.name, INT4_KEEP.keep_fraction) == ("int4-g32-r128+keep0.25", 0.25)
    assert (INT4_KEEP.scale_bytes, INT4_KEEP.zero_bytes) == (2, 2)


def test_parse_rejects_bad_string_with_one_line_message():
    with pytest.raises(ValueError) as err:
        Scheme.parse("int3-gx")
    msg = str(err.value)
    assert "\n" not in msg
    assert "'int3-gx'" in msg
    for form in ("bf16", "fp8", "int<bits>-g<group>-r<residual>", "+keep<fraction>"):
        assert form in msg
    for bad in ("int4-g32", "int4-g32-r128+keep1.5", "int4-g32-r128+keep0", "fp16", ""):
        with pytest.raises(ValueError):
            Scheme.parse(bad)


def test_kept_tokens_rounds_down_exactly():
    assert kept_tokens(Scheme.bf16().with_keep(0.3), 10) == 3  # not 2 from 0.29999...
    assert kept_tokens(Scheme.bf16().with_keep(0.25), 7) == 1
    assert kept_tokens(Scheme.bf16(), 7) == 7


def test_residual_longer_than_context_is_all_bf16():
    assert context_bytes(LLAMA_31_70B, INT4, 100) == 100 * 327_680


def test_partial_key_group_counts_a_whole_group():
    # 33 quantized tokens -> 2 key groups per channel
    g = KVGeometry("tiny", layers=1, kv_heads=1, head_dim=32)
    s = Scheme.int(4, 32, 0)
    codes = 2 * 33 * 32 * 4 // 8
    key_meta = 32 * 2 * 4
    value_meta = 33 * 1 * 4
    assert context_bytes(g, s, 33) == codes + key_meta + value_meta


# -------------------------------------------------------------------- misc


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(327_680) == "320.00 KiB"
    assert human_bytes(41_943_040) == "40.00 MiB"
    assert human_bytes(42_949_672_960) == "40.00 GiB"
    assert human_bytes(70_272) == "68.63 KiB"


def test_article_cost_table():
    rows = article_cost_table()
    keys = {"model", "scheme", "bytes_per_token", "context_tokens", "total_bytes",
            "article_printed", "article_view", "note"}
    assert all(keys <= row.keys() for row in rows)
    assert all(row["context_tokens"] == T128K for row in rows)
    got = [(r["model"], r["scheme"], r["bytes_per_token"], r["total_bytes"], r["article_printed"])
           for r in rows]
    assert got == [
        ("Llama-3.1-70B", "bf16", 327_680, 42_949_672_960, "40 GB"),
        ("Llama-3.1-70B", "fp8", 163_840, 21_474_836_480, "20 GB"),
        ("Llama-3.1-70B", "int4-g32-r128", 102_400, 13_436_190_720, "12.5 GB + 40 MB"),
        ("Llama-3.1-70B", "int4-g32-r128+keep0.25", 102_400, 3_369_861_120, "≈3.1 GB"),
        ("DeepSeek-V3", "bf16", 70_272, 9_210_691_584, "8.8 GB"),
    ]
    assert rows[2]["article_view"] == 13_463_715_840
    assert [r["article_printed_per_token"] for r in rows] == [
        "320 KB/token", None, None, None, "70 KB/token"]
    assert "8.58 GiB" in rows[4]["note"] and "8.75 GiB" in rows[4]["note"]
    assert all(r["note"] for r in rows)
