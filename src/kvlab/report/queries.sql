-- The SQL behind every table and chart of the report; each block runs against results/kvlab.duckdb.

-- name: tasks
-- The task suite as generated for this run: samples, prompt length and scorer per task.
SELECT model, task, task_kind, metric, context_tokens, count(DISTINCT sample_id) AS samples,
       round(avg(prompt_tokens)) AS mean_prompt_tokens, max(turn) AS turns
FROM eval WHERE method_kind = 'full' AND question_mode = 'agnostic'
GROUP BY ALL ORDER BY model, task, context_tokens;

-- name: accuracy
-- Accuracy (mean score over samples) per model, task (and turn), context length, method, budget and
-- question mode. Tasks scored only by KL (metric 'none') are left out.
SELECT model, task || CASE WHEN turn > 1 THEN ' · turn ' || turn ELSE '' END AS task, context_tokens,
       method, budget, question_mode,
       avg(score) AS accuracy, count(*) AS samples,
       avg(kv_bytes) AS kv_bytes, avg(kv_tokens_mean) AS kv_tokens
FROM eval WHERE metric <> 'none'
GROUP BY ALL
ORDER BY model, task, context_tokens, question_mode, method, budget DESC;

-- name: accuracy_bytes
-- Accuracy per task shape, question mode, method and budget against the KV bytes the method stored, as a
-- fraction of the full cache in bf16 (1 / compression_vs_bf16: residuals and dense entries at 2 bytes).
SELECT model, shape, question_mode, method, budget,
       avg(score) AS accuracy, avg(1 / compression_vs_bf16) AS kv_fraction_bf16,
       avg(kv_bytes) AS kv_bytes, avg(kv_kept_mean) AS kept_tokens, count(*) AS rows
FROM eval WHERE metric <> 'none'
GROUP BY ALL ORDER BY model, shape, question_mode, method, budget DESC;

-- name: eviction_accuracy
-- Eviction methods by task shape, question mode, budget and needle depth, beside the full cache on the same
-- samples and turns (the claims C6, C7, C8 and C11 read the same answers, one row each, from `answers`).
WITH scored AS (SELECT * FROM eval WHERE metric <> 'none'),
reference AS (
    SELECT model, sample_id, question_mode, turn, score AS full_score FROM scored WHERE method_kind = 'full'
)
SELECT model, shape, question_mode, method, method_kind, press, wrapper, press_kwargs, budget, depth,
       avg(score) AS accuracy, avg(full_score) AS full_accuracy, count(*) AS rows,
       avg(kv_tokens_mean) AS stored_tokens, avg(kv_kept_mean) AS kept_tokens, avg(kv_bytes) AS kv_bytes
FROM scored JOIN reference USING (model, sample_id, question_mode, turn)
WHERE method_kind IN ('kvpress', 'h2o') AND scheme IS NULL
GROUP BY ALL
ORDER BY model, shape, question_mode, method, budget DESC, depth;

-- name: eviction_kl
-- Eviction methods on real prose: per-token KL(full ‖ method) and perplexity along the true continuation.
SELECT model, method, method_kind, press, wrapper, press_kwargs, budget, context_tokens,
       avg(kl_vs_full) AS kl_mean_nats, avg(ppl) AS ppl, count(*) AS samples
FROM eval
WHERE metric = 'none' AND question_mode = 'agnostic' AND method_kind IN ('kvpress', 'h2o') AND scheme IS NULL
GROUP BY ALL
ORDER BY model, method, budget DESC, context_tokens;

-- name: answers
-- Every compressed method's answers, one row per (sample, question mode, turn), beside the full cache's
-- answer to the same prompt; on prose (no answers to score) each sample's per-token KL to the full cache (the
-- mean over its teacher-forced tokens); and the bytes stored as a fraction of the full cache in bf16.
-- prompt_sha1 names the prompt (every token id it feeds), so a repeated prompt shows; draw, round and
-- max_samples say when the evaluation job drew the sample (kvlab.state.sequential), round_s its round's seconds and
-- stopped_by why its job stopped (decided, max_samples, or time: sequential.stop_after_minutes). The decision
-- table and the statistical claims bound these rows by sample, in draw order.
WITH scored AS (SELECT * FROM eval WHERE metric <> 'none'),
reference AS (
    SELECT model, sample_id, question_mode, turn, score AS full_score FROM scored WHERE method_kind = 'full'
)
SELECT model, shape, task, task_kind, context_tokens, question_mode, method, method_kind, press, wrapper, scheme, bits,
       key_axis, value_axis, policy, press_kwargs, budget, depth, sample_id, prompt_sha1, turn, score, full_score,
       1 / compression_vs_bf16 AS kv_fraction_bf16, NULL::DOUBLE AS kl_vs_full, draw, round, max_samples, round_s,
       stopped_by
FROM scored JOIN reference USING (model, sample_id, question_mode, turn)
WHERE method_kind <> 'full'
UNION ALL BY NAME
SELECT model, shape, task, task_kind, context_tokens, question_mode, method, method_kind, press, wrapper, scheme, bits,
       key_axis, value_axis, policy, press_kwargs, budget, depth, sample_id, prompt_sha1, turn,
       1 / compression_vs_bf16 AS kv_fraction_bf16, kl_vs_full, draw, round, max_samples, round_s, stopped_by
FROM eval
WHERE metric = 'none' AND method_kind <> 'full' AND question_mode = 'agnostic'
ORDER BY model, shape, question_mode, method, budget DESC, sample_id, turn;

-- name: flips
-- Per cell of an evaluation job with scored answers: the samples on which the method scored below the full cache
-- on the same prompt (losses: right → wrong) and above it (gains: wrong → right), out of `samples`; a sample's
-- turns averaged first, as the decision's bounds read them. With partial scores (token F1) any lower score is a
-- loss and any higher one a gain. collect.py also stores this query as the view `flips` in results/kvlab.duckdb.
WITH scored AS (SELECT * FROM eval WHERE metric <> 'none'),
reference AS (
    SELECT model, task, context_tokens, sample_id, question_mode, turn, score AS full_score
    FROM scored WHERE method_kind = 'full'
),
per_sample AS (
    SELECT model, task, context_tokens, question_mode, method, budget, sample_id,
           avg(score) - avg(full_score) AS change
    FROM scored JOIN reference USING (model, task, context_tokens, sample_id, question_mode, turn)
    WHERE method_kind <> 'full'
    GROUP BY ALL
)
SELECT model, task, context_tokens, question_mode, method, budget,
       count(*) FILTER (WHERE change < -1e-9) AS losses, count(*) FILTER (WHERE change > 1e-9) AS gains,
       count(*) AS samples
FROM per_sample
GROUP BY ALL
ORDER BY model, task, context_tokens, question_mode, method, budget DESC;

-- name: versus_full
-- Each compressed variant's answers beside the full cache's answer to the same prompt (sample, question mode,
-- turn), per task (and turn) and context length.
WITH scored AS (
    SELECT *, task || CASE WHEN turn > 1 THEN ' · turn ' || turn ELSE '' END AS task_turn
    FROM eval WHERE metric <> 'none'
), reference AS (
    SELECT model, sample_id, question_mode, turn, score AS full_score FROM scored WHERE method_kind = 'full'
)
SELECT model, task_turn AS task, context_tokens, question_mode, method, budget, sample_id, turn, score, full_score
FROM scored JOIN reference USING (model, sample_id, question_mode, turn)
WHERE method_kind <> 'full'
ORDER BY model, task, context_tokens, question_mode, method, budget DESC, sample_id;

-- name: divergence
-- Per-token KL(full ‖ method) and perplexity change along a teacher-forced path: the true continuation for
-- prose tasks (metric 'none'), the full cache's own answer elsewhere. Δ perplexity is paired by sample. Each
-- row's KL per answer and sample id (kl_each, sample_each) give its bounds (bootstrap over samples).
WITH paired AS (
    SELECT e.*, f.ppl AS full_ppl
    FROM eval e JOIN eval f
      ON f.method_kind = 'full' AND e.model = f.model AND e.sample_id = f.sample_id
     AND e.question_mode = f.question_mode AND e.turn = f.turn
)
SELECT model, task, CASE WHEN metric = 'none' THEN 'true continuation' ELSE 'full cache answer' END AS path,
       context_tokens, method, budget, question_mode,
       avg(kl_vs_full) AS kl_mean_nats, max(kl_max) AS kl_max_nats, avg(ppl) AS ppl,
       avg(ppl - full_ppl) AS delta_ppl, avg(tf_tokens) AS tokens, count(*) AS samples,
       list(kl_vs_full ORDER BY sample_id, turn) AS kl_each, list(sample_id ORDER BY sample_id, turn) AS sample_each
FROM paired WHERE method_kind <> 'full'
GROUP BY ALL
ORDER BY model, path DESC, task, context_tokens, question_mode, method, budget DESC;

-- name: quant_kl
-- Quantized caches on real prose: per-token KL(full ‖ method) along the true continuation, fed one token
-- at a time, by scheme and bits; Δ perplexity paired by sample; compression from the stored bytes; the share of
-- the context's coded key / value entries FP8 clamped at ±448 × scale (NULL for formats that clamp nothing).
WITH paired AS (
    SELECT e.*, f.ppl AS full_ppl
    FROM eval e JOIN eval f
      ON f.method_kind = 'full' AND e.model = f.model AND e.sample_id = f.sample_id
     AND e.question_mode = f.question_mode AND e.turn = f.turn
)
SELECT model, method, scheme, bits, key_axis, value_axis, policy, budget, context_tokens,
       avg(kl_vs_full) AS kl_mean_nats, max(kl_max) AS kl_max_nats, avg(ppl - full_ppl) AS delta_ppl,
       avg(compression_vs_bf16) AS compression_vs_bf16, avg(codes_vs_bf16) AS codes_vs_bf16,
       avg(kv_saturated_keys) AS saturated_keys, avg(kv_saturated_values) AS saturated_values, count(*) AS samples
FROM paired
WHERE scheme IS NOT NULL AND metric = 'none' AND question_mode = 'agnostic'
GROUP BY ALL
ORDER BY model, scheme, bits DESC, method, context_tokens;

-- name: quant_accuracy
-- Quantized caches per scored task (question modes and turns pooled): accuracy against the full cache on
-- the same samples, beside the eviction budget (1 = nothing evicted). The report pools tasks further.
WITH scored AS (SELECT * FROM eval WHERE metric <> 'none'),
reference AS (
    SELECT model, sample_id, question_mode, turn, score AS full_score FROM scored WHERE method_kind = 'full'
)
SELECT model, method, scheme, bits, key_axis, value_axis, policy, budget, task,
       sum(score) AS correct, sum(full_score) AS full_correct, count(*) AS rows
FROM scored JOIN reference USING (model, sample_id, question_mode, turn)
WHERE scheme IS NOT NULL
GROUP BY ALL
ORDER BY model, scheme, bits DESC, method, budget DESC;

-- name: throughput
-- Decode speed after each method's compression, per batch size (tokens/s over all sequences; on CUDA also
-- with one step replayed from a CUDA graph, no host work), and the KV bytes one sequence holds.
SELECT model, context_tokens, batch, method, budget, new_tokens, tokens_per_s, graph_tokens_per_s, decode_s,
       prefill_s, kv_bytes, kv_tokens_mean AS kv_tokens, decode_path, device
FROM throughput ORDER BY model, context_tokens, batch, method, budget DESC;

-- name: decode_kernels
-- Decode attention, one call per layer and step (CUDA only): time on the device (replayed from a CUDA graph)
-- and called from Python, bandwidth per storage format and path, and the device-time speed-up over SDPA on
-- the dense cache at the same context length and batch.
WITH dense AS (SELECT model, device, context_tokens, batch, ms AS sdpa_ms FROM decode_kernels WHERE path = 'sdpa')
SELECT model, device, dtype, context_tokens, batch, format, path, ms, call_ms, gb_per_s, bytes_read,
       sdpa_ms / ms AS speedup_vs_sdpa
FROM decode_kernels LEFT JOIN dense USING (model, device, context_tokens, batch)
ORDER BY model, device, batch, context_tokens, bits DESC, path;

-- name: engine_vs_pipeline
-- Wall time of the same grid (samples × variants × question modes): kvlab's engine vs kvpress's pipeline
-- called once per variant and mode; agreement = fraction of identical answers.
SELECT * EXCLUDE (dtype) FROM engine_vs_pipeline ORDER BY model, context_tokens;

-- name: cost_article
-- The article's §8 cost table, recomputed by kvlab.kernels.accounting.
SELECT model, scheme, bytes_per_token, context_tokens, total_bytes, total_human,
       article_view::BIGINT AS article_view, article_printed, article_printed_per_token, note
FROM costs WHERE source = 'article';

-- name: cost_models
-- The same accounting for every evaluated model's card.
SELECT model, scheme, bytes_per_token, context_tokens, total_bytes, total_human, ratio_vs_bf16, note
FROM costs WHERE source = 'model' ORDER BY model, total_bytes DESC;

-- name: cost_reads
-- KV bytes one decode step reads, NSA and MoBA against full attention (kvlab.kernels.reads), per model and context.
SELECT model, context_tokens, method, kv_bytes_read, read_human, fewer_bytes_than_full, read_per_layer_and_kv_head, note
FROM reads ORDER BY model, context_tokens, kv_bytes_read DESC;

-- name: cost_crossover
-- The shortest context whose KV reads per decode step of one sequence exceed the weight bytes (article §8.3).
SELECT model, parameters, weight_format, weight_bytes, kv_scheme, kv_bytes_per_token, crossover_tokens, max_context, note
FROM crossover ORDER BY model, weight_bytes DESC, kv_bytes_per_token DESC;

-- name: bytes_measured
-- Bytes held by this run's real caches (summed from the stored tensors) beside the accounting formula.
SELECT model, method, budget, question_mode, dtype,
       avg(compressed_tokens) AS prompt_part_tokens, avg(kv_tokens_mean) AS stored_tokens,
       avg(kv_kept_mean) AS attended_tokens, min(kv_kept_min) AS attended_min_per_head,
       avg(kv_bytes) AS measured_bytes, avg(kv_bytes_formula) AS formula_bytes,
       avg(compression_vs_bf16) AS compression_vs_bf16,
       sum(CASE WHEN kv_bytes = kv_bytes_formula THEN 1 ELSE 0 END) AS rows_equal, count(*) AS rows
FROM eval WHERE turn = 1 GROUP BY ALL ORDER BY model, question_mode, method, budget DESC;

-- name: models
SELECT name, architecture, num_layers, num_query_heads, num_kv_heads, head_dim, n_params, dtype, source, sha256
FROM models ORDER BY name;

-- name: timings
-- Wall time and peak memory per job (Snakemake benchmark files).
SELECT job, s AS wall_s, max_rss AS max_rss_mb FROM benchmarks ORDER BY job;

-- name: length_costs
-- Per evaluation job (model, task, context length): its samples, seconds per sample and peak RSS (Snakemake's
-- benchmark file), the most waves a sample ran in under the job's memory budget (kvlab.state.memory), the dtype and CPU
-- kind it ran on, and why it measured no dtype floor where its task lists one.
WITH jobs AS (
    SELECT model, task, context_tokens, count(DISTINCT sample_id) AS samples, max(waves) AS waves,
           string_agg(DISTINCT dtype, '; ') AS dtype, string_agg(DISTINCT device, '; ') AS device,
           string_agg(DISTINCT dtype_floor_skipped, '; ') AS dtype_floor_skipped
    FROM eval GROUP BY ALL
)
SELECT jobs.*, b.s AS wall_s, b.s / samples AS s_per_sample, b.max_rss / 1000 AS peak_rss_gb
FROM jobs LEFT JOIN benchmarks b ON b.job = 'evaluate/' || model || '/' || task || '/' || context_tokens
ORDER BY model, task, context_tokens;

-- name: provenance
-- What produced this report: config hash, preset, package versions, git commit, each model's weights
-- (sha256) and the device and dtype the evaluation ran on.
SELECT key, value FROM provenance
UNION ALL SELECT 'evaluation device', string_agg(DISTINCT device, '; ') FROM eval
UNION ALL SELECT 'evaluation dtype', string_agg(DISTINCT dtype, '; ') FROM eval
UNION ALL SELECT 'model sha256: ' || name, sha256 FROM models
ORDER BY key;

-- name: rule_times
-- Wall time per rule: the jobs' Snakemake benchmark files summed by rule.
SELECT split_part(job, '/', 1) AS rule, count(*) AS jobs, sum(s) AS wall_s, max(max_rss) AS max_rss_mb
FROM benchmarks GROUP BY ALL ORDER BY wall_s DESC, rule;

-- name: calib_c1
-- C1: per (layer, KV head) outlier score = largest channel absmax / median channel absmax; median over heads.
WITH heads AS (
    SELECT model, tensor, layer, kv_head, max(absmax) / median(absmax) AS score
    FROM calib_key_channels GROUP BY ALL
)
SELECT model,
       median(score) FILTER (WHERE tensor = 'key_pre_rope') AS key_pre_rope,
       median(score) FILTER (WHERE tensor = 'key_post_rope') AS key_post_rope,
       median(score) FILTER (WHERE tensor = 'value') AS value,
       max(score) FILTER (WHERE tensor = 'key_pre_rope') AS key_pre_rope_max,
       max(score) FILTER (WHERE tensor = 'value') AS value_max
FROM heads GROUP BY model ORDER BY model;

-- name: calib_c2
-- C2: the residual stream's largest magnitude on token 0 vs every other position, and the attention mass on
-- token 0 (mean over heads and query positions), by layer; summarized per model.
WITH layers AS (
    SELECT m.model, m.layer,
           max(m.max_abs) FILTER (WHERE m.position_class = 'first') AS first_max,
           max(m.max_abs) FILTER (WHERE m.position_class <> 'first') AS rest_max,
           any_value(c.token0_mass) AS token0_mass
    FROM calib_massive m JOIN calib_concentration c USING (model, layer)
    GROUP BY ALL
)
SELECT model, max(first_max / rest_max) AS massive_ratio, arg_max(layer, first_max / rest_max) AS massive_layer,
       max(first_max) AS token0_max_abs, max(token0_mass) AS token0_mass_max,
       arg_max(layer, token0_mass) AS token0_mass_layer, avg(token0_mass) AS token0_mass_mean
FROM layers GROUP BY model ORDER BY model;

-- name: calib_channels
-- Channel absmax for the heatmaps (floored at 1e-3 so the log colour scale is defined for dead channels).
SELECT model, tensor, layer, kv_head * (max(channel) OVER (PARTITION BY model) + 1) + channel AS channel,
       round(greatest(absmax, 1e-3), 3) AS absmax
FROM calib_key_channels;

-- name: calib_massive
SELECT model, layer, position_class, max_abs, position, token, channel FROM calib_massive ORDER BY model, layer;

-- name: calib_sinks
-- Attention mass on token 0 per (layer, query head), mean over calibration sequences.
SELECT model, layer, head, avg(mass) AS token0_mass FROM calib_sinks WHERE position = 0 GROUP BY ALL;

-- name: calib_concentration
SELECT model, layer, sliding, entropy, keys90_fraction, token0_mass FROM calib_concentration ORDER BY model, layer;

-- name: calib_fed_forward
-- What calibration hands to later stages, per model.
SELECT s.model, s.n_sink AS streaming_sinks, s.token0_mass_mean,
       (SELECT min(scale) FROM calib_fp8_scales f WHERE f.model = s.model) AS fp8_scale_min,
       (SELECT max(scale) FROM calib_fp8_scales f WHERE f.model = s.model) AS fp8_scale_max,
       (SELECT count(DISTINCT layer) FROM calib_kvquant_grids g WHERE g.model = s.model) AS kvquant_grid_layers,
       (SELECT min(budget_weight) FROM calib_layer_budget b WHERE b.model = s.model) AS layer_budget_min,
       (SELECT max(budget_weight) FROM calib_layer_budget b WHERE b.model = s.model) AS layer_budget_max
FROM calib_stream_sinks s ORDER BY s.model;

-- name: calib_secondary_sinks
-- Positions other than token 0 that take at least the sink threshold of a layer's attention (per sequence),
-- by model and layer: how many, how much mass, and what share of them are delimiters ('.', ',', newline …).
SELECT s.model, s.layer, any_value(c.sliding) AS sliding, count(DISTINCT (s.sequence, s.position)) AS sink_positions,
       avg(s.mass) AS mean_mass, max(s.mass) AS max_head_mass, avg(s.is_delimiter::INT) AS delimiter_share,
       string_agg(DISTINCT s.token, ' ') AS tokens
FROM calib_sinks s JOIN calib_concentration c USING (model, layer)
WHERE s.is_sink AND s.position > 0
GROUP BY s.model, s.layer ORDER BY s.model, s.layer;

-- name: eval_cost
-- Per evaluate job: rows scored, samples, the job's wall time (its Snakemake benchmark) and rows per second,
-- and the engine's seconds by phase: prefill (once per sample and compression), compress (every variant),
-- decode (the full cache's answers, decoded for several samples at once and split among them, plus the rows
-- that leave them) and the teacher-forced pass (every row along the full answer, or prose's reference).
WITH computations AS (  -- one per sample, compression (its prompt length) and turn
  SELECT model, task, context_tokens, sample_id, compressed_tokens, turn,
         any_value(prefill_s) AS prefill_s, any_value(decode_s) AS decode_s,
         any_value(teacher_forced_s) AS teacher_forced_s, any_value(noise_s) AS noise_s,  -- noise_s, dtype_noise_s: full row only
         any_value(dtype_noise_s) AS dtype_noise_s
  FROM eval GROUP BY ALL
), compressions AS (
  SELECT model, task, context_tokens, sample_id, compressed_tokens, method, budget, any_value(compress_s) AS compress_s
  FROM eval GROUP BY ALL
), phases AS (
  SELECT c.model, c.task, c.context_tokens, sum(c.decode_s) AS decode_s, sum(c.teacher_forced_s) AS teacher_forced_s,
         sum(c.noise_s) AS noise_s, sum(c.dtype_noise_s) AS dtype_noise_s,
         (SELECT sum(p) FROM (SELECT max(prefill_s) AS p FROM computations x
           WHERE x.model = c.model AND x.task = c.task AND x.context_tokens = c.context_tokens GROUP BY sample_id)) AS prefill_s,
         (SELECT sum(compress_s) FROM compressions y
           WHERE y.model = c.model AND y.task = c.task AND y.context_tokens = c.context_tokens) AS compress_s
  FROM computations c GROUP BY ALL
), jobs AS (
  SELECT model, task, context_tokens, count(*) AS rows, count(DISTINCT sample_id) AS samples, any_value(dtype) AS dtype
  FROM eval GROUP BY ALL
)
SELECT j.model, j.task, j.context_tokens, j.samples, j.rows, b.s AS wall_s, j.rows / b.s AS rows_per_s,
       p.prefill_s, p.compress_s, p.decode_s, p.teacher_forced_s, p.noise_s, p.dtype_noise_s, j.dtype
FROM jobs j JOIN phases p USING (model, task, context_tokens)
LEFT JOIN benchmarks b ON b.job = 'evaluate/' || j.model || '/' || j.task || '/' || j.context_tokens
ORDER BY wall_s DESC NULLS LAST, j.model, j.task, j.context_tokens;

-- name: verification
-- How often a compressed row's greedy choice follows the full cache's answer at every position (its answer
-- is then the full cache's, taken without decoding it), and the full row's own noise floor: how often its
-- one-pass choice differs from its step-by-step decoding somewhere (a near-tie flipped by rounding).
SELECT model, dtype, method_kind = 'full' AS full_row, count(*) AS rows,
       count(*) FILTER (WHERE diverged_at IS NULL) AS follow_full,
       count(*) FILTER (WHERE diverged_at IS NULL) / count(*) AS share_following
FROM eval WHERE metric <> 'none' GROUP BY ALL ORDER BY model, full_row DESC;

-- name: noise_floor
-- The full cache against itself under a change that should not matter (`change`): every measured full row
-- read one token at a time along the same path, in a padded batch of other prompts' rows (noise_kl: on question
-- tasks the steps its answer was decoded with, whose choice is the answer, so noise_diverged_at is where the one
-- pass's choice leaves it; on prose a second, stepped pass), or read in one pass by the model in another compute dtype (dtype_noise_kl), against its one pass in
-- the batch of every row. Per-token KL between the two (nats, mean over the path) and, on scored tasks, whether
-- the other reading's greedy choice leaves the answer somewhere: what rounding alone does to a KL and to an
-- answer. (Full rows that several question modes share are counted once.)
SELECT DISTINCT model, dtype, 'one-token steps in another batch' AS change, task, sample_id, turn,
       metric <> 'none' AS scored, noise_kl, noise_kl_max, noise_diverged_at IS NOT NULL AS changed
FROM eval WHERE method_kind = 'full' AND noise_kl IS NOT NULL
UNION ALL
SELECT DISTINCT model, dtype, 'computed in ' || noise_dtype AS change, task, sample_id, turn,
       metric <> 'none' AS scored, dtype_noise_kl, dtype_noise_kl_max, dtype_noise_diverged_at IS NOT NULL
FROM eval WHERE method_kind = 'full' AND dtype_noise_kl IS NOT NULL
ORDER BY model, dtype, change DESC, task, sample_id, turn;

-- name: output_lengths
-- Every scored answer's length in tokens (new_tokens: up to and with its EOS) beside the full cache's answer to
-- the same prompt (sample, question mode, turn), and the decoding cap it ran under (max_new_tokens): an answer of
-- the cap's length ended there, cut or just fitting.
WITH scored AS (SELECT * FROM eval WHERE metric <> 'none'),
reference AS (
    SELECT model, sample_id, question_mode, turn, new_tokens AS full_tokens FROM scored WHERE method_kind = 'full'
)
SELECT model, task, context_tokens, question_mode, method, method_kind, budget, sample_id, turn, max_new_tokens,
       new_tokens, full_tokens, score
FROM scored JOIN reference USING (model, sample_id, question_mode, turn)
ORDER BY model, task, context_tokens, method, budget DESC, sample_id, question_mode, turn;

-- name: posthoc_reads
-- What one decode step reads and what is stored, per block-sparse or cross-layer method (and SnapKV evicting to
-- the same budget, for comparison), budget and context: shares of the context, from the rows' cache statistics.
SELECT model, method, method_kind, budget, context_tokens,
       avg(kv_read_fraction) AS read_share, avg(kv_read_mean) AS read_tokens_per_head,
       avg(1 / compression_vs_bf16) AS stored_share_bf16, count(*) AS rows
FROM eval
WHERE method_kind IN ('block_sparse', 'cross_layer')
   OR (press = 'SnapKVPress' AND wrapper IS NULL AND scheme IS NULL)
GROUP BY ALL ORDER BY model, method, budget DESC, context_tokens;

-- name: ruler
-- RULER's tasks (task kind ruler), one row per answer beside the full cache's answer to the same prompt, per
-- RULER task, context length (RULER's max_seq_length) and question mode. score is RULER's metric of the task
-- (string_match_all: the share of the wanted values the answer holds; string_match_part: any of them).
WITH scored AS (SELECT * FROM eval WHERE task_kind = 'ruler' AND metric <> 'none'),
reference AS (
    SELECT model, sample_id, question_mode, turn, score AS full_score FROM scored WHERE method_kind = 'full'
)
SELECT model, ruler_task, task, context_tokens, question_mode, method, method_kind, budget,
       1 / compression_vs_bf16 AS kv_fraction_bf16, sample_id, score, full_score
FROM scored JOIN reference USING (model, sample_id, question_mode, turn)
ORDER BY model, context_tokens, question_mode, ruler_task, method, budget DESC, sample_id;

-- name: agreement
-- Tasks scored by agreement with the full cache (metric agreement or agreement_f1: a workload without references):
-- a compressed answer scores 1 when it is the full cache's answer to the same prompt after normalisation
-- (agreement_f1: its token F1 against that answer), so 1 − score is the share of answers the compression changed;
-- kl_vs_full is the per-token KL along the full cache's answer.
SELECT model, shape, task, metric, context_tokens, question_mode, method, budget, sample_id, turn, score, kl_vs_full
FROM eval WHERE metric IN ('agreement', 'agreement_f1') AND method_kind <> 'full'
ORDER BY model, shape, question_mode, method, budget DESC, sample_id, turn;

-- name: serving
-- Your serving engine (kvlab.steps.serve): each answer of a serving engine's cache (the model `<model>@<engine>`) beside
-- the answer of kvlab's simulation of that cache (the engine method's kvlab_twin; kvlab's full cache beside the
-- engine's default one) to the same prompt (task, length, sample, turn; question mode agnostic), in the engine job's
-- draw order. same_answer: 1 where the two predictions are equal, on scored tasks (NULL on prose, which answers nothing);
-- each side's KL is against its own engine's full cache.
SELECT e.model AS engine_model, e.engine, e.kvlab_model AS model, e.shape, e.task, e.context_tokens, e.method, e.scheme,
       e.kvlab_twin, e.sample_id, e.turn, e.draw, e.metric,
       CASE WHEN e.metric <> 'none' THEN CAST(e.prediction = o.prediction AS DOUBLE) END AS same_answer,
       e.score AS engine_score, o.score AS kvlab_score, e.kl_vs_full AS engine_kl, o.kl_vs_full AS kvlab_kl,
       e.kv_bytes / e.kv_tokens_mean AS engine_token_bytes, o.kv_bytes / o.kv_tokens_mean AS kvlab_token_bytes
FROM eval e JOIN eval o ON o.model = e.kvlab_model AND o.method = e.kvlab_twin AND o.task = e.task
     AND o.context_tokens = e.context_tokens AND o.sample_id = e.sample_id AND o.turn = e.turn AND o.question_mode = 'agnostic'
WHERE e.engine IS NOT NULL AND e.question_mode = 'agnostic'
ORDER BY engine_model, e.method, e.task, e.context_tokens, e.draw, e.turn;
