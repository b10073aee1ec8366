"""Verdicts that keep their promise (issue 52), simulated with the project's own functions and its round schedule:
the printed cell is the tested cell, KL verdicts about a bounded quantity hold under heavy tails, the table's
decisions keep their false-decision rate, a cell with one early loss is decided near the exact binomial's n, and no
n overflows. Vectorised over cells (kvlab.stats.anytime.wealth_at): seconds."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import optimize, stats

from kvlab.stats.anytime import ALPHA, ebh, sequence, wealth_at
from kvlab.report.decision import Rule, cells, decision_table
from kvlab.state.config import expand
from kvlab.stats.intervals import drop_bounds, kl_bounds, lossless_samples, quiet_kl_samples
from kvlab.tools.kl_tail import FAMILIES, Rounds, before, cost, first_true, prose_job, quiet, safe_share

LEVEL = math.log(1 / ALPHA)
THETA = 0.05  # 5 points
ROOT = Path(__file__).resolve().parents[1]
CONFIG, SCHEMA = ROOT / "config.yaml", ROOT / "workflow" / "config.schema.yaml"


def run_table(drops: np.ndarray, ends: np.ndarray, stop_e: float) -> dict[str, np.ndarray]:
    """Each row of `drops` (cells × max samples) as a job would run it: read at `ends`, its own decision the first
    crossing of 1/α by either bet (sticky), stopped at the first read where it is decided and the e-value of its
    decision reaches `stop_e` (else at the last end). Returns the decisions (+1 safe, −1 unsafe, 0 open), the log
    e-values of both tests at the stop and the samples used."""
    up, down = wealth_at(drops, -1.0, 1.0, THETA)
    safe_at, unsafe_at = first_true(down >= LEVEL), first_true(up >= LEVEL)
    stop = np.full(len(drops), ends[-1])
    for n in ends[::-1]:
        safe = (safe_at > 0) & (safe_at <= n) & ((unsafe_at == 0) | (safe_at <= unsafe_at))
        unsafe = (unsafe_at > 0) & (unsafe_at <= n) & ~safe
        log_e = np.where(safe, down[:, n - 1], np.where(unsafe, up[:, n - 1], -np.inf))
        stop = np.where(log_e >= math.log(stop_e), n, stop)
    rows = np.arange(len(drops))
    decided_safe = (safe_at > 0) & (safe_at <= stop) & ((unsafe_at == 0) | (safe_at <= unsafe_at))
    decided_unsafe = (unsafe_at > 0) & (unsafe_at <= stop) & ~decided_safe
    return {"decision": np.where(decided_safe, 1, np.where(decided_unsafe, -1, 0)), "n": stop,
            "log_e_safe": down[rows, stop - 1], "log_e_unsafe": up[rows, stop - 1]}


def table_kept(out: dict[str, np.ndarray], alpha_scale: float) -> np.ndarray:
    """The decisions e-BH keeps over the table's 2C tests at alpha_scale × α (kvlab.report.decision.kept uses 2)."""
    both = ebh(np.r_[out["log_e_safe"], out["log_e_unsafe"]], alpha_scale * ALPHA, log=True)
    c = len(out["decision"])
    return np.where(out["decision"] == 1, both[:c], np.where(out["decision"] == -1, both[c:], False))


def simulated_table(rng, most: int) -> tuple[np.ndarray, np.ndarray]:
    """The audit's table: 100 cells losing exactly the tolerance, 15 lossless, 15 losing half their answers; with
    each cell's true verdict (0: none is right, +1 safe, −1 unsafe)."""
    drops = np.r_[(rng.random((100, most)) < THETA), np.zeros((15, most)), rng.random((15, most)) < 0.5].astype(float)
    return drops, np.r_[np.zeros(100), np.ones(15), -np.ones(15)]


def test_the_table_keeps_its_false_decision_rate_and_its_true_decisions():
    """130 cells (100 at the tolerance, 15 lossless, 15 losing 50 points), rounds of 6 after 6, planned share 0.2
    (30 of 130 cells can be decided rightly): stopping at 1/(α·0.2) = 100 and e-BH over the 2C tests at 2α keep
    ≥ 90% of the true decisions, with false ones (any decision on a cell at the tolerance counts as false) at most 5%
    of the printed ones on average over 40 tables. The rule it replaces (stop at 1/α, e-BH at α) keeps almost none,
    and the unadjusted per-cell decisions it printed are wrong far more often than 5%. A lossless cell needs 102
    samples under it (the max here is 120; the default's 96 could not reach 100)."""
    rng = np.random.default_rng(52)
    ends, stop_e = Rounds(6, 6, 120).ends, Rule(planned_share=0.2).stop_e
    false_share, kept_true, old_kept, own_false = [], [], [], []
    for _ in range(40):
        drops, truth = simulated_table(rng, 120)
        out = run_table(drops, ends, stop_e)
        kept = table_kept(out, 2)
        printed = out["decision"][kept]
        false_share.append(np.mean(printed != truth[kept]) if len(printed) else 0.0)
        kept_true.append(np.sum(kept & (out["decision"] == truth) & (truth != 0)) / np.sum(truth != 0))
        old = run_table(drops, ends, 1 / ALPHA)
        old_kept.append(table_kept(old, 1).sum() / np.sum(truth != 0))
        decided = old["decision"] != 0
        own_false.append(np.mean(old["decision"][decided] != truth[decided]))
    assert np.mean(false_share) <= ALPHA
    assert np.mean(kept_true) >= 0.9
    assert np.mean(old_kept) < 0.5 and np.mean(own_false) > ALPHA
    assert lossless_samples(5, stop_e) == 101  # read at 102 in rounds of 6


def test_the_default_stopping_level_costs_a_lossless_cell_a_round():
    """planned_share 0.8: a decided cell is fed until its e-value reaches 25; a lossless cell needs 70 samples
    instead of 66 (72 in rounds of 6)."""
    rule = Rule()
    assert rule.stop_e == pytest.approx(25)
    assert lossless_samples(rule.tolerance_points) == 66 and lossless_samples(rule.tolerance_points, rule.stop_e) == 70


def test_one_early_loss_is_decided_near_the_exact_binomial():
    """A lossless cell is decided safe at 66 samples, one with a single loss anywhere among its first 60 by 116
    (the exact binomial test at a fixed n needs 93; the stakes of the previous rule needed 181), one that loses
    every answer unsafe at 6."""
    assert sequence(np.zeros(100), -1.0, 1.0, THETA).down_at == 66
    one_loss = np.zeros((60, 200))
    one_loss[np.arange(60), np.arange(60)] = 1.0
    _, down = wealth_at(one_loss, -1.0, 1.0, THETA)
    assert first_true(down >= LEVEL).max() <= 116 and first_true(down >= LEVEL).min() > 66
    assert sequence(np.ones(30), -1.0, 1.0, THETA).up_at == 6


@pytest.mark.parametrize("loss", [THETA, 0.06])
def test_the_level_under_the_round_schedule(loss):
    """2,000 cells losing 5% (or 6%) of their answers, run as a default job (6, then rounds of 6, up to 96, stopped
    at the table's level): called safe in at most 5% of cells."""
    rng = np.random.default_rng(int(loss * 100))
    out = run_table((rng.random((2000, 96)) < loss).astype(float), Rounds(6, 6, 96).ends, Rule().stop_e)
    assert np.mean(out["decision"] == 1) <= ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / 2000)


def test_no_overflow_at_any_n():
    """5,000 samples that all lose, or all keep, and 5,000 KL samples above the cap: bounds, decisions and e-values
    (inf past the largest float, logs finite), no OverflowError."""
    lost, kept = drop_bounds(np.ones(5000), np.zeros(5000), 5), drop_bounds(np.ones(5000), np.ones(5000), 5)
    assert lost.decide(5) == "unsafe" and lost.e_unsafe == math.inf and math.isfinite(lost.log_e_unsafe)
    assert kept.decide(5) == "safe" and kept.log_e_safe > math.log(1e100) and math.isfinite(kept.e_safe)
    spiky = kl_bounds(np.full(5000, 1.0), 0.01)
    assert spiky.decide(0.01) == "unsafe" and spiky.over_cap == 5000 and math.isfinite(spiky.log_e_unsafe)
    assert ebh([spiky.log_e_unsafe, 0.0], log=True).tolist() == [True, False]


KL = 0.01  # nats: Rule.kl_safe
CAP = 5 * KL  # Rule.kl_cap_ratio × KL


def capped_lognormal(mean: float, sigma: float) -> float:
    """E[min(X, CAP)] for a lognormal X of mean `mean` and log-sd `sigma`."""
    mu = math.log(mean) - sigma**2 / 2
    z = (math.log(CAP) - mu) / sigma
    return mean * stats.norm.cdf(z - sigma) + CAP * stats.norm.sf(z)


def heavy(rng, cells: int, n: int, family: str) -> np.ndarray:
    """Heavy-tailed per-sample KL at the edge of what 'safe' claims: 'lognormal-S' (log-sd S, scaled so that its
    capped mean is exactly 0.01 nat), 'spike-V-P' (a share P of samples at V nat, the rest level so that the capped
    mean is exactly 0.01), 'tail' (3% of samples at 0.2 nat, the rest 0: a capped mean of 0.006, but a share above
    the cap exactly at its limit), 'mean-S' (lognormal whose plain mean is 0.01: below the edge, for power)."""
    if family.startswith(("lognormal", "mean")):
        kind, sigma = family.split("-")
        sigma = float(sigma)
        mean = KL if kind == "mean" else optimize.brentq(lambda m: capped_lognormal(m, sigma) - KL, KL, 100 * KL)
        return mean * np.exp(rng.normal(-sigma**2 / 2, sigma, (cells, n)))
    if family == "tail":
        return np.where(rng.random((cells, n)) < Rule().kl_tail_share, 0.2, 0.0)
    _, value, share = family.split("-")
    share = float(share)
    return np.where(rng.random((cells, n)) < share, float(value), (KL - share * CAP) / (1 - share))


PROSE = Rounds(10, 6, 150).ends  # prose_kl in the default: 10 samples, then rounds of 6, up to 150 (asserted below)


@pytest.mark.parametrize("family", ["lognormal-1.5", "lognormal-2", "spike-0.1-0.08", "spike-0.8-0.01",
                                    "spike-1.0-0.01", "spike-0.5-0.04", "tail"])
def test_heavy_tailed_kl_at_the_edge_is_rarely_safe_under_prose_rounds(family):
    """The audit's heavy tails (lognormal σ 1.5 and 2, spikes of 0.1–1.0 nat in 1–8% of samples) with the capped
    mean exactly at the threshold, and a tail share exactly at its limit, run as prose_kl's job: called safe in at
    most 5% of 2,000 cells, within simulation error. The plain mean of such KL can lie far above the capped one:
    the report's words say which it bounds (kvlab.stats.intervals.kl_bounds)."""
    rng = np.random.default_rng(sum(map(ord, family)))
    safe = np.mean(prose_job(heavy(rng, 2000, 150, family), Rule(), PROSE)[0] == 1)
    assert safe <= ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / 2000)


def test_prose_decisions_match_kl_bounds():
    """The vectorised prose job (kvlab.tools.kl_tail.prose_job) reads the same decisions as kl_bounds at the same n."""
    rng = np.random.default_rng(3)
    x = heavy(rng, 30, 150, "mean-1.0") * rng.choice([0.3, 1.0, 3.0], size=(30, 1))
    fast = prose_job(x, Rule(planned_share=1.0), np.array([150]))[0]
    slow = [{"safe": 1, "unsafe": -1, "inconclusive": 0}[kl_bounds(row, KL).decide(KL)] for row in x]
    assert fast.tolist() == slow and set(slow) == {-1, 0, 1}


@pytest.mark.parametrize("share,value", FAMILIES)
def test_ruined_documents_are_not_called_safe_under_the_default(share, value):
    """Issue 62's table: 3% or 5% of documents at 1 nat, 5% or 8% at 0.3 nat, the rest lognormal around 0.002 nat,
    run as the default's prose job (10, then rounds of 6, up to its max_samples): called safe in at most 5% of 2,000
    cells, within simulation error. Under the rule before (tail share 0.1, up to 96) the first row was called safe in
    two cells of three, the second in one of three: putting it back fails here."""
    rounds = Rounds.of(expand(yaml.safe_load(CONFIG.read_text()), SCHEMA, "default"))
    assert rounds == Rounds(10, 6, 150)
    assert safe_share(Rule(), rounds, share, value, 2000) <= ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / 2000)
    if value == 1.0:
        assert safe_share(*before(Rule(), rounds), share, value, 2000) > {0.03: 0.6, 0.05: 0.3}[share]


def test_what_the_strict_tail_costs():
    """A quiet cell (KL 0) is decided safe at 110 samples (quiet_kl_samples) and stops at 118 in the default's prose
    rounds (the first round's end where its e-value has reached the table's stopping level), within max_samples; a
    cell like 4-bit KIVI's (lognormal, mean 0.0074 nat, log-sd 0.5) is decided safe in at least 95% of cells by 150,
    at a median of 118 (64 under the rule before)."""
    rule, rounds = Rule(), Rounds(10, 6, 150)
    assert quiet_kl_samples(rule.kl_safe, rule.kl_cap_ratio, rule.kl_tail_share) == 110
    assert quiet(rule, rounds) == 118
    share, median = cost(rule, rounds, 0.5, 400)
    assert share >= 0.95 and median == 118
    assert quiet(*before(rule, rounds)) == 34


def answers_of(task: str, context: int, n: int, lost: bool, start: int = 0) -> list[dict]:
    """n samples of one job cell (kivi4 at one length of the single-needle shape), each answer lost or kept."""
    return [{"model": "m", "shape": "single needle", "task": task, "context_tokens": context, "question_mode": "aware",
             "method": "kivi4", "method_kind": "quant", "press": None, "wrapper": None, "scheme": "kivi", "bits": 4,
             "key_axis": "channel", "value_axis": "token", "policy": "kivi", "budget": 1.0, "turn": 1,
             "kv_fraction_bf16": 0.25, "sample_id": f"{task}@{context}-{i}", "draw": i, "round": 1 + i // 6,
             "max_samples": 96, "kl_vs_full": None, "full_score": 1.0, "score": 0.0 if lost else 1.0}
            for i in range(start, start + n)]


def test_a_pooled_cell_is_decided_on_its_jobs_not_printed_safe():
    """The audit's example: 66 lossless prompts at 8K, then 96 that all lose at 32K, one shape. Pooled in draw order
    the first job alone crossed 'safe' and the bound keeps it; judged per job cell and combined, the row is unsafe,
    and the length curve's cells keep each length's own decision."""
    rows = pd.DataFrame(answers_of("niah_single", 8192, 66, False) + answers_of("niah_single", 32000, 96, True))
    c = cells(rows, Rule(), by=["model", "shape", "question_mode"]).iloc[0]
    assert c["decision"] == "unsafe" and c["table_decision"] == "unsafe" and c["samples"] == 162
    assert "niah_single @ 8,192: safe; niah_single @ 32,000: unsafe" in c["jobs"]
    pooled = drop_bounds(np.ones(162), np.r_[np.ones(66), np.zeros(96)], 5)
    assert pooled.decide(5) == "safe"  # what pooling printed
    row = decision_table(rows).iloc[0]
    assert row["safe (most compression first)"] == "none" and row["unsafe at every budget"] == "kivi4"
    by_length = cells(rows, Rule(), by=["model", "shape", "question_mode", "context_tokens"]).set_index("context_tokens")
    assert by_length.loc[8192, "decision"] == "safe" and by_length.loc[32000, "decision"] == "unsafe"


def test_the_counts_quoted_in_the_docs_and_config_are_computed():
    """The sample counts the docs (docs/statistics.md, docs/configuration.md, the current rule's in docs/benchmarks.md)
    and config.yaml quote come from the functions that decide."""
    root = Path(__file__).resolve().parents[1]
    stats, config = (root / "docs" / "statistics.md").read_text(), (root / "config.yaml").read_text()
    configuration = (root / "docs" / "configuration.md").read_text()
    rule = Rule()
    lossless, stop = lossless_samples(rule.tolerance_points), lossless_samples(rule.tolerance_points, rule.stop_e)
    one_loss = np.zeros((60, 200))
    one_loss[np.arange(60), np.arange(60)] = 1.0
    worst = int(first_true(wealth_at(one_loss, -1.0, 1.0, THETA)[1] >= LEVEL).max())
    assert f"A cell that loses no answer needs {lossless} samples" in stats and f"at most {worst} (an exact" in stats
    assert f"A lossless cell then runs to {stop} samples" in stats
    assert f"a KL near 0 is decided safe after {quiet_kl_samples(rule.kl_safe)} samples" in stats
    benchmarks = " ".join((root / "docs" / "benchmarks.md").read_text().split())
    assert f"a cell that loses no answer is safe at {lossless} samples" in benchmarks
    assert f"A prose KL cell near 0 is decided at {quiet_kl_samples(rule.kl_safe)} samples" in benchmarks
    one_point = lossless_samples(1)
    assert f"since a cell that loses no answer needs {one_point}" in configuration and f"at n = {one_point}" in config
    assert f"a cell that loses no answer needs {one_point} samples" in stats
    full = yaml.safe_load(config)["presets"]["full"]["tasks"]["niah_single"]["max_samples"]
    assert full >= one_point
    assert f"decided safe at 5 points after {lossless} prompts" in config
    schema = (root / "workflow" / "config.schema.yaml").read_text()
    assert f"A lossless cell is decided safe at 5 points after {lossless} ({stop} to reach" in schema
