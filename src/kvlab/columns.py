"""Typed columns of the tables a run may leave empty (so DuckDB still types them): no torch, no duckdb."""

# kvlab.kernel_bench's rows: empty in runs without CUDA.
DECODE_KERNEL_COLUMNS = {
    "model": "string", "format": "string", "path": "string", "bits": "int64", "context_tokens": "int64",
    "batch": "int64", "kv_heads": "int64", "query_heads": "int64", "head_dim": "int64", "ms": "float64",
    "call_ms": "float64", "bytes_read": "int64", "gb_per_s": "float64", "dtype": "string", "device": "string",
}

# Eval columns later kvlab versions added, typed so the report's queries run on rows written before them.
EVAL_COLUMNS = {"ruler_task": "string", "noise_dtype": "string", "dtype_noise_kl": "float64", "dtype_noise_kl_max": "float64",
                "dtype_noise_diverged_at": "Int64", "dtype_noise_s": "float64",
                "draw": "Int64", "round": "Int64", "round_s": "float64", "max_samples": "Int64",
                "kv_saturated_keys": "float64", "kv_saturated_values": "float64", "cut_tokens": "Int64"}
