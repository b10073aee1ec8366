"""What a prose "safe" lets through: per-sample KL with a share of ruined documents, run as the prose_kl job runs
(its first samples, then rounds, up to its max_samples, each cell stopped at the table's stopping level) and decided
by kl_bounds' rule (kvlab.stats.intervals). Vectorised over cells (kvlab.stats.anytime.wealth_at): seconds.

    python -m kvlab.tools.kl_tail [--config config.yaml] [--preset NAME] [--cells 2000]

prints, for the config's decision rule and prose_kl's rounds, the share of cells called safe for each family of
issue 62's table (a share of documents at a high KL, the rest lognormal around 0.002 nat), the same under the rule
before (kl_tail_share 0.1, prose_kl up to 96 samples), and the samples a quiet cell (KL 0) and a cell like 4-bit
KIVI's need. tests/test_verdicts.py holds the rates; docs/statistics.md quotes the table.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.report.decision import Rule
from kvlab.stats.anytime import ALPHA, wealth_at
from kvlab.tools.progress import load_rule

LEVEL = math.log(1 / ALPHA)
BASE_KL = 0.002  # nats: the mean per-sample KL of the documents a method leaves alone (lognormal, log-sd 1)
FAMILIES = [(0.03, 1.0), (0.05, 1.0), (0.05, 0.3), (0.08, 0.3)]  # (share of documents hit, their KL in nats)
KIVI4_MEAN = 0.0074  # nats: 4-bit KIVI's plain mean on prose, Qwen2.5-0.5B (0.74 × the threshold: docs/statistics.md)
OLD = {"kl_tail_share": 0.1, "max_samples": 96}  # the rule before issue 62


@dataclass(frozen=True)
class Rounds:
    """When a prose job reads its cells: `first` samples, then every `step`, up to `most`."""

    first: int
    step: int
    most: int

    @property
    def ends(self) -> np.ndarray:
        return np.unique(np.r_[np.arange(self.first, self.most, self.step), self.most])

    @classmethod
    def of(cls, config: dict) -> Rounds:
        """prose_kl's rounds in a resolved config: the task's samples, sequential.round, its own or the run's
        max_samples."""
        task = config["tasks"]["prose_kl"]
        most = task.get("max_samples", config["sequential"]["max_samples"])
        return cls(int(task["samples"]), int(config["sequential"]["round"]), int(most))


def first_true(crossed: np.ndarray) -> np.ndarray:
    """Per row, the first column index (1-based) where `crossed` holds; 0 where it never does."""
    return np.where(crossed.any(axis=1), crossed.argmax(axis=1) + 1, 0)


def prose_job(x: np.ndarray, rule: Rule, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of per-sample KL (cells × samples, draw order) run as a prose job: read at `ends`, its decision the
    first crossing of 1/α (safe: the capped mean's and the tail share's upper bounds both under their limits, at the
    later of the two crossings; unsafe: the capped mean's lower bound at the threshold), stopped at the first read
    where it is decided and its decision's e-value reaches rule.stop_e. Returns the decisions (+1 safe, −1 unsafe,
    0 open) and the samples each cell used, as kl_bounds decides at the same n."""
    cap = rule.kl_cap_ratio * rule.kl_safe
    up, down = wealth_at(np.minimum(x, cap), 0.0, cap, rule.kl_safe)
    _, tail = wealth_at((x > cap).astype(float), 0.0, 1.0, rule.kl_tail_share)
    mean_at, tail_at = first_true(down >= LEVEL), first_true(tail >= LEVEL)
    safe_at = np.where((mean_at > 0) & (tail_at > 0), np.maximum(mean_at, tail_at), 0)
    unsafe_at = first_true(up >= LEVEL)
    decision = np.zeros(len(x), int)
    used = np.full(len(x), ends[-1])
    done = np.zeros(len(x), bool)
    for n in ends:
        safe = (safe_at > 0) & (safe_at <= n)
        unsafe = (unsafe_at > 0) & (unsafe_at <= n) & ~safe
        decision = np.where(done, decision, np.where(safe, 1, np.where(unsafe, -1, 0)))
        log_e = np.where(safe, np.minimum(down[:, n - 1], tail[:, n - 1]), np.where(unsafe, up[:, n - 1], -np.inf))
        stop = ~done & (log_e >= math.log(rule.stop_e))
        used = np.where(stop, n, used)
        done |= stop
    return decision, used


def ruined(rng: np.random.Generator, cells: int, n: int, share: float, value: float) -> np.ndarray:
    """Per-sample KL of `cells` cells: each document hit with chance `share` (its KL `value` nats), the others
    lognormal of mean BASE_KL and log-sd 1."""
    base = BASE_KL * np.exp(rng.normal(-0.5, 1.0, (cells, n)))
    return np.where(rng.random((cells, n)) < share, value, base)


def like_kivi4(rng: np.random.Generator, cells: int, n: int, sigma: float) -> np.ndarray:
    """Per-sample KL like 4-bit KIVI's on prose: lognormal of mean KIVI4_MEAN and log-sd `sigma`."""
    return KIVI4_MEAN * np.exp(rng.normal(-sigma**2 / 2, sigma, (cells, n)))


def safe_share(rule: Rule, rounds: Rounds, share: float, value: float, cells: int) -> float:
    """The share of `cells` simulated cells of one family that the prose job calls safe (seeded by the family)."""
    rng = np.random.default_rng(int(share * 1000) + int(value * 100))
    decision, _ = prose_job(ruined(rng, cells, rounds.most, share, value), rule, rounds.ends)
    return float(np.mean(decision == 1))


def cost(rule: Rule, rounds: Rounds, sigma: float, cells: int) -> tuple[float, float]:
    """For cells like 4-bit KIVI's at log-sd `sigma`: the share decided safe within the rounds and their median n."""
    decision, used = prose_job(like_kivi4(np.random.default_rng(7), cells, rounds.most, sigma), rule, rounds.ends)
    safe = decision == 1
    return float(safe.mean()), float(np.median(used[safe])) if safe.any() else math.nan


def quiet(rule: Rule, rounds: Rounds) -> float:
    """The samples a cell whose KL stays 0 uses before it is decided safe and stopped (nan: not within the rounds)."""
    decision, used = prose_job(np.zeros((1, rounds.most)), rule, rounds.ends)
    return float(used[0]) if decision[0] == 1 else math.nan


def before(rule: Rule, rounds: Rounds) -> tuple[Rule, Rounds]:
    """`rule` and `rounds` as they were before issue 62 (OLD)."""
    return replace(rule, kl_tail_share=OLD["kl_tail_share"]), replace(rounds, most=OLD["max_samples"])


def table(rule: Rule, rounds: Rounds, cells: int) -> pd.DataFrame:
    """Issue 62's table under `rule` and `rounds`, beside the rule before (OLD)."""
    old_rule, old_rounds = before(rule, rounds)
    rows = []
    for share, value in FAMILIES:
        plain = share * value + (1 - share) * BASE_KL
        rows.append({"documents hit": f"{share:.0%}", "their KL (nat)": value, "plain mean KL (nat)": round(plain, 3),
                     f"safe, now (≤ {rounds.most})": safe_share(rule, rounds, share, value, cells),
                     f"safe, before (≤ {old_rounds.most})": safe_share(old_rule, old_rounds, share, value, cells)})
    return pd.DataFrame(rows)


def markdown(t: pd.DataFrame) -> str:
    """A table as Markdown, shares as percentages (docs/statistics.md quotes it so)."""
    def cell(c, v):
        return f"{v:.1%}" if c.startswith("safe") else f"{v:g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(c, r[c]) for c in t.columns) + " |" for _, r in t.iterrows()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.tools.kl_tail", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="config.yaml", help="the config whose decision rule and prose_kl rounds run")
    parser.add_argument("--preset", default=None, help="the preset whose prose_kl rounds run (default: the config's)")
    parser.add_argument("--cells", type=int, default=2000, help="simulated cells per family")
    args = parser.parse_args(argv)
    config, rule = load_rule(Path(args.config), args.preset)
    rounds = Rounds.of(config)
    print(f"rule: cap {rule.kl_cap_ratio:g} × {rule.kl_safe:g} nat, tail share ≤ {rule.kl_tail_share:g}; prose_kl: "
          f"{rounds.first}, then rounds of {rounds.step}, up to {rounds.most}; {args.cells} cells per family")
    print(markdown(table(rule, rounds, args.cells)))
    old_rule, old_rounds = before(rule, rounds)
    print(f"quiet cell (KL 0): safe after {quiet(rule, rounds):g} samples (before: {quiet(old_rule, old_rounds):g})")
    for sigma in (0.5, 1.0):
        now, then = cost(rule, rounds, sigma, 400), cost(old_rule, old_rounds, sigma, 400)
        print(f"a cell like KIVI-4's (lognormal, mean {KIVI4_MEAN} nat, log-sd {sigma:g}): safe in {now[0]:.0%} of 400 "
              f"cells by {rounds.most}, median n {now[1]:g} (before: {then[0]:.0%} by {old_rounds.most}, median {then[1]:g})")


if __name__ == "__main__":
    main()
