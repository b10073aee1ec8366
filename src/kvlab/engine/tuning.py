"""The engine's speed tuning, one `Tuning` per kind of device (`tuned(device)` picks it).

Every number here only decides how work is batched or buffered, never what is computed: a row's answer, KL and
noise columns come out the same (bitwise, or within the rounding of a pass of several tokens where drafts are fed;
tests/test_engine.py and tests/test_reference.py check each fast path against its plain form). Where each number
comes from is written beside its field. They were measured on CPUs (the machines named there); the CUDA instance
holds the same numbers, not yet measured on a GPU, so that a run's rows are the same on both.

Numbers that belong to one kernel stay with it (the kernels/ folder imports nothing of the engine): the rows the
packed linear layers are laid out for (`kvlab.kernels.linear.ROWS_HINT`, CPU), the Triton kernels' tiles and split
sizes (`kvlab.kernels.triton_decode`, `kvlab.kernels.triton_quant`, CUDA), and the longest n-gram a draft is looked
up by (`kvlab.engine.drafts.LONGEST`, what a draft is rather than how many are fed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tuning:
    """How the engine batches and buffers its work on one kind of device."""

    # Drafted decoding (kvlab.engine.greedy, `_drafted`).
    draft_tokens: int = 8  # most draft tokens a row is fed in one pass
    # Most positions (rows × tokens) a pass with drafts feeds: a batch of more rows steps one token at a time. A pass's
    # cost grows with its positions even where a step is bound by reading the weights (AMX Xeon, bf16, 2 threads, 1K
    # cache, console: 66 ms for 2 rows × 1 token, 70 for 2 × 4, 105 for 2 × 8, 77 for 8 × 1, 85 for 8 × 2, 132 for
    # 8 × 8), and a batch decodes until its slowest row is done, so wide passes for many rows did not pay.
    pass_rows: int = 32

    # Teacher forcing in length buckets (kvlab.engine.teacher, `length_buckets`). A dense teacher-forced batch is
    # right-padded to its longest row, and SDPA computes the padding it masks: rows of a 1K cache at budgets 1.0 down
    # to 0.1 in one batch spend most of their attention on padding. `length_buckets` splits them where that saves more
    # than a pass costs. Units: query-key pairs of one row over every layer and head (Qwen2.5-0.5B in bf16 on the
    # 2-core EPYC: ~0.8 us each, torch's CPU flash kernel at ~110 GFLOP/s); a forward pass's own overhead (~24 layers
    # of small operators and Python, ~20 ms) is about 25,000 of them (`pass_pairs`). A batch feeds at least
    # `bucket_tokens` tokens (rows × tokens fed), where the packed linear layers still run near their peak (M of 33-128
    # rows ran at 375 GFLOP/s in a variable_tracking job, above 128 at 406).
    pass_pairs: int = 25_000
    bucket_tokens: int = 128

    # Diverged rows' caches (stored bytes) that wait for one joint decode at most (kvlab.engine.sample): a one-token
    # step at a few rows is bound by reading the weights, so one step for every waiting sample's rows costs about what
    # one sample's did; beyond this, the samples so far are decoded then.
    diverged_bytes: int = 1 << 30

    # Tokens of room a batch's dense layer (kvlab.engine.layers, `Growing`) holds at first: a decoded answer or a
    # teacher-forced path fits without growing (appending in place instead of transformers' concatenation, which at 16
    # rows of a 1K cache of Qwen2.5-0.5B in bf16 copied 200 MB per step).
    room: int = 64


CPU = Tuning()
CUDA = Tuning()  # the CPU's numbers: not measured on a GPU yet
BY_DEVICE = {"cpu": CPU, "cuda": CUDA}  # device type -> its tuning (tests and benchmarks/engine_ab.py swap entries)


def tuned(device) -> Tuning:
    """The tuning of `device` (a torch.device or its name); the CPU's for a kind of device not listed."""
    return BY_DEVICE.get(torch.device(device).type, CPU)
