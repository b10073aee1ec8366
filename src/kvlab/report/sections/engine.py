"""Wall time of the same grid by kvlab's engine and by kvpress's pipeline, and their agreement."""

import pandas as pd

from kvlab.report.decision import Rule
from kvlab.report.html import table
from kvlab.report.sections.throughput import NOT_RUN

TITLE = "Engine vs kvpress pipeline"
QUERIES = ("engine_vs_pipeline",)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    if q["engine_vs_pipeline"].empty:
        return NOT_RUN.format(job="engine_vs_pipeline")
    return (
        "<p>The same samples, variants and question modes. kvlab's engine prefills each sample once "
        "(the question-aware prefill continues the agnostic one), compresses a copy of the cache per variant, "
        "decodes the full cache's answer, checks every variant along it in one teacher-forced pass and decodes "
        "only the variants that leave it; kvpress's pipeline prefills, compresses and decodes once per "
        "variant and mode (aware: the question inside the compressed context). Both produce answers only "
        "here (the engine computes no KL from its pass). The agnostic-only columns compare that mode "
        "alone. Agreement is the fraction of identical answers; in the aware mode the pipeline tokenizes "
        "context and question as one string, so a token at their boundary may differ. Where a press keeps a "
        "different number of tokens per layer (PyramidKV), the pipeline's decoding (transformers' own) builds "
        "the causal mask of the question's tokens from the first layer's length, so in every shorter layer each "
        "question token also sees the question's later tokens; the engine masks each layer on its own (tested: "
        "the question fed at once equals feeding it token by token), so their answers may differ there.</p>"
        + table(q["engine_vs_pipeline"])
    )
