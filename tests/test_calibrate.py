"""Calibration on the tiny model: table shapes and ranges, the RoPE relation between pre- and post-RoPE keys,
attention rows equal to eager attention, sink detection on a planted pattern, and determinism."""

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvlab.steps.calibrate import (
    apply_rope, attention_rows, calibrate, calibration_sequences, concentration, leading_sinks, lloyd_grid, project,
    sink_rows,
)
from kvlab.state.config import CALIBRATION_TABLES
from kvlab.util.corpus import _all_sentences, kjv_sentences
from kvlab.engine import attention_layers, capture


@pytest.fixture(scope="module")
def seqs(tiny):
    return calibration_sequences(tiny[1], 2, 96, seed=0)


@pytest.fixture(scope="module")
def tables(tiny, seqs):
    return calibrate(tiny[0], tiny[1], seqs, query_positions=16, sink_threshold=0.05)


def test_calibration_text_never_overlaps_the_tasks(tiny, seqs):
    assert len(seqs) == 2 and all(len(s) == 96 for s in seqs) and seqs[0] != seqs[1]
    evaluation, calibration = kjv_sentences("evaluation"), kjv_sentences("calibration")
    # one text cut in two: the tasks read the first 90%, calibration the last 10%
    assert evaluation + calibration == _all_sentences()
    assert len(calibration) == pytest.approx(0.1 * len(_all_sentences()), abs=1)
    text = tiny[1].decode(seqs[0])
    assert any(sentence[:30] in text for sentence in calibration)
    with pytest.raises(ValueError, match="corpus split 'test' is unknown"):
        kjv_sentences("test")


def test_every_table_shape_and_range(tiny, tables):
    model = tiny[0]
    cfg = model.config
    layers, kv, d, hq = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    assert tuple(tables) == CALIBRATION_TABLES
    kc = tables["key_channels"]
    assert len(kc) == layers * kv * d * 3 and set(kc["tensor"]) == {"key_pre_rope", "key_post_rope", "value"}
    assert (kc["absmax"] >= kc["p999_abs"]).all() and (kc["p999_abs"] >= kc["mean_abs"]).all() and (kc["mean_abs"] > 0).all()
    assert (kc.groupby(["layer", "kv_head", "tensor"])["outlier_score"].median() - 1).abs().max() < 0.1
    massive = tables["massive"]
    assert set(massive["position_class"]) == {"first", "delimiter", "other"} and (massive["max_abs"] > 0).all()
    assert (massive.loc[massive["position_class"] == "first", "position"] == 0).all()
    sinks = tables["sinks"]
    assert {0, 1, 2, 3} <= set(sinks["position"]) and sinks["mass"].between(0, 1).all()
    assert set(sinks["head"]) == set(range(hq)) and set(sinks["sequence"]) == {0, 1}
    conc = tables["concentration"]
    assert len(conc) == layers and conc["keys90_fraction"].between(0, 1).all() and (conc["entropy"] > 0).all()
    scales = tables["fp8_scales"]
    assert len(scales) == layers * kv * 2
    assert scales["scale"].tolist() == pytest.approx((scales["absmax"] / 448).tolist())
    ranges = tables["kvquant_ranges"]
    assert len(ranges) == layers * kv * model.config.head_dim and (ranges["lo"] < ranges["hi"]).all()
    grids = tables["kvquant_grids"]
    for (layer, bits), g in grids.groupby(["layer", "bits"]):
        assert len(g) == 2**bits and g["value"].is_monotonic_increasing and g["value"].between(-1, 1).all()
    assert tables["layer_budget"]["budget_weight"].mean() == pytest.approx(1.0)
    assert len(tables["stream_sinks"]) == 1


def test_post_rope_keys_are_the_rotated_pre_rope_keys(tiny, seqs):
    """Re-applying RoPE to the recomputed pre-RoPE keys reproduces the keys the model cached."""
    model = tiny[0]
    store, cache = [], DynamicCache(config=model.config)
    with torch.no_grad(), capture(model, store):
        model.model(input_ids=torch.tensor([seqs[0]]), past_key_values=cache, use_cache=True)
    for i, module in enumerate(attention_layers(model)):
        pre = project(module, store[i].hidden_states, "k")
        torch.testing.assert_close(apply_rope(pre, store[i].cos, store[i].sin), cache.layers[i].keys, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(pre[..., 1:, :], cache.layers[i].keys[..., 1:, :], atol=1e-3)  # RoPE really rotated


def test_attention_rows_equal_eager_attention_weights(tiny_dir, seqs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    store = []
    with torch.no_grad(), capture(model, store):
        out = model.model(input_ids=torch.tensor([seqs[0]]), output_attentions=True)
    at = torch.tensor([10, 50, 95])
    for i, module in enumerate(attention_layers(model)):
        keys = apply_rope(project(module, store[i].hidden_states, "k"), store[i].cos, store[i].sin)
        ours = attention_rows(model, i, module, store[i], keys, at)
        torch.testing.assert_close(ours[0], out.attentions[i][0][:, at], rtol=1e-5, atol=1e-6)


def planted(first: float, second: float = 0.0, heads: int = 4, queries: int = 8, keys: int = 32) -> torch.Tensor:
    """Attention rows where token 0 (and token 1) take fixed shares and the rest is spread evenly."""
    planted_keys = 2 if second else 1
    p = torch.full((heads, queries, keys), (1 - first - second) / (keys - planted_keys))
    p[..., 0] = first
    if second:
        p[..., 1] = second
    return p


def test_planted_sink_is_found():
    tokens = ["<s>", "The", " word", "."] + [" x"] * 28
    rows = sink_rows(planted(0.7), layer=3, sequence=0, tokens=tokens, threshold=0.05)
    sinks = rows[rows["is_sink"]]
    assert set(sinks["position"]) == {0} and sinks["mass"].tolist() == pytest.approx([0.7] * 4)
    frame = pd.concat([sink_rows(planted(0.7), layer, 0, tokens, 0.05) for layer in range(4)])
    assert leading_sinks(frame, layers=4, threshold=0.05) == 1
    two = pd.concat([sink_rows(planted(0.5, 0.3), layer, 0, tokens, 0.05) for layer in range(4)])
    assert leading_sinks(two, layers=4, threshold=0.05) == 2
    flat = pd.concat([sink_rows(planted(1 / 32, 1 / 32), layer, 0, tokens, 0.05) for layer in range(4)])
    assert leading_sinks(flat, layers=4, threshold=0.05) == 0


def test_concentration_of_known_patterns():
    entropy, keys90 = concentration(planted(0.95))
    assert keys90 == pytest.approx(1 / 32) and entropy < 0.5
    uniform = torch.full((1, 1, 10), 0.1)
    entropy, keys90 = concentration(uniform)
    assert entropy == pytest.approx(torch.log(torch.tensor(10.0)).item(), rel=1e-5) and keys90 == pytest.approx(0.9)


def test_deterministic_for_a_seed(tiny, seqs, tables):
    again = calibrate(tiny[0], tiny[1], calibration_sequences(tiny[1], 2, 96, seed=0), 16, 0.05)
    for name in CALIBRATION_TABLES:
        pd.testing.assert_frame_equal(tables[name], again[name])
    assert calibration_sequences(tiny[1], 2, 96, seed=1) != seqs


def test_bad_input_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="must share one length"):
        calibrate(tiny[0], tiny[1], [[1] * 20, [1] * 21], 4, 0.05)


def test_calibrated_kwargs_take_the_measured_value(tmp_path):
    from kvlab.methods import build, uses_calibration, with_calibration

    methods = build({"full": {"kind": "full"}, "stream": {"kind": "kvpress", "press": "StreamingLLMPress", "kwargs": {"n_sink": "calibrated"}}})
    assert uses_calibration(methods) and not uses_calibration(build({"full": {"kind": "full"}}))
    pd.DataFrame([{"model": "m", "n_sink": 3}]).to_parquet(tmp_path / "stream_sinks.parquet")
    resolved = with_calibration(methods, tmp_path)
    assert resolved["stream"].entry["kwargs"] == {"n_sink": 3} and resolved["stream"].kind.params["kwargs"] == {"n_sink": 3}
    assert resolved["full"] is methods["full"]  # a method that reads no calibration is left as it was
    assert methods["stream"].entry["kwargs"]["n_sink"] == "calibrated"  # the config is left as it was


def test_lloyd_grid_lowers_the_rounding_error_of_equal_mass_levels():
    """On heavy-tailed data the k-means grid beats the quantile grid it starts from (tails get levels)."""
    x = torch.distributions.StudentT(3.0).sample((200_000,)).double().clamp(-20, 20) / 20
    def mse(grid):
        cell = torch.bucketize(x, (grid[1:] + grid[:-1]) / 2)
        return float(((x - grid[cell]) ** 2).mean())
    quantiles = torch.quantile(x, (torch.arange(4, dtype=x.dtype) + 0.5) / 4)
    grid = lloyd_grid(x, 4)
    assert bool((grid[1:] > grid[:-1]).all())
    assert mse(grid) < 0.8 * mse(quantiles)
