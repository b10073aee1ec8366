"""The report's sections, in page order: one module each, with its TITLE, the QUERIES (queries.sql) shown
under it and body(q, rule) -> HTML, where q maps every query's name to its rows and rule is the decision rule.

Adding a section: a module here and one line in SECTIONS.
"""

from kvlab.report.sections import (
    accuracy, agreement, allocation, bytes_measured, calibration, claims, composition, context_length, cost_article, cost_models, cost_reads, decision,
    divergence, engine, eval_cost, eviction, kernels, lengths, models, posthoc, power, prompt, provenance, quant, ruler, serving, summary, tasks,
    throughput, verdict_grid,
)

SECTIONS = [
    verdict_grid,
    summary,
    claims,
    decision,
    agreement,
    serving,
    allocation,
    power,
    accuracy,
    context_length,
    ruler,
    eviction,
    posthoc,
    prompt,
    composition,
    calibration,
    quant,
    divergence,
    lengths,
    throughput,
    kernels,
    engine,
    eval_cost,
    cost_article,
    cost_reads,
    cost_models,
    bytes_measured,
    models,
    tasks,
    provenance,
]
