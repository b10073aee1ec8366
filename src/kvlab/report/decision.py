"""The article's decision table (§7.2), regenerated from this run's rows (its comparison with the article:
kvlab.report.article).

Input is the `answers` query: every compressed method's answers beside the full cache's on the same prompts,
or, for prose, each sample's per-token KL; and the bytes the method stored as a fraction of the full cache in
bf16. The tested unit is a **job cell**: one method at one budget and question mode in one evaluation job (a task
at one context length), the stream of samples that job stopped on. `judge` decides a job cell with the `Rule`
from its anytime bounds (kvlab.stats.intervals): safe, unsafe or inconclusive, each at 5% error. A printed cell that
spans several jobs (a task shape at several lengths) is combined, never pooled: safe when every judged job cell is
safe (an intersection of tests: still 5%), unsafe when any is (a union: up to 5% per job cell it spans), else
inconclusive; its bounds are those of the job cell that binds.

Two guarantees, two decisions per cell:
- `decision`: each job cell's own test, at 5% error however its job stopped;
- `table_decision`: that decision where e-BH (Wang & Ramdas 2022) over every job cell of the table keeps it, so
  that the expected share of wrong decisions among all kept ones is at most 5% (`annotate`). The decision table,
  the grid and the summary print this one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.stats.anytime import ALPHA, ebh
from kvlab.stats.intervals import TAIL_SHARE, drop_bounds, kl_bounds, per_sample, wilson


@dataclass(frozen=True)
class Rule:
    """When a compressed method is safe, and the compression the article asks for."""

    tolerance_points: float = 5.0  # config.yaml `decision.tolerance_points` (this default is the schema's)
    kl_safe: float = 0.01  # config.yaml `decision.kl_safe`: on prose, the capped mean per-token KL at most this (nats)
    kl_cap_ratio: float = 5.0  # `decision.kl_cap_ratio`: each sample's KL capped at this × a KL threshold
    kl_tail_share: float = TAIL_SHARE  # `decision.kl_tail_share`: the largest share of samples above the cap
    planned_share: float = 0.8  # `decision.planned_share`: the share of the table's cells a run plans to decide
    kl_min_samples: int = 10  # the tables' descriptive KL bounds (bootstrap) stay blank under this many samples
    target: float = 4.0  # the article's question: 40 GB → 10 GB, i.e. at least 4× fewer bytes than bf16

    def kl_bounds(self, values, threshold: float | None = None):
        """kl_bounds of per-sample KL (draw order) under this rule: its cap ratio and tail share, at `threshold`
        (default kl_safe; a claim's own KL threshold otherwise). Every prose verdict is read through this one call."""
        return kl_bounds(values, self.kl_safe if threshold is None else threshold, self.kl_cap_ratio, self.kl_tail_share)

    @property
    def stop_e(self) -> float:
        """The e-value at which a job stops feeding a decided cell: 1/(α · planned share). If at least that share of
        the table's cells reach it, e-BH keeps every one (its threshold at k kept of C cells is C/(αk))."""
        return 1 / (ALPHA * self.planned_share)


NO_REFERENCE = "not judged (the full cache scores 0%)"
FLIP_EPS = 1e-9  # a score this close to the full cache's is the same score (means of turns differ in the last bits)
DESCRIBE = ["method_kind", "press", "wrapper", "scheme", "bits", "key_axis", "value_axis", "policy"]


def judge(rows: pd.DataFrame, rule: Rule) -> dict:
    """One job cell's numbers and decision: accuracy with its Wilson interval over the answers, the drop vs the full
    cache with its betting bounds over samples in draw order (valid however the job stopped: kvlab.stats.anytime), or on
    prose the mean per-sample KL with the betting bounds of its capped mean (kvlab.stats.intervals.kl_bounds; each
    sample capped at `kl_cap` = kl_cap_ratio × kl_safe nats; `kl_over_cap`: samples above it, `kl_tail_high`: the
    upper bound of their share); `sample_sd`, the
    per-sample spread; the sample at which it was decided (`decided_at`, in draw order) and that sample's evaluation
    round, the e-values of its safe and unsafe tests and `cap` (the samples its jobs could reach); `n_to_decide`
    for an inconclusive cell (kvlab.stats.intervals).

    Flips (scored answers only): `losses`, the samples on which the method scores below the full cache (right →
    wrong), and `gains`, those on which it scores above it (wrong → right), each out of `samples` (a sample's turns
    averaged first, as the bounds read them). With partial scores (token F1) any lower score is a loss and any
    higher one a gain, however small; a drop near 0 can hide many of both (Dutta et al. 2024)."""
    out = {c: rows[c].iloc[0] for c in DESCRIBE if c in rows}
    if "kv_fraction_bf16" in rows:
        out["kv_fraction_bf16"] = rows["kv_fraction_bf16"].mean()
    out["answers"], out["samples"] = len(rows), rows["sample_id"].nunique()
    rounds = ["round"] if "round" in rows else []
    if "kl_vs_full" in rows and rows["kl_vs_full"].notna().all():
        s, threshold = per_sample(rows, ["kl_vs_full", *rounds]), rule.kl_safe
        b = rule.kl_bounds(s["kl_vs_full"].to_numpy(), threshold)
        out.update(kl_mean_nats=b.mean, kl_low=b.low, kl_high=b.high, kl_over_cap=b.over_cap,
                   kl_tail_high=b.tail_high, kl_cap=rule.kl_cap_ratio * threshold, decision=b.decide(threshold))
    else:
        s = per_sample(rows, ["score", "full_score", *rounds])
        threshold = rule.tolerance_points
        b = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), threshold)
        acc_low, acc_high = wilson(rows["score"].sum(), len(rows))
        full_low, full_high = wilson(rows["full_score"].sum(), len(rows))
        full = rows["full_score"].mean()
        change = (s["score"] - s["full_score"]).to_numpy()  # a sample's turns averaged: float noise is no flip
        out.update(losses=int((change < -FLIP_EPS).sum()), gains=int((change > FLIP_EPS).sum()))
        out.update(accuracy=rows["score"].mean(), accuracy_low=acc_low, accuracy_high=acc_high, full_accuracy=full,
                   full_low=full_low, full_high=full_high, drop_points=b.mean, drop_low=b.low, drop_high=b.high,
                   decision=b.decide(threshold) if full > 0 else NO_REFERENCE)
    out.update(decided_at=b.decided_at or math.nan, log_e_safe=b.log_e_safe, log_e_unsafe=b.log_e_unsafe,
               e_safe=b.e_safe, e_unsafe=b.e_unsafe,
               decided_round=s["round"].iloc[b.decided_at - 1] if b.decided_at and rounds else math.nan, cap=_cap(rows))
    out["sample_sd"] = b.sd  # the per-sample spread the bounds come from (points of drop, or nats of KL)
    out["n_to_decide"] = b.n_to_decide(threshold) if out["decision"] == "inconclusive" else math.nan
    return out


def _cap(rows: pd.DataFrame) -> float:
    """The most samples the cell could have had: the sum over its jobs (task × context length) of their max_samples
    (nan for rows written before rounds existed)."""
    if "max_samples" not in rows or rows["max_samples"].isna().any():
        return math.nan
    return float(rows.groupby(["task", "context_tokens"])["max_samples"].max().sum())


JOB = ["task", "context_tokens"]  # one evaluation job: the stream of samples its cells stopped on
# What `judge` reads of a cell's rows; two cells equal on these (in order) have the same judgement.
JUDGE_READS = [*DESCRIBE, "kv_fraction_bf16", "sample_id", "round", "kl_vs_full", "score", "full_score", "task",
               "context_tokens", "max_samples", "draw"]
_judged: dict[tuple, dict] = {}  # judge's results by (rule, the cell's rows): the report's sections judge the same
# cells under different groupings (about 60 times per report), and one judgement costs milliseconds
DECIDED = ("safe", "unsafe", "inconclusive")  # a judged cell's decisions (the rest: not judged)


def job_cells(rows: pd.DataFrame, rule: Rule, by: list[str]) -> pd.DataFrame:
    """`judge` per (by…, method, budget, task, context length), in the rows' order; each distinct job cell is judged
    once per process."""
    keys = [*by, "method", "budget", *[k for k in JOB if k not in by]]
    rows = rows.reset_index(drop=True)
    read = rows[[c for c in JUDGE_READS if c in rows]]
    row_hash = pd.util.hash_pandas_object(read, index=False).to_numpy()  # one vectorised pass; a cell's key hashes its rows'
    out = []
    for key, g in rows.groupby(keys, sort=False, dropna=False):
        cell = (rule, tuple(read.columns), hashlib.sha1(row_hash[g.index.to_numpy()].tobytes()).hexdigest())
        if cell not in _judged:
            if len(_judged) > 100_000:
                _judged.clear()
            _judged[cell] = judge(g, rule)
        kept = {k: bool(g[k].iloc[0]) for k in ("ebh_safe", "ebh_unsafe") if k in g}
        out.append({**dict(zip(keys, key)), **_judged[cell], **kept})
    return pd.DataFrame(out)


TABLE = ["model", "shape", "question_mode"]  # with method, budget and JOB: a job cell of the table


def kept(jc: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Which job cells' safe and unsafe decisions e-BH keeps over the table `jc` (job cells, as job_cells gives
    them). The C judged cells carry two tests each whose nulls split the line (drop ≥ θ: 'safe' is wrong; drop < θ:
    'unsafe' is wrong), so exactly C of the 2C nulls are true and e-BH at 2α over the 2C log e-values keeps the
    expected share of wrong decisions among the kept at most α: a test is kept at k kept ones when its e-value
    reaches C/(αk)."""
    judged = np.tile(jc["decision"].isin(DECIDED).to_numpy(), 2)  # the tests of judged cells: safe ones, then unsafe
    log_e = np.r_[jc["log_e_safe"].to_numpy(float), jc["log_e_unsafe"].to_numpy(float)]
    keep = np.zeros(2 * len(jc), bool)
    keep[judged] = ebh(np.where(np.isnan(log_e), -np.inf, log_e)[judged], 2 * ALPHA, log=True)
    safe, unsafe = keep[: len(jc)], keep[len(jc):]
    return safe & (jc["decision"] == "safe").to_numpy(), unsafe & (jc["decision"] == "unsafe").to_numpy()


def annotate(answers: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """The answers with `ebh_safe` and `ebh_unsafe`: whether e-BH over the whole table (every job cell of these
    rows) keeps the row's job cell's safe or unsafe decision. The report annotates its answers once, so that every
    section, whatever rows it picks, prints the table's decision."""
    if answers.empty:
        return answers.assign(ebh_safe=pd.Series(dtype=bool), ebh_unsafe=pd.Series(dtype=bool))
    plain = answers.drop(columns=["ebh_safe", "ebh_unsafe"], errors="ignore")
    table = [k for k in TABLE if k in plain]
    jc = job_cells(plain, rule, by=table)
    jc["ebh_safe"], jc["ebh_unsafe"] = kept(jc)
    keys = [*table, "method", "budget", *JOB]
    flags = jc[[*keys, "ebh_safe", "ebh_unsafe"]]
    out = plain.merge(flags, on=keys, how="left", validate="m:1")
    return out.fillna({"ebh_safe": False, "ebh_unsafe": False}).astype({"ebh_safe": bool, "ebh_unsafe": bool})


def combine(decisions) -> str:
    """A printed cell's decision from its job cells': 'not judged' when none is judged; else 'unsafe' when any
    judged one is unsafe, 'safe' when all are safe, else 'inconclusive'."""
    judged = [d for d in decisions if d in DECIDED]
    if not judged:
        return next(iter(decisions), NO_REFERENCE)
    return "unsafe" if "unsafe" in judged else "safe" if all(d == "safe" for d in judged) else "inconclusive"


def _binding(g: pd.DataFrame, decision: str) -> pd.Series:
    """The job cell whose numbers a combined cell shows: for 'unsafe' the unsafe one with the highest lower bound,
    else the judged one with the highest upper bound (the one closest to failing)."""
    low, high = ("drop_low", "drop_high") if "drop_high" in g and g["drop_high"].notna().any() else ("kl_low", "kl_high")
    pick = g[g["decision"] == "unsafe"] if decision == "unsafe" else g[g["decision"].isin(DECIDED)]
    pick = pick if len(pick) else g
    return pick.loc[(pick[low] if decision == "unsafe" else pick[high]).astype(float).fillna(-np.inf).idxmax()]


def cells(rows: pd.DataFrame, rule: Rule, by: list[str]) -> pd.DataFrame:
    """One printed cell per (by…, method, budget), in the rows' order: its job cells (kvlab's tested units) judged
    and combined (`combine`); `table_decision`, the decision e-BH keeps over the table (rows without `annotate`'s
    flags are taken to be the whole table); `jobs`, each job cell's own decision. A cell of one job cell is that
    job cell's judgement."""
    if "ebh_safe" not in rows:
        rows = annotate(rows, rule)
    jc = job_cells(rows, rule, by)
    jc["table_decision"] = np.where((jc["decision"] == "safe") & jc["ebh_safe"].astype(bool), "safe",
                                    np.where((jc["decision"] == "unsafe") & jc["ebh_unsafe"].astype(bool), "unsafe",
                                             np.where(jc["decision"].isin(DECIDED), "inconclusive", jc["decision"])))
    keys = [*by, "method", "budget"]
    out = []
    for key, g in jc.groupby(keys, sort=False, dropna=False):
        if len(g) == 1:
            r = g.iloc[0].to_dict()
        else:
            decision = combine(list(g["decision"]))
            r = _binding(g, decision).to_dict()
            r.update(decision=decision, table_decision=combine(list(g["table_decision"])),
                     answers=int(g["answers"].sum()), samples=int(g["samples"].sum()), cap=g["cap"].sum(min_count=len(g)),
                     **{k: g[k].sum(min_count=1) for k in ("losses", "gains", "kl_over_cap") if k in g},  # flips, tails of all its job cells
                     **({"kl_tail_high": g["kl_tail_high"].max()} if "kl_tail_high" in g else {}),
                     n_to_decide=math.nan if decision != "inconclusive" else r["n_to_decide"])
        r["jobs"] = "; ".join(f"{j['task']} @ {j['context_tokens']:,}: {j['decision']}" for _, j in g.iterrows())
        r.update(dict(zip(keys, key)))
        out.append({k: v for k, v in r.items() if k in by or k not in JOB})
    return pd.DataFrame(out)


def is_kl(r) -> bool:
    """Whether a judged cell is a prose (KL) cell."""
    return "kl_mean_nats" in r and not pd.isna(r["kl_mean_nats"])


def tail(r) -> str:
    """A KL cell's tail in words: '2 of 96 documents above 0.05 nat (share ≤ 8.7%)' (its samples above the cap and the
    one-sided 95% upper bound of their share); '' for a cell of answers."""
    if not is_kl(r):
        return ""
    return (f"{r['kl_over_cap']:.0f} of {r['samples']} documents above {r['kl_cap']:g} nat "
            f"(share ≤ {r['kl_tail_high']:.1%})")


def shown(r, decision: str | None = None) -> str:
    """A decision as printed beside its cell (`decision`, default the cell's table_decision): a KL cell decided safe
    that has any sample above its cap never reads plain 'safe' but 'safe on average; 2 of 96 documents above 0.05 nat
    (share ≤ 8.7%)': its capped mean and tail share are bounded, yet some documents came out changed."""
    decision = r.get("table_decision", r["decision"]) if decision is None else decision
    return f"{ON_AVERAGE}; {tail(r)}" if decision == "safe" and over_cap(r) else decision


ON_AVERAGE = "safe on average"  # a safe KL cell with documents above its cap (`shown`)


def over_cap(r) -> bool:
    """Whether a cell is a KL cell with any sample above its cap."""
    return is_kl(r) and r["kl_over_cap"] > 0


def evidence(r) -> str:
    """A cell's numbers in one phrase: n, the interval, its flips (samples lost and gained against the full cache)
    or, on prose, its tail (documents above the cap), and for an inconclusive cell the n that would decide it."""
    if is_kl(r):
        text = (f"KL {r['kl_mean_nats']:.3g} nat, capped mean bounds [{r['kl_low']:.3g}, {r['kl_high']:.3g}], "
                f"{tail(r)}, n={r['samples']}")
    else:
        text = (f"{r['accuracy']:.0%} [{r['accuracy_low']:.0%}, {r['accuracy_high']:.0%}] vs full {r['full_accuracy']:.0%} "
                f"[{r['full_low']:.0%}, {r['full_high']:.0%}], drop {r['drop_points']:+.1f} pts, "
                f"bounds [{r['drop_low']:+.1f}, {r['drop_high']:+.1f}], n={r['samples']}")
    if r["decision"] == "inconclusive":
        text += "; " + why_open(r)
    elif r.get("table_decision") == "inconclusive":
        text += f"; {r['decision']} for this cell alone, not kept by e-BH across the table"
    text += flips(r)
    if str(r.get("jobs", "")).count(";"):
        text += f" (job cells: {r['jobs']})"
    return text


def flips(r) -> str:
    """'; flips: 3 of 70 samples lost, 1 gained' (right → wrong, wrong → right against the full cache; with partial
    scores a lower or higher score), or '' where the cell has no flips (prose, or rows judged before they were
    counted)."""
    losses, gains = r.get("losses", math.nan), r.get("gains", math.nan)
    if pd.isna(losses) or pd.isna(gains):
        return ""
    return f"; flips: {losses:.0f} of {r['samples']} samples lost, {gains:.0f} gained"


def why_open(r) -> str:
    """Why an inconclusive cell is open: it reached its jobs' max_samples, or about how many more samples like its
    own would decide it (kvlab.stats.anytime: the best constant stake's growth, so a low estimate), or none would."""
    n, cap = r["n_to_decide"], r.get("cap", math.nan)
    if isinstance(cap, float) and math.isfinite(cap) and r["samples"] >= cap:
        return f"reached max_samples ({cap:,.0f})"
    if n == math.inf:
        return "no n decides it (its mean sits on the threshold)"
    if not math.isfinite(n):
        return "the n to decide needs a second sample"
    return f"needs about {max(n - r['samples'], 1):,.0f} more samples"


def _label(r) -> str:
    budget = f"@{r.budget:g}" if r.budget < 1 else ""
    return f"{r.method}{budget} ({1 / r.kv_fraction_bf16:.1f}×)"


def _safe_label(r) -> str:
    """A safe cell in the decision table: its label, and on prose its tail beside it (every KL cell shows how many
    documents went above the cap, and a cell with any reads 'safe on average')."""
    d = r._asdict()
    if not is_kl(d):
        return _label(r)
    return f"{_label(r)} [{shown(d, 'safe') if over_cap(d) else tail(d)}]"


def measured_on(rows: pd.DataFrame) -> str:
    """Which tasks at which context lengths rows come from, with their distinct prompts: 'niah_single @ 1,024 (12)'."""
    parts = [f"{task} @ {ctx:,} ({g['sample_id'].nunique()})"
             for (task, ctx), g in rows.groupby(["task", "context_tokens"], sort=True)]
    return ", ".join(parts)


def decision_table(rows: pd.DataFrame, rule: Rule = Rule()) -> pd.DataFrame:
    """One row per (model, shape, question mode), on the table's decisions (`table_decision`: kept by e-BH): the
    tasks and context lengths it was measured on, the methods decided safe, most compression first (each at its most
    compressed safe budget), the best compression reached, those safe at the target, those inconclusive at the
    target (each at its most compressed undecided budget, with n, bounds and the n to decide) and the methods unsafe
    at every budget."""
    columns = ["model", "shape", "question mode", "measured on", "full cache", "safe (most compression first)", "best safe compression",
               f"safe at ≥ {rule.target:g}×", f"inconclusive at ≥ {rule.target:g}×", "unsafe at every budget"]
    out = []
    for (model, shape, mode), g in rows.groupby(["model", "shape", "question_mode"], sort=True):
        c = cells(g, rule, by=[])
        prose = "accuracy" not in c
        if prose:
            full = "KL reference"
        else:
            answers = g.drop_duplicates(["sample_id", "question_mode", "turn"])  # the full cache's, once each
            low, high = wilson(answers["full_score"].sum(), len(answers))
            full = f"{answers['full_score'].mean():.0%} [{low:.0%}, {high:.0%}], n={answers['sample_id'].nunique()}"
            if (c["full_accuracy"] == 0).all():
                out.append([model, shape, mode, measured_on(g), full, "— (the full cache scores 0%: nothing to lose)", "", "",
                            "", ""])
                continue
        best = c[c["table_decision"] == "safe"].sort_values("kv_fraction_bf16").groupby("method", sort=False).head(1)
        best = best.sort_values(["kv_fraction_bf16", "method"])
        reach = best[1 / best["kv_fraction_bf16"] >= rule.target - 1e-9]
        open_ = c[(c["table_decision"] == "inconclusive") & (1 / c["kv_fraction_bf16"] >= rule.target - 1e-9)
                  & ~c["method"].isin(reach["method"])]
        open_ = open_.sort_values(["kv_fraction_bf16", "method"]).groupby("method", sort=False).head(1)
        unsafe = sorted(m for m, d in c.groupby("method")["table_decision"] if (d == "unsafe").all())
        out.append([
            model, shape, mode, measured_on(g), full,
            ", ".join(_safe_label(r) for r in best.itertuples()) or "none",
            f"{1 / best['kv_fraction_bf16'].min():.1f}×" if len(best) else "",
            ", ".join(_safe_label(r) for r in reach.itertuples()) or "none",
            "; ".join(f"{_label(r)}: {evidence(r._asdict())}" for r in open_.itertuples()) or "none",
            ", ".join(unsafe),
        ])
    return pd.DataFrame(out, columns=columns)


OUTCOMES = ("safe", "unsafe", "inconclusive", "not judged")  # a method's outcome on one row of the decision table


def outcomes(rows: pd.DataFrame, rule: Rule = Rule()) -> pd.DataFrame:
    """One row per (model, shape, question mode, method), with the decision table's verdict on the method (the
    table's decisions, `table_decision`):
    'safe' at its most compressed safe budget, 'unsafe' at every budget (shown at its least compressed one),
    'inconclusive' otherwise (at its most compressed undecided budget), 'not judged' where the full cache scores
    0% (at its least compressed budget); with that budget, the compression it reached (bf16 bytes of the full cache over the method's) and n;
    on prose its samples above the KL cap (`over_cap`, nan for answers), its `tail` in words and the outcome as
    printed (`shown`: 'safe on average; …' for a safe KL cell with documents above the cap)."""
    out = []
    c = cells(rows, rule, by=["model", "shape", "question_mode"])
    for key, g in c.groupby(["model", "shape", "question_mode", "method"], sort=True):
        safe, open_ = g[g["table_decision"] == "safe"], g[g["table_decision"] == "inconclusive"]
        if len(safe):
            outcome, pick = "safe", safe.loc[safe["kv_fraction_bf16"].idxmin()]
        elif (g["table_decision"] == "unsafe").all():
            outcome, pick = "unsafe", g.loc[g["kv_fraction_bf16"].idxmax()]
        elif len(open_):
            outcome, pick = "inconclusive", open_.loc[open_["kv_fraction_bf16"].idxmin()]
        else:
            outcome, pick = "not judged", g.loc[g["kv_fraction_bf16"].idxmax()]
        out.append({**dict(zip(["model", "shape", "question_mode", "method"], key)), "outcome": outcome,
                    "budget": pick["budget"], "compression": 1 / pick["kv_fraction_bf16"], "samples": pick["samples"],
                    "over_cap": pick["kl_over_cap"] if is_kl(pick) else math.nan, "tail": tail(pick),
                    "shown": shown(pick, outcome)})
    return pd.DataFrame(out, columns=["model", "shape", "question_mode", "method", "outcome", "budget", "compression",
                                      "samples", "over_cap", "tail", "shown"])
