#!/usr/bin/env bash
# Seconds per scored row of evaluate jobs at an older commit and at this checkout, back to back on this machine, for
# changes that keep the dependencies (speed_ab.sh builds the old side its own venv instead). The old side is a git
# worktree whose src/ goes first on PYTHONPATH, run by this checkout's venv; kvlab.kernels (mapped by the editable
# install) is this checkout's, so the A/B is of src/ alone. Each job is `TASK CTX SAMPLES` (SAMPLES: bench_eval's
# --samples, per context length and depth), of this checkout's config.yaml for the new side and the old commit's
# for the old. Rows: results/bench/eval/ab-<task>-<old|new>.parquet (and .rows.parquet); a table at the end.
#   bash benchmarks/ab_jobs.sh OLD_COMMIT "niah_single 1024 1" "prose_kl 512 4"
# Needs the model and its calibration here (snakemake --cores 2 results/calibration/qwen2.5-0.5b).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$1
shift
ROOT=$PWD
WT=${AB_WORKTREE:-/tmp/kvlab-ab-$OLD}
MODEL=$ROOT/resources/models/qwen2.5-0.5b
CALIB=$ROOT/results/calibration/qwen2.5-0.5b
OUT=$ROOT/results/bench/eval
[ -d "$CALIB" ] || { echo "no $CALIB: run snakemake --cores 2 results/calibration/qwen2.5-0.5b first"; exit 2; }
[ -d "$WT" ] || git worktree add -f "$WT" "$OLD" >/dev/null
mkdir -p "$OUT"
NEW=$(git rev-parse --short HEAD)
files=()
for job in "$@"; do
  read -r task ctx samples <<<"$job"
  for side in old new; do
    if [ $side = old ]; then src=$WT/src config=$WT/config.yaml label="$OLD"; else src=$ROOT/src config=$ROOT/config.yaml label="$NEW"; fi
    out=$OUT/ab-$task-$side.parquet
    echo "timing $task@$ctx ($samples per length and depth) at $label"
    (cd /tmp && PYTHONPATH=$src "$ROOT/.venv/bin/python" -m kvlab.tools.bench_eval --model-dir "$MODEL" --calibration "$CALIB" \
      --task "$task" --ctx "$ctx" --samples "$samples" --config "$config" --label "$label" --out "$out") > "${out%.parquet}.log" 2>&1
    files+=("$out")
  done
done
"$ROOT/.venv/bin/python" - "${files[@]}" <<'PY'
import sys
import pandas as pd
t = pd.concat(pd.read_parquet(f) for f in sys.argv[1:])
cols = ["label", "task", "context_tokens", "samples", "rows", "wall_s", "s_per_row", "compress_s", "decode_s",
        "teacher_forced_s", "peak_rss_mb"]
print(t[cols].to_string(index=False))
PY
