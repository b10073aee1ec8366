#!/usr/bin/env bash
# Seconds per scored row of one evaluate job (benchmarks/speed_ab.yaml), at an old commit and at this checkout,
# back to back on this machine (kvlab.tools.bench_eval). The old side runs the old commit's own kvlab.tools.bench_eval (every
# commit since e2a8a92 has it, with these arguments) in a worktree with that worktree's own venv (make setup
# there); each side runs float32 and the config's `auto` dtype (bf16 where the CPU has it). Rows:
# results/bench/eval/ab-*.parquet; a table at the end, each row's speed-up against the old side in its dtype.
#   bash benchmarks/speed_ab.sh [OLD_COMMIT]     (default e2a8a92, the roofline issue's baseline; needs the model
#                                                  acquired here: snakemake --cores 2 resources/models/qwen2.5-0.5b)
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-e2a8a92}
WT=${AB_WORKTREE:-../kvlab-ab-$OLD}
ROOT=$PWD
MODEL=resources/models/qwen2.5-0.5b
OUT=$ROOT/results/bench/eval
[ -d "$MODEL" ] || { echo "no $MODEL: acquire it first (snakemake --cores 2 $MODEL)"; exit 2; }
[ -d "$WT" ] || git worktree add -f "$WT" "$OLD"
make -C "$WT" setup >/dev/null
mkdir -p "$OUT"
args=(--model-dir "$ROOT/$MODEL" --task variable_tracking --ctx 1024 --config "$ROOT/benchmarks/speed_ab.yaml")
NEW=$(git rev-parse --short HEAD)
echo "timing $OLD (float32, auto), then $NEW (float32, auto); logs: $OUT/ab-*.log"
(cd "$WT" && .venv/bin/python -m kvlab.tools.bench_eval "${args[@]}" --dtype float32 --label "$OLD float32" \
  --out "$OUT/ab-old-fp32.parquet") > "$OUT/ab-old-fp32.log" 2>&1
(cd "$WT" && .venv/bin/python -m kvlab.tools.bench_eval "${args[@]}" --label "$OLD auto" \
  --out "$OUT/ab-old-auto.parquet") > "$OUT/ab-old-auto.log" 2>&1
.venv/bin/python -m kvlab.tools.bench_eval "${args[@]}" --dtype float32 --label "$NEW float32" --out "$OUT/ab-new-fp32.parquet" \
  > "$OUT/ab-new-fp32.log" 2>&1
.venv/bin/python -m kvlab.tools.bench_eval "${args[@]}" --label "$NEW auto" --out "$OUT/ab-new-auto.parquet" > "$OUT/ab-new-auto.log" 2>&1
.venv/bin/python - <<'PY'
import pandas as pd
t = pd.concat(pd.read_parquet(f"results/bench/eval/ab-{s}.parquet") for s in ("old-fp32", "old-auto", "new-fp32", "new-auto"))
old = t.iloc[:2].set_index("dtype")["s_per_row"]  # the old side's seconds per row in each dtype
t["x_fewer_s_per_row"] = t["dtype"].map(old) / t["s_per_row"]
print(t[["label", "rows", "wall_s", "s_per_row", "decode_s", "teacher_forced_s", "dtype", "x_fewer_s_per_row"]].to_string(index=False))
PY
