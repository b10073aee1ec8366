"""KV bytes read per decode step (kvlab.kernels.reads): NSA, MoBA and full attention counted by hand on small
geometries and on Llama-3.1-70B, the KV-over-weights crossover, and claims C13/C14 with their report section."""

from fractions import Fraction
from pathlib import Path

import duckdb
import pandas as pd
import pytest
import yaml

from kvlab.steps.costs import crossover_rows, read_rows
from kvlab.kernels.accounting import DEEPSEEK_V3_MLA, LLAMA_31_70B, KVGeometry, Scheme, context_bytes
from kvlab.kernels.reads import (
    LLAMA_3_70B_PARAMS, NSA, MoBA, crossover_tokens, decode_read_bytes, weight_bytes,
)
from kvlab.report.build import load_queries
from kvlab.report.claims import CLAIMS, verdicts
from kvlab.report.decision import Rule
from kvlab.report.sections import SECTIONS, cost_article, cost_reads

REPORT = yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())["report"]
TINY = KVGeometry(name="tiny", layers=2, kv_heads=1, head_dim=4)  # bf16: 2 × 1 × 4 × 2 = 16 B per layer and token
SMALL_NSA = NSA(compress_block=4, compress_stride=2, select_block=4, select_blocks=2, window=4)
LLAMA_TOKEN = 2 * 80 * 8 * 128 * 2  # 327,680 B per token, BF16


def test_nsa_reads_by_hand():
    # 16 tokens: compressed blocks start at 0, 2, …, 12 → 7; 2 selected blocks of 4 → 8; window 4
    assert SMALL_NSA.branch_tokens(16) == {"compressed": 7, "selected": 8, "window": 4}
    assert decode_read_bytes(TINY, 16, SMALL_NSA) == 2 * (7 + 8 + 4) * 16 == 608
    assert decode_read_bytes(TINY, 16) == 2 * 16 * 16  # full attention reads less at this short context
    assert SMALL_NSA.branch_tokens(3) == {"compressed": 0, "selected": 3, "window": 3}  # no complete block yet


def test_moba_reads_by_hand():
    moba = MoBA(block=4, top_k=3)
    # 17 tokens: 4 complete blocks + the current block of 1; the current and 2 past blocks read, 4 mean keys scored
    assert moba.read_tokens(17) == (1 + 2 * 4, 4)
    assert decode_read_bytes(TINY, 17, moba) == 2 * (9 * 16 + 4 * 8) == 352  # a key alone is half of 16 B
    # 8 tokens: 1 past block + the current one — every token is read, plus one mean key
    assert decode_read_bytes(TINY, 8, moba) == 2 * (8 * 16 + 8) > decode_read_bytes(TINY, 8)


def test_article_geometry_at_64k():
    full, nsa, moba = (decode_read_bytes(LLAMA_31_70B, 65_536, m) for m in (None, NSA(), MoBA()))
    assert full == 65_536 * LLAMA_TOKEN
    # (65,536 − 32) // 16 + 1 = 4,095 compressed + 16 × 64 selected + 512 window
    assert nsa == (4_095 + 1_024 + 512) * LLAMA_TOKEN
    assert Fraction(full, nsa) == Fraction(65_536, 5_631) and round(full / nsa, 1) == 11.6  # the NSA paper's 11.6×
    # current block + 2 past blocks of 512, and 127 past blocks' mean keys (keys only: half a token)
    assert moba == 1_536 * LLAMA_TOKEN + 127 * LLAMA_TOKEN // 2


def test_sliding_layers_read_their_window_under_every_method():
    geom = KVGeometry(name="hybrid", layers=2, kv_heads=1, head_dim=4, sliding_layers=1, sliding_window=4)
    assert decode_read_bytes(geom, 64) == 64 * 16 + 4 * 16
    assert decode_read_bytes(geom, 64, SMALL_NSA) == sum(SMALL_NSA.branch_tokens(64).values()) * 16 + 4 * 16
    assert decode_read_bytes(geom, 64, MoBA(block=4, top_k=3)) == (4 + 2 * 4) * 16 + 15 * 8 + 4 * 16


def test_reads_never_shrink_and_the_sparse_saving_grows_with_context():
    for method in (None, SMALL_NSA):
        reads = [decode_read_bytes(TINY, t, method) for t in range(600)]
        assert all(a <= b for a, b in zip(reads, reads[1:]))
    contexts = [8_192, 16_384, 32_768, 65_536, 131_072]
    for method in (NSA(), MoBA()):
        ratios = [decode_read_bytes(LLAMA_31_70B, t) / decode_read_bytes(LLAMA_31_70B, t, method) for t in contexts]
        assert all(a < b for a, b in zip(ratios, ratios[1:])), method


def test_bad_inputs_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="compress_stride 64 exceeds compress_block 32"):
        NSA(compress_stride=64)
    with pytest.raises(ValueError, match="MoBA.top_k must be a positive integer, got 0"):
        MoBA(top_k=0)
    with pytest.raises(ValueError, match="an MLA latent has no separate keys"):
        decode_read_bytes(DEEPSEEK_V3_MLA, 1024, NSA())
    with pytest.raises(ValueError, match="dense caches"):
        decode_read_bytes(TINY, 1024, NSA(), Scheme.parse("int4-g32-r128"))


def test_weights_and_llama_parameters():
    assert LLAMA_3_70B_PARAMS == 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 2 * 128256 * 8192 + 8192
    assert weight_bytes(LLAMA_3_70B_PARAMS, 16) == 141_107_412_992
    assert weight_bytes(3, 4) == 2  # 1.5 bytes round up


def test_crossover_by_hand():
    # TINY reads 32 B per token: 31 tokens read 992 B, 32 read 1,024 B; the reads must exceed the weights
    assert crossover_tokens(TINY, Scheme.bf16(), 1000) == 32
    assert crossover_tokens(TINY, Scheme.bf16(), 1024) == 33
    hybrid = KVGeometry(name="hybrid", layers=2, kv_heads=1, head_dim=4, sliding_layers=1, sliding_window=4)
    assert crossover_tokens(hybrid, Scheme.bf16(), 1000) == 59  # 16·59 + 16·4 = 1,008 > 1,000 ≥ 16·58 + 64
    window_only = KVGeometry(name="w", layers=1, kv_heads=1, head_dim=4, sliding_layers=1, sliding_window=4)
    assert crossover_tokens(window_only, Scheme.bf16(), 1000) is None  # never more than 4 tokens × 16 B


def test_llama_crossover():
    w16, w4 = weight_bytes(LLAMA_3_70B_PARAMS, 16), weight_bytes(LLAMA_3_70B_PARAMS, 4)
    assert crossover_tokens(LLAMA_31_70B, Scheme.bf16(), w16) == w16 // LLAMA_TOKEN + 1 == 430_626
    assert crossover_tokens(LLAMA_31_70B, Scheme.fp8(), w4) == w4 // (LLAMA_TOKEN // 2) + 1
    int4 = Scheme.parse("int4-g32-r128")
    at = crossover_tokens(LLAMA_31_70B, int4, w4)
    assert context_bytes(LLAMA_31_70B, int4, at - 1) <= w4 < context_bytes(LLAMA_31_70B, int4, at)
    assert at > crossover_tokens(LLAMA_31_70B, Scheme.fp8(), w4) > crossover_tokens(LLAMA_31_70B, Scheme.bf16(), w4)
    assert crossover_tokens(LLAMA_31_70B, int4, w16) > at


def query(reads: pd.DataFrame, crossover: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The two queries of the section, run on the frames as DuckDB would hold them after rule collect."""
    con = duckdb.connect()
    con.register("reads", reads)
    con.register("crossover", crossover)
    sql = load_queries()
    return {name: con.execute(sql[name]).df() for name in cost_reads.QUERIES}


def test_config_defaults_are_the_papers():
    assert REPORT["sparse_reads"]["nsa"] == {"compress_block": 32, "compress_stride": 16, "select_block": 64,
                                             "select_blocks": 16, "window": 512}
    assert REPORT["sparse_reads"]["moba"] == {"block": 512, "top_k": 3} and 65_536 in REPORT["sparse_reads"]["context_tokens"]


GEMMA_LIKE = {"name": "g", "num_layers": 3, "num_kv_heads": 1, "head_dim": 8, "layer_types": ["sliding", "sliding", "full"],
              "sliding_window": 512, "n_params": 1_000_000, "max_position_embeddings": 32_768, "vocab_size": 1_000,
              "hidden_size": 256}


def test_rows_cover_every_model_up_to_its_context():
    reads = read_rows([GEMMA_LIKE], REPORT["sparse_reads"])
    g = reads[reads["model"] == "g"]
    assert set(g["context_tokens"]) == {8_192, 16_384, 32_768} and set(g["method"]) == {"full", "nsa", "moba"}
    assert g["note"].str.contains("2 of 3 layers read only their 512-token window").all()
    cross = crossover_rows([GEMMA_LIKE], REPORT["crossover"])
    assert len(cross) == 2 * 2 * 3  # 2 models × 2 weight formats × 3 KV schemes
    one = cross[(cross["model"] == "g") & (cross["weight_format"] == "bf16") & (cross["kv_scheme"] == "bf16")].iloc[0]
    # 2,000,000 B of weights; 2 sliding layers hold 512 tokens × 32 B, the full layer 32 B per token
    assert one["crossover_tokens"] == (2_000_000 - 2 * 512 * 32) // 32 + 1
    assert one["note"].startswith("the input embedding (25.6% of the parameters)")  # 1,000 × 256 of 1,000,000
    assert "beyond the model's 32,768-token context" in one["note"]


def test_claims_c13_c14_on_the_shipped_config():
    q = query(read_rows([], REPORT["sparse_reads"]), crossover_rows([], REPORT["crossover"]))
    (c13, v13, e13), (c14, v14, e14) = verdicts([13, 14], q)
    assert c13.startswith("C13 NSA") and v13 == "holds" and "11.64× fewer" in e13 and "40.97× fewer" in e13
    assert v14 == "does not hold" and f"{430_626:,}" in e14 and "4-bit weights with bf16 KV" in e14
    assert all("not measured." in e and "Computed from the formula" in e for e in (e13, e14))


def test_claims_c13_c14_follow_the_numbers():
    wide = dict(REPORT["sparse_reads"], nsa={**REPORT["sparse_reads"]["nsa"], "select_blocks": 64})
    crossover = crossover_rows([], REPORT["crossover"])
    (_, v13, e13), = verdicts([13], query(read_rows([], wide), crossover))
    assert v13 == "does not hold" and "7.53× fewer" in e13  # 65,536 / (4,095 + 4,096 + 512)
    near = crossover.copy()
    near.loc[0, "crossover_tokens"] = 45_000  # within 25% of 40,960
    (_, v14, _), = verdicts([14], query(read_rows([], REPORT["sparse_reads"]), near))
    assert v14 == "holds"
    short = dict(REPORT["sparse_reads"], context_tokens=[8_192])
    (_, v13, e13), = verdicts([13], query(read_rows([], short), crossover))
    assert v13 == "not measured" and "report.sparse_reads.context_tokens" in e13


def test_section_renders_rows_and_verdicts_after_the_cost_table():
    q = query(read_rows([], REPORT["sparse_reads"]), crossover_rows([], REPORT["crossover"]))
    page = cost_reads.body(q, Rule())
    assert "C13 NSA: 64K decode reads ≈ 11× fewer KV bytes: holds</b>" in page
    assert "C14 Llama-3-70B: KV reads exceed weight reads from ≈ 40K context: does not hold</b>" in page
    assert "compressed 4,095 + selected 1,024 + window 512" in page and "<td>430,626</td>" in page
    assert "not measured" in page
    assert SECTIONS.index(cost_reads) == SECTIONS.index(cost_article) + 1
    assert [c.number for c in CLAIMS] == list(range(1, 18))
