"""The evaluation engine: prefill a sample once with the full cache, compress a copy of that cache per
variant, then decode every variant together as one batch.

kvpress presses normally compress inside forward hooks during prefill. A press's ``compress`` only
needs the layer's input hidden states, its keys/values and the RoPE tables, none of which compression
changes within the same forward pass (each layer's attention output is computed before its hook runs).
So we capture those per layer during one uncompressed prefill and call ``press.compress`` afterwards, per
variant, on a copy — the same tensors kvpress's hook would see (tests/test_engine.py checks equality).

Batching caches of different lengths: each layer's rows are right-padded to the longest row of that
layer and every full-attention layer gets its own additive mask (a forward pre-hook swaps it in), which
hides the padding and keeps the tail causal. Masked entries get exactly zero weight, so a row decodes
as it would alone (tests/test_engine.py checks the predictions against one-variant-at-a-time runs).

Modules, each using only those listed below it: `sample` (rows per question mode and turn), `verify` (verified
decoding: one teacher-forced pass along the reference's answer, only diverged rows decoded), `floors` (the noise
floors), `teacher` (teacher forcing, length buckets, KL and NLL), `greedy` (greedy decoding, groups of prompts as one
batch, drafts), `batch` (Batch), `layers` (a batch's PerRowLayer and Growing layers), `compress` (a compressed copy, cache
stats), `prefill` (capture, Prefilled, the shallow copy), `attention` (sdpa_gqa, per-layer masks, query hooks); beside
them `drafts` (prompt lookup) and `tuning` (the speed tuning per device: how work is batched and buffered, never what
is computed); below them `kvlab.models.structure` (layers, sliding layers, projections, stop ids), which method kinds
use too. The engine calls the kinds through `kvlab.methods.base` (MethodKind, Variant) and lends them its services
(`compress.SERVICES`); no kind imports the engine (the import contract in pyproject.toml).
"""

from kvlab.engine.attention import ATTENTION, per_layer_masks, query_hooks, sdpa_gqa
from kvlab.engine.batch import Batch, decode_path, host_free_step
from kvlab.engine.layers import PerRowLayer, masked_entries
from kvlab.engine.compress import cache_stats, compress, held_tokens, rerotated
from kvlab.engine.floors import dtype_floor, noise_floor, stepped
from kvlab.engine.greedy import decode_groups, decode_references, greedy_decode
from kvlab.engine.teacher import first_divergence, forced_divergence, stepwise, teacher_forced
from kvlab.engine.verify import Diverged, Verified, decode_diverged, verify
from kvlab.models.structure import attention_layers, decoder_layers, is_sliding, language_model, project, queries, stop_ids
from kvlab.engine.prefill import LayerCapture, Prefilled, capture, prefill, shallow_copy
from kvlab.engine.sample import QUESTION_MODES, Reading, Scope, evaluate_sample, evaluate_samples

__all__ = [
    "ATTENTION", "QUESTION_MODES", "Reading", "Scope", "Batch", "LayerCapture", "Prefilled", "PerRowLayer", "attention_layers", "cache_stats",
    "capture", "compress", "decode_path", "decoder_layers", "evaluate_sample", "greedy_decode",
    "held_tokens", "host_free_step", "is_sliding", "language_model", "masked_entries",
    "per_layer_masks", "prefill", "project", "queries", "query_hooks", "rerotated", "sdpa_gqa", "shallow_copy",
    "stop_ids", "teacher_forced", "Verified", "decode_references", "dtype_floor", "evaluate_samples", "first_divergence", "noise_floor", "stepped", "stepwise",
    "decode_diverged", "verify", "Diverged", "decode_groups", "forced_divergence",
]
