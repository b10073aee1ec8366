#!/usr/bin/env bash
# One evaluate job, timed as the two CPU kinds kvlab meets run it, back to back on this machine: bf16 where bf16
# matmuls run in hardware (this CPU as it is, dtype bfloat16), and an AVX2-only CPU (torch's ATen kernels held to
# AVX2 by ATEN_CPU_CAPABILITY=avx2, oneDNN's by ONEDNN_MAX_CPU_ISA=AVX2, dtype float32, what `dtype: auto` picks
# there). The ratio of the two wall times scales a default run measured in bf16 to an AVX2 machine.
# Needs the model and its calibration (snakemake --cores 2 results/calibration/qwen2.5-0.5b).
#   bash benchmarks/cpu_kinds.sh [TASK CTX SAMPLES]     (default: niah_single 1024 1, the default's first round)
# Rows: results/bench/cpu_kinds/<kind>.parquet; the table: results/bench/cpu_kinds/summary.tsv.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${1:-niah_single}
CTX=${2:-1024}
SAMPLES=${3:-1}
OUT=results/bench/cpu_kinds
MODEL=resources/models/qwen2.5-0.5b
CALIB=results/calibration/qwen2.5-0.5b
[ -d "$CALIB" ] || { echo "no $CALIB: run snakemake --cores 2 $CALIB first"; exit 2; }
mkdir -p "$OUT"
run() {  # kind dtype [env...]
  local kind=$1 dtype=$2
  shift 2
  echo "timing $TASK@$CTX ($SAMPLES per depth) as $kind ($dtype)"
  env "$@" .venv/bin/python -m kvlab.tools.bench_eval --model-dir "$MODEL" --calibration "$CALIB" --task "$TASK" --ctx "$CTX" \
    --samples "$SAMPLES" --dtype "$dtype" --label "$kind" --out "$OUT/$kind.parquet"
}
run bf16-capable bfloat16
run avx2-fp32 float32 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
.venv/bin/python - "$OUT" <<'EOF'
import sys
from pathlib import Path

import pandas as pd

out = Path(sys.argv[1])
t = pd.concat([pd.read_parquet(out / f"{k}.parquet") for k in ("bf16-capable", "avx2-fp32")], ignore_index=True)
t["ratio_to_bf16"] = t["wall_s"] / t["wall_s"].iloc[0]
t.to_csv(out / "summary.tsv", sep="\t", index=False)
print(t[["label", "dtype", "threads", "samples", "rows", "wall_s", "ratio_to_bf16"]].to_string(index=False))
EOF
