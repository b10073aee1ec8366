-- The SQL behind every table and chart of the report; each block runs against results/kvlab.duckdb.

-- name: accuracy
-- Accuracy (mean score over samples) per model, task, context length, method, budget and question mode.
SELECT model, task, context_tokens, method, budget, question_mode,
       avg(score) AS accuracy, count(*) AS samples,
       avg(kv_bytes) AS kv_bytes, avg(kv_tokens_mean) AS kv_tokens
FROM eval
GROUP BY ALL
ORDER BY model, task, context_tokens, question_mode, method, budget DESC;

-- name: versus_full
-- Each compressed variant against the full cache on the same samples: accuracy change in points.
WITH reference AS (
    SELECT model, task, context_tokens, question_mode, avg(score) AS full_accuracy
    FROM eval WHERE method_kind = 'full' GROUP BY ALL
)
SELECT e.model, e.task, e.context_tokens, e.question_mode, e.method, e.budget,
       avg(e.score) AS accuracy, any_value(f.full_accuracy) AS full_accuracy,
       100 * (avg(e.score) - any_value(f.full_accuracy)) AS delta_points, count(*) AS samples
FROM eval e JOIN reference f USING (model, task, context_tokens, question_mode)
WHERE e.method_kind <> 'full'
GROUP BY ALL
ORDER BY e.model, e.task, e.context_tokens, e.question_mode, e.method, e.budget DESC;

-- name: cost_article
-- The article's §8 cost table, recomputed by kvlab.kernels.accounting.
SELECT model, scheme, bytes_per_token, context_tokens, total_bytes, total_human,
       article_view::BIGINT AS article_view, article_printed, article_printed_per_token, note
FROM costs WHERE source = 'article';

-- name: cost_models
-- The same accounting for every evaluated model's card.
SELECT model, scheme, bytes_per_token, context_tokens, total_bytes, total_human, ratio_vs_bf16, note
FROM costs WHERE source = 'model' ORDER BY model, total_bytes DESC;

-- name: bytes_measured
-- Bytes held by this run's real caches (summed from the stored tensors) beside the accounting formula.
SELECT model, method, budget, question_mode, dtype,
       avg(compressed_tokens) AS prompt_part_tokens, avg(kv_tokens_mean) AS kept_tokens,
       avg(kv_bytes) AS measured_bytes, avg(kv_bytes_formula) AS formula_bytes,
       sum(CASE WHEN kv_bytes = kv_bytes_formula THEN 1 ELSE 0 END) AS rows_equal, count(*) AS rows
FROM eval GROUP BY ALL ORDER BY model, question_mode, method, budget DESC;

-- name: models
SELECT name, architecture, num_layers, num_query_heads, num_kv_heads, head_dim, n_params, dtype, source, sha256
FROM models ORDER BY name;

-- name: timings
-- Wall time and peak memory per job (Snakemake benchmark files).
SELECT job, s AS wall_s, max_rss AS max_rss_mb FROM benchmarks ORDER BY job;

-- name: provenance
SELECT key, value FROM provenance ORDER BY key;
