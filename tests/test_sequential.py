"""An evaluation job's rounds (kvlab.state.sequential, kvlab.steps.evaluate.run_job) on the tiny model: decided cells stop, the
prompts go on to open ones, the draw order only grows, and two runs give the same rows."""

import re
import time

import pandas as pd
import pytest
from kvlab.steps.evaluate import draw_samples, run_job, summary
from kvlab.methods import build
from kvlab.stats.intervals import drop_bounds, per_sample
from kvlab.report.decision import Rule
from kvlab.state.sequential import cell_drops, open_cells, per_point, planned
from kvlab.tasks import generate

METHODS = {"full": {"kind": "full"}, "snapkv": {"kind": "kvpress", "press": "SnapKVPress", "kwargs": {"window_size": 16}},
           "fp8": {"kind": "quant", "scheme": "fp8", "scales": "dynamic", "residual": 0}}
NEEDLE = {"kind": "niah", "context_tokens": [384], "depths": [0.2, 0.7], "samples": 1, "seed": 0}
TIMING = ("_s", "seconds", "wall", "rows_per_s")


def job(tmp_path, name: str, tiny_dir, max_samples: int, tolerance: float, round_: int = 2) -> pd.DataFrame:
    run = {"methods": build(METHODS), "budgets": [0.5, 0.1], "question_modes": ["agnostic", "aware"], "max_new_tokens": 4,
           "noise_floor_samples": 0, "dtype": "float32", "device": "cpu", "threads": 1,
           "sequential": {"max_samples": max_samples, "round": round_, "rule": {"tolerance_points": tolerance}}}
    return run_job(tiny_dir, "niah_single", NEEDLE, 384, run, tmp_path / f"{name}.parquet")


def decided(rows: pd.DataFrame, tolerance: float) -> bool:
    """Every question mode's cell of these rows (one variant, with the full rows) is safe or unsafe."""
    return not open_cells(rows, Rule(tolerance_points=tolerance))


def test_planned_prompts():
    assert planned({"kind": "niah"}, 6, 96) == 96
    assert planned({"kind": "niah", "max_samples": 20}, 6, 96) == 20
    assert planned({"kind": "niah"}, 6, 0) == 6  # a fixed grid
    assert planned({"kind": "continuation"}, 10, 96) == 96  # prose KL runs in rounds too (kvlab.stats.intervals.kl_bounds)
    assert per_point(6, 2, 20) == 7  # three points: 7 each reach 20


def test_more_draws_keep_the_first_ones_in_draw_order(tiny):
    """Raising the prompts a job may reach only appends: the first round's prompts come first, unchanged, and every
    prefix covers the depths evenly."""
    tokenizer = tiny[1]
    first = generate("n", NEEDLE, tokenizer, 384)
    samples, n0 = draw_samples("n", NEEDLE, tokenizer, 384, 7)
    assert n0 == len(first) == 2 and len(samples) == 7
    assert [s.sample_id for s in samples[:2]] == [s.sample_id for s in first]
    assert [s.depth for s in samples] == [0.2, 0.7, 0.2, 0.7, 0.2, 0.7, 0.2]
    assert len({s.prompt.sha1 for s in samples}) == 7


def test_decided_variants_stop_and_open_ones_go_on(tmp_path, tiny_dir):
    """At a 60-point tolerance a few prompts decide a cell. Each variant stops at the first round after which all its
    cells are decided (checked against the bounds recomputed on its rows at every round end), the full cache runs
    every round, rounds hold `round` prompts after the first, and the job ends when nothing is open."""
    rows = job(tmp_path, "a", tiny_dir, max_samples=24, tolerance=60)
    full = rows[rows["method_kind"] == "full"]
    draws = sorted(full["draw"].unique())
    assert draws == list(range(len(draws)))
    rounds = full.drop_duplicates("sample_id").groupby("round")["sample_id"].size()
    assert rounds.iloc[0] == 2 and (rounds.iloc[1:-1] == 2).all()
    assert (rows["max_samples"] == 24).all()
    ends = full.groupby("round")["draw"].max().to_dict()  # the last draw of each round
    for (method, budget), g in rows[rows["method_kind"] != "full"].groupby(["method", "budget"]):
        last = g["round"].max()
        seen = pd.concat([g, full[full["round"] <= last]])
        assert decided(seen, 60) or last == full["round"].max()
        if last > 1:  # it was still open after the round before its last
            before = pd.concat([g[g["round"] < last], full[full["round"] < last]])
            assert not decided(before, 60)
        assert g["draw"].max() == ends[last]
    if full["draw"].max() + 1 < 24:  # stopped early: nothing was open
        assert not open_cells(rows, Rule(tolerance_points=60))


def test_two_runs_give_identical_rows_and_a_fixed_grid_stays_fixed(tmp_path, tiny_dir):
    a = job(tmp_path, "a", tiny_dir, max_samples=10, tolerance=60)
    b = job(tmp_path, "b", tiny_dir, max_samples=10, tolerance=60)
    keep = [c for c in a.columns if not any(t in c for t in TIMING)]
    pd.testing.assert_frame_equal(a[keep].reset_index(drop=True), b[keep].reset_index(drop=True))
    fixed = job(tmp_path, "c", tiny_dir, max_samples=0, tolerance=60)
    assert fixed["draw"].nunique() == 2 and (fixed["round"] == 1).all()
    assert fixed.groupby(["method", "budget"])["sample_id"].nunique().eq(2).all()


def test_the_job_decides_as_the_report_does(tmp_path, tiny_dir):
    """A cell the job stopped is decided by the report's own bound on the rows it left (paired drop by sample)."""
    rows = job(tmp_path, "a", tiny_dir, max_samples=16, tolerance=60)
    pairs = cell_drops(rows)
    for key, g in pairs.groupby(["method", "budget", "question_mode"]):
        s = per_sample(g, ["full_score", "score"])
        b = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), 60)
        stopped = g["draw"].max() < rows["draw"].max()
        if stopped:
            siblings = pairs[(pairs["method"] == key[0]) & (pairs["budget"] == key[1])]
            assert all(drop_bounds(*per_sample(x, ["full_score", "score"]).to_numpy().T, 60).decide(60) != "inconclusive"
                       for _, x in siblings.groupby("question_mode"))
        assert b.n == g["sample_id"].nunique()


def test_only_the_open_modes_are_compressed_and_decoded(tiny):
    """open_modes gives snapkv@0.5 only its aware cell: it has no agnostic rows, fp8 (no open cell) none at all, the
    full cache both modes, and snapkv's aware answers are those of the unrestricted run."""
    from kvlab.engine import Scope, evaluate_samples
    from kvlab.methods import variants

    model, tokenizer = tiny
    samples = generate("n", NEEDLE, tokenizer, 384)
    grid = variants(build(METHODS), [0.5], "n")
    every = pd.DataFrame(evaluate_samples(model, tokenizer, samples, grid, ["agnostic", "aware"], 4))
    some = pd.DataFrame(evaluate_samples(model, tokenizer, samples, grid, ["agnostic", "aware"], 4,
                                         scope=Scope(open_modes={("snapkv", 0.5): {"aware"}})))
    assert set(some.loc[some["method"] == "snapkv", "question_mode"]) == {"aware"}
    assert "fp8" not in set(some["method"]) and set(some.loc[some["method"] == "full", "question_mode"]) == {"agnostic", "aware"}
    keys = ["sample_id", "method", "question_mode", "turn"]
    both = some.merge(every, on=keys, suffixes=("", "_all"))
    assert len(both) == len(some) and (both["prediction"] == both["prediction_all"]).all()


def test_rows_of_a_round_share_its_seconds(tmp_path, tiny_dir):
    """`round_s` is the round's wall seconds, shared by its rows: it holds the prefills of its samples (a sample's aware
    prefill continues its context's, and its `prefill_s` counts both) and the compressions (one per row) timed inside
    it, and the rounds' seconds add up to no more than the job's."""
    start = time.perf_counter()
    rows = job(tmp_path, "a", tiny_dir, max_samples=8, tolerance=60)
    wall = time.perf_counter() - start
    per_round = rows.groupby("round")["round_s"]
    assert (per_round.nunique() == 1).all() and rows["round"].nunique() > 1
    prefills = rows.groupby(["round", "draw"])["prefill_s"].max().groupby("round").sum()
    inside = prefills + rows.groupby("round")["compress_s"].sum()
    assert (per_round.first() >= inside).all() and per_round.first().sum() <= wall


def test_a_job_ends_on_one_line_of_results():
    """The job's last log line sums its cells up: the full cache's mean score and the range over the compressed cells
    (method, budget, question mode); on a task scored by KL alone, the range of mean KL vs full."""
    rows = pd.DataFrame({"method_kind": ["full", "full", "quant", "quant", "kvpress"], "method": ["full", "full", "kivi2", "kivi2", "snapkv"],
                         "budget": [1.0, 1.0, 1.0, 1.0, 0.5], "question_mode": ["agnostic"] * 5, "score": [1.0, 0.5, 0.5, 0.25, 0.0],
                         "kl_vs_full": [0.0, 0.0, 0.1, 0.2, 0.3]})
    assert summary(rows) == "mean score 0.75 with the full cache, 0.00 to 0.38 over 2 compressed cells"
    assert summary(rows.assign(score=float("nan"))) == "mean KL vs full 0.15 to 0.3 nats over 2 compressed cells"
    assert summary(rows[rows["method_kind"] == "full"]) == "mean score 0.75 with the full cache"


def test_prose_runs_in_rounds_and_stops_each_cell_on_its_kl_bounds(tmp_path, tiny_dir):
    """A continuation job (scored by KL, no answers) runs in rounds as well: each compressed variant stops after the
    first round whose rows decide its cells by kl_bounds, as the report decides them; the job ends when none is open."""
    spec = {"kind": "continuation", "context_tokens": [256], "continuation_tokens": 16, "samples": 3, "seed": 0}
    run = {"methods": build(METHODS), "budgets": [0.5, 0.1], "question_modes": ["agnostic"], "max_new_tokens": 4,
           "noise_floor_samples": 0, "dtype": "float32", "device": "cpu", "threads": 1,
           "sequential": {"max_samples": 30, "round": 3, "rule": {"tolerance_points": 5.0, "kl_safe": 0.01, "kl_cap_ratio": 5}}}
    rows = run_job(tiny_dir, "prose", spec, 256, run, tmp_path / "prose.parquet")
    full = rows[rows["method_kind"] == "full"]
    assert rows["kl_vs_full"].notna().all() and full["round"].max() > 1
    for (method, budget), g in rows[rows["method_kind"] != "full"].groupby(["method", "budget"]):
        last = g["round"].max()
        assert bool(open_cells(g, Rule())) == (last == full["round"].max() and full["draw"].max() + 1 == 30)
        if last > 1:
            assert open_cells(g[g["round"] < last], Rule())  # still open before its last round


def test_a_long_batch_reports_progress_on_a_heartbeat(tmp_path, tiny_dir, monkeypatch, caplog):
    """Within one batch of samples, the job logs its progress every HEARTBEAT_S seconds (30 in a run; 0.02 here): the
    samples in progress, rows so far, rows per second and time left."""
    import logging

    import kvlab.steps.evaluate

    monkeypatch.setattr(kvlab.steps.evaluate, "HEARTBEAT_S", 0.02)
    with caplog.at_level(logging.INFO, logger="kvlab.steps.evaluate"):
        job(tmp_path, "a", tiny_dir, max_samples=4, tolerance=60)
    beats = re.findall(r"samples (\d+)-(\d+)/4 in progress: (\d+) rows, [\d.]+ rows/s, \d+ s elapsed, "
                       r"(~\d+ s left at most|time left known after the first sample)", caplog.text)
    assert beats and beats[0][3] == "time left known after the first sample"
    assert any(left.startswith("~") for *_, left in beats)  # after the first sample: an estimate


def test_a_time_limit_stops_a_job_after_its_round_and_rows_say_so(tmp_path, tiny_dir, monkeypatch):
    """sequential.stop_after_minutes: with a limit already spent when the first round ends (every round's time read
    as a minute more: `time.perf_counter` patched), the job runs that round whole and no other, with cells still open
    (a 1-point tolerance decides nothing in 2 prompts), and every row says stopped_by 'time'; without the limit the
    same job goes on to max_samples and says so; a job whose cells all settle says 'decided'."""
    from kvlab.steps import evaluate
    from kvlab.steps.evaluate import time_up

    assert not time_up({}, 1e9) and not time_up({"stop_after_minutes": None}, 1e9) and not time_up({"stop_after_minutes": 0}, 1e9)
    assert not time_up({"stop_after_minutes": 2}, 119.9) and time_up({"stop_after_minutes": 2}, 120)

    def run(name, limit=None, tolerance=1.0, max_samples=6):
        seq = {"max_samples": max_samples, "round": 2, "rule": {"tolerance_points": tolerance},
               **({"stop_after_minutes": limit} if limit is not None else {})}
        cfg = {"methods": build(METHODS), "budgets": [0.5], "question_modes": ["agnostic", "aware"], "max_new_tokens": 4,
               "noise_floor_samples": 0, "dtype": "float32", "device": "cpu", "threads": 1, "sequential": seq}
        return run_job(tiny_dir, "niah_single", NEEDLE, 384, cfg, tmp_path / f"{name}.parquet")

    with monkeypatch.context() as m:
        calls = iter(range(10**6))
        m.setattr(evaluate.time, "perf_counter", lambda: 60.0 * next(calls))  # each reading a minute after the last
        timed = run("timed", limit=1)
    assert set(timed["round"]) == {1} and timed["draw"].nunique() == 2 and set(timed["stopped_by"]) == {"time"}
    assert open_cells(timed, Rule(tolerance_points=1.0))  # cells left open: the time ended the job, not its answers
    untimed = run("untimed")
    assert untimed["draw"].nunique() == 6 and set(untimed["stopped_by"]) == {"max_samples"}
    keep = [c for c in timed.columns if not any(t in c for t in TIMING) and c != "stopped_by"]
    first = untimed[untimed["round"] == 1]
    pd.testing.assert_frame_equal(timed[keep].reset_index(drop=True), first[keep].reset_index(drop=True))
    settled = run("settled", tolerance=99.0, max_samples=96)  # every cell settles at 99 points: the job ends decided
    assert set(settled["stopped_by"]) == {"decided"} and settled["draw"].nunique() < 96


def test_the_time_limit_is_opt_in_and_leaves_a_run_without_it_unchanged():
    """sequential.stop_after_minutes is absent by default: the jobs' params (Snakemake reruns a job whose params
    change; kvlab.state.resume keys checkpoints on them) are those of a run before it existed; set, it reaches each job."""
    from pathlib import Path

    import yaml

    from kvlab.state.config import ConfigError, resolve
    from kvlab.state.jobs import run_params

    root = Path(__file__).resolve().parents[1]
    base = yaml.safe_load((root / "config.yaml").read_text())
    schema = root / "workflow" / "config.schema.yaml"
    plain = resolve(base, schema)
    assert "stop_after_minutes" not in plain["sequential"]
    assert "stop_after_minutes" not in run_params(plain, {}, "niah_single")["sequential"]
    timed = resolve({**base, "sequential": {**base["sequential"], "stop_after_minutes": 2.5}}, schema)
    assert run_params(timed, {}, "niah_single")["sequential"]["stop_after_minutes"] == 2.5
    with pytest.raises(ConfigError, match="stop_after_minutes"):
        resolve({**base, "sequential": {**base["sequential"], "stop_after_minutes": -1}}, schema)


def test_scored_cells_are_settled_on_their_scores_not_the_kl_their_rows_also_carry():
    """Scored rows carry the per-token KL along the full answer too (the engine measures it on every row). A cell that
    loses every answer is unsafe on its scores, and the job stops it, even where that KL alone would leave it open
    (0.01 nat, at the threshold): the report decides scored cells on scores alone."""
    rows = pd.DataFrame([{"sample_id": f"s{i}", "question_mode": "aware", "turn": 1, "method": m, "method_kind": k,
                          "budget": 1.0, "score": 1.0 if k == "full" else 0.0, "kl_vs_full": 0.0 if k == "full" else 0.01,
                          "task": "t", "context_tokens": 1, "draw": i}
                         for i in range(30) for m, k in (("full", "full"), ("fp8", "quant"))])
    assert open_cells(rows, Rule()) == {}
    prose = rows.assign(score=None)
    assert open_cells(prose, Rule()) == {("fp8", 1.0): {"aware"}}  # unscored rows: decided on KL, at the threshold


def test_rounds_stop_where_the_generator_runs_out_of_distinct_prompts(tiny, monkeypatch, caplog):
    """Prose KL on a corpus cut to 300 sentences holds only a few non-overlapping 1K windows: a job asking up to 200
    prompts gets every distinct one the draw finds (the same prefix a direct draw of that many gives, none overlapping)
    and says so in its log; a first round asking more than the corpus holds still fails in one line."""
    import kvlab.tasks.continuation as continuation
    from kvlab.tasks.base import TooFewPrompts

    small = continuation.kjv_sentences()[:300]
    monkeypatch.setattr(continuation, "kjv_sentences", lambda: small)
    prose = {"kind": "continuation", "context_tokens": [1000], "continuation_tokens": 32, "samples": 2, "seed": 0}
    with caplog.at_level("WARNING"):
        samples, first = draw_samples("p", prose, tiny[1], 1000, 200)
    assert first == 2 and 2 < len(samples) < 200
    assert f"the generator holds {len(samples)} distinct prompts" in caplog.text
    direct = generate("p", {**prose, "samples": len(samples)}, tiny[1], 1000)
    assert [s.prompt.sha1 for s in direct] == [s.prompt.sha1 for s in samples]
    assert not any(a.clash(b) for i, a in enumerate(samples) for b in samples[:i])
    with pytest.raises(TooFewPrompts, match=rf"^task 'p': sample {len(samples) + 1} of 200 still shares overlapping prose"):
        generate("p", {**prose, "samples": 200}, tiny[1], 1000)
