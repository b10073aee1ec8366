"""Typed columns of the tables a run may leave empty (so DuckDB still types them): no torch, no duckdb."""

# kvlab.steps.kernel_bench's rows: empty in runs without CUDA.
DECODE_KERNEL_COLUMNS = {
    "model": "string", "format": "string", "path": "string", "bits": "int64", "context_tokens": "int64",
    "batch": "int64", "kv_heads": "int64", "query_heads": "int64", "head_dim": "int64", "ms": "float64",
    "call_ms": "float64", "bytes_read": "int64", "gb_per_s": "float64", "dtype": "string", "device": "string",
}

# kvlab.steps.benchmark's rows: empty in runs whose `speed_benchmarks` leaves the job out (a workload-only run).
THROUGHPUT_COLUMNS = {
    "model": "string", "context_tokens": "int64", "method": "string", "budget": "float64", "batch": "int64",
    "new_tokens": "int64", "decode_s": "float64", "tokens_per_s": "float64", "graph_step_ms": "float64",
    "graph_tokens_per_s": "float64", "prefill_s": "float64", "kv_bytes": "int64", "kv_tokens_mean": "float64",
    "decode_path": "string", "dtype": "string", "device": "string",
}
ENGINE_VS_PIPELINE_COLUMNS = {
    "model": "string", "task": "string", "context_tokens": "int64", "samples": "int64", "variants": "int64",
    "question_modes": "string", "max_new_tokens": "int64", "engine_s": "float64", "pipeline_s": "float64",
    "speedup": "float64", "engine_agnostic_s": "float64", "pipeline_agnostic_s": "float64", "speedup_agnostic": "float64",
    "agreement_agnostic": "float64", "agreement_aware": "float64", "dtype": "string", "device": "string",
}

# Eval columns later kvlab versions added, typed so the report's queries run on rows written before them.
EVAL_COLUMNS = {"ruler_task": "string", "noise_dtype": "string", "dtype_noise_kl": "float64", "dtype_noise_kl_max": "float64",
                "dtype_noise_diverged_at": "Int64", "dtype_noise_s": "float64",
                "draw": "Int64", "round": "Int64", "round_s": "float64", "max_samples": "Int64", "stopped_by": "string",
                "kv_saturated_keys": "float64", "kv_saturated_values": "float64", "cut_tokens": "Int64",
                "prefix_tokens": "Int64", "waves": "Int64", "dtype_floor_skipped": "string",
                # a serving engine's rows (kvlab.steps.serve): the engine and its version, its cache's MiB for its cells
                # as it reports them, the kvlab model the engine's model is, and the kvlab method simulating the row's
                "engine": "string", "engine_kv_mib": "float64", "engine_kv_cells": "Int64", "kvlab_model": "string",
                "kvlab_twin": "string"}
