"""The study's claims C1–C17 in one table: what each says, the rule and thresholds that decide it, the queries
(queries.sql) whose rows it reads and its verdict function (kvlab.report.verdicts, article.c12).

The claims section lists every claim; the calibration, quantization and eviction sections list their own.
Statistical claims (C3–C8, C11, C12, C15–C17) are decided from one-sided 95% bounds (kvlab.stats.intervals): holds, does
not hold or inconclusive; C1, C2 (descriptive statistics of the calibration pass), C9, C13 and C14 (arithmetic:
the formula on the model geometry) and C10 (bytes counted) are not sampled and are decided on their numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Callable

import pandas as pd

from kvlab.report import article
from kvlab.report.decision import Rule
from kvlab.report.verdicts import calibration, cost, eviction, posthoc, prompt, quant


@dataclass(frozen=True)
class Claim:
    number: int
    title: str  # may name thresholds, e.g. {budget:.0%}
    queries: tuple[str, ...]
    judge: Callable[[dict, SimpleNamespace], list[tuple[str, str, str]]]
    rule: str = ""  # the rule as shown after the evidence, formatted with the thresholds and the decision rule
    thresholds: dict[str, float] = field(default_factory=dict)

    def verdicts(self, q: dict[str, pd.DataFrame], rule: Rule = Rule()) -> list[tuple[str, str, str]]:
        """(claim, verdict, evidence) per thing judged; the rule follows the evidence wherever it was applied."""
        t = SimpleNamespace(rule=rule, **asdict(rule), **self.thresholds)
        title, shown = self.title.format(**vars(t)), self.rule.format(**vars(t))
        return [(title + subject, verdict, evidence + (f" Rule: {shown}." if shown and verdict != "not measured" else ""))
                for subject, verdict, evidence in self.judge(q, t)]


FAIL_SHARE = {"fail_share": 0.5}  # "fails": at most this share of the full cache's accuracy on the same samples

CLAIMS = [
    Claim(1, "C1 (key channel outliers ≫ value)", ("calib_c1",), calibration.c1,
          "keys ≥ {factor:g}× values", {"factor": 2.0}),
    Claim(2, "C2 (massive activation and attention sink on token 0)", ("calib_c2",), calibration.c2,
          "≥ {massive:g}× and ≥ {mass:.0%} in some layer", {"massive": 10.0, "mass": 0.30}),
    Claim(3, "C3 FP8 KL ≈ 1e-3 nat", ("answers", "noise_floor"), quant.c3, "upper bound ≤ {kl:g} nat at every prefix", {"kl": 0.01}),
    Claim(4, "C4 2-bit: per-token keys collapse, per-channel hold", ("answers", "noise_floor"), quant.c4,
          "per channel upper bound ≤ {holds_kl:g}, per token lower bound ≥ {collapse_kl:g} nat",
          {"holds_kl": 0.2, "collapse_kl": 1.0}),
    Claim(5, "C5 INT4 within 1 point", ("answers",), quant.c5, "both bounds of the drop within ± {points:g} point",
          {"points": 1.0}),
    Claim(6, "C6 SnapKV {budget:.0%}: passes the needle question-aware, fails agnostic and on the second turn",
          ("answers",), eviction.c6,
          "aware: upper bound of the drop ≤ {tolerance_points:g} points; agnostic and second turn at most "
          "{fail_share:.0%} of full (lower bound of {fail_share:g}×full − accuracy ≥ 0)",
          {"budget": 0.25, **FAIL_SHARE}),
    Claim(7, "C7 H2O fails the needle", ("answers",), eviction.c7,
          "at most {fail_share:.0%} of full in every question mode (lower bound of {fail_share:g}×full − accuracy ≥ 0)", {"budget": 0.25, **FAIL_SHARE}),
    Claim(8, "C8 StreamingLLM fails outside its window and collapses without sinks", ("answers", "noise_floor"),
          eviction.c8, "outside at most {fail_share:.0%} of full; KL without sinks ≥ {collapse:g}× with sinks at every "
          "budget (lower bounds ≥ 0)",
          {"window_margin": 0.05, "collapse": 2.0, **FAIL_SHARE}),
    Claim(9, "C9 cost table exact", ("cost_article",), cost.c9),
    Claim(10, "C10 INT4 real compression ≈ 3.2×", ("quant_kl",), quant.c10, "{ratio:g} ± {slack:g}",
          {"ratio": 3.2, "slack": 0.1}),
    Claim(11, "C11 PyramidKV ≥ SnapKV at equal total budget", ("answers",), eviction.c11,
          "upper bound of SnapKV − PyramidKV ≤ {tolerance_points:g} points at every budget"),
    Claim(12, "C12 the decision table, regenerated from this run", ("answers",), article.c12),
    Claim(13, "C13 NSA: 64K decode reads ≈ 11× fewer KV bytes", ("cost_reads",), cost.c13,
          "{ratio:g} ± {slack:g} at {context:,} tokens (the article's ≈: one unit in its last digit)",
          {"ratio": 11.0, "slack": 1.0, "context": 65536}),
    Claim(14, "C14 Llama-3-70B: KV reads exceed weight reads from ≈ 40K context", ("cost_crossover",), cost.c14,
          "some weight × KV format's crossover at one sequence within ± {tolerance:.0%} of {context:,} tokens "
          "(the article's 40K, 40 × 1024)", {"context": 40960, "tolerance": 0.25}),
    Claim(15, "C15 block-sparse reads are exact only when trained for: MoBA/Quest reading {budget:.0%} post hoc are not",
          ("answers", "noise_floor"), posthoc.c15, "lower bound of the mean per-token KL ≥ {kl:g} nat for every selector",
          {"budget": 0.25, "kl": 0.01}),
    Claim(16, "C16 cross-layer sharing is a training-time decision: CLA post hoc (half the bytes) is not exact",
          ("answers", "noise_floor"), posthoc.c16, "lower bound of the mean per-token KL ≥ {kl:g} nat for every method",
          {"kl": 0.01}),
    Claim(17, "C17 prompt compression to {budget:.0%} of the text loses the needle's detail", ("answers",), prompt.c17,
          "lower bound of the drop vs full > {tolerance_points:g} points (single needle, question modes pooled)",
          {"budget": 0.5}),
]
BY_NUMBER = {c.number: c for c in CLAIMS}


def verdicts(numbers: list[int], q: dict[str, pd.DataFrame], rule: Rule = Rule()) -> list[tuple[str, str, str]]:
    """(claim, verdict, evidence) for the given claims, in the given order."""
    return [v for n in numbers for v in BY_NUMBER[n].verdicts(q, rule)]


def claims_frame(q: dict[str, pd.DataFrame], rule: Rule = Rule()) -> pd.DataFrame:
    """Every claim's verdict, C1 to C14 in order, with the queries behind it."""
    rows = [(*v, ", ".join(c.queries)) for c in CLAIMS for v in c.verdicts(q, rule)]
    return pd.DataFrame(rows, columns=["claim", "verdict", "evidence", "query"])
