"""The article's decision table (§7.2) regenerated, every cell behind it with its interval, and each of the
article's testable statements against this run."""

import pandas as pd

from kvlab.report.article import article_comparison
from kvlab.report.decision import Rule, cells, decision_table
from kvlab.report.html import table

TITLE = "Decision table (article §7.2), regenerated"
QUERIES = ("answers", "flips")
SHOWN = ["model", "shape", "question_mode", "method", "budget", "kv_fraction_bf16", "samples", "answers", "accuracy",
         "accuracy_low", "accuracy_high", "full_accuracy", "full_low", "full_high", "losses", "gains", "drop_points", "drop_low", "drop_high", "kl_mean_nats",
         "kl_low", "kl_high", "kl_over_cap", "kl_tail_high", "decision", "table_decision", "jobs", "decided_at", "n_to_decide"]


def rule_text(rule: Rule) -> str:
    return (
        f"a method is <b>safe</b> at a budget when the one-sided 95% upper bound of its accuracy drop vs the full "
        f"cache on the same samples is at most {rule.tolerance_points:g} points (config <code>decision.tolerance_points</code>), "
        f"<b>unsafe</b> when the lower bound reaches it, and <b>inconclusive</b> otherwise. Bounds of a drop: a "
        f"betting confidence sequence over the per-sample paired drops in draw order (kvlab.stats.anytime; turns of a "
        f"sample averaged first), valid at every n at once, so the evaluation jobs' early stopping keeps each "
        f"decision's error at most 5%. On prose, with no answers to score, the verdict is about the per-token KL "
        f"against {rule.kl_safe:g} nat (config <code>decision.kl_safe</code>), each sample's KL capped at "
        f"{rule.kl_cap_ratio:g} × that (<code>decision.kl_cap_ratio</code>): safe when the upper bound of the capped "
        f"mean is at most {rule.kl_safe:g} nat and the upper bound of the share of samples above the cap at most "
        f"{rule.kl_tail_share:.0%} (<code>decision.kl_tail_share</code>); unsafe when the capped mean's lower bound "
        f"reaches {rule.kl_safe:g} nat (the plain mean is then at least that too). A mean of uncapped KL has no "
        f"bound a run can trust: one document in a hundred at 1 nat moves it by 0.01 nat and most runs never see it. "
        f"A cell is tested on the samples of one evaluation job (a task at one context length); a row that spans "
        f"several jobs is safe when every job's cell is, unsafe when any is (its chance of a wrong 'unsafe' adds up "
        f"over its jobs). The tables print the <b>table's decisions</b>: those e-BH keeps over every job cell of the "
        f"run, so that the expected share of wrong ones among them is at most 5% (a cell decided on its own but not "
        f"kept is listed as inconclusive, and its evidence says so). Accuracy intervals: Wilson 95%"
    )


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    rows = q["answers"]
    if rows.empty:
        return "<p>No compressed method was evaluated in this run.</p>"
    every = cells(rows, rule, by=["model", "shape", "question_mode"])
    return (
        f"<p><b>Rule:</b> {rule_text(rule)}. 'measured on' names the tasks and context lengths (in tokens, with "
        f"their distinct prompts) each row pools. Each safe method appears once, at its most compressed safe budget, with "
        f"the compression it reached (bytes stored vs the full cache in bf16, measured). The article's question — "
        f"40 GB → 10 GB — asks for ≥ {rule.target:g}×; a method undecided there is listed as inconclusive with n, "
        f"its bounds and the samples that would decide it at the observed effect.</p>"
        + table(decision_table(rows, rule))
        + "<h3>Every cell</h3><p class='note'>Per method and budget: accuracy with its Wilson 95% interval over the "
        "answers; losses and gains: the samples (of its samples) on which the method scored below the full cache "
        "(right → wrong) and above it (wrong → right), a sample's turns averaged first; with partial scores (token F1) "
        "any lower score is a loss and any higher one a gain, so a small drop can hide many flips both ways; the drop "
        "vs the full cache in points with its one-sided 95% bounds (the betting confidence sequence over samples), "
        "or the mean per-sample KL with the betting bounds of its capped mean (kl_low, "
        "kl_high), its samples above the cap and the upper bound of their share (kl_tail_high); decision: the cell's "
        "own, table_decision: the one e-BH keeps across the table; jobs: each job cell's own decision; n_to_decide: samples in all "
        "that would decide an inconclusive cell if its samples went on alike (at the best constant stake: a low "
        "estimate); decided_at: the sample at which its bound decided it (the next section shows where the answers "
        "went).</p>"
        + table(every[[c for c in SHOWN if c in every]])
        + "<h3>Against the article's decision table</h3><p class='note'>Each recommendation of the article's "
        "table, on the task shape that stands for its workload (long-document QA: RULER's qa_1 and qa_2 where this "
        "run has them, else the single needle), with the tasks, context lengths and distinct prompts that decided "
        "it ('measured on'). A row about longer contexts than this run measured (the article's > 128K), or about a "
        "workload no task here represents, says so and is not counted. Methods are recognized by "
        "what they store (INT4: 4-bit KIVI without eviction; FP8 + SnapKV 25%: FP8 storage of SnapKV's 25%), not by "
        "name. A 'safe' statement agrees when some such method is decided safe, and disagrees when all are decided "
        "unsafe; a 'not safe' statement the other way round; otherwise this run is inconclusive.</p>"
        + table(article_comparison(rows, rule))
    )
