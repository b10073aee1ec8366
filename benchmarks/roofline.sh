#!/usr/bin/env bash
# The roofline issue's ratio, wall time over matmul floor (kvlab.profile_eval), of three evaluate jobs' first rounds
# in each dtype given: prose_kl at 512 (10 samples), variable_tracking at 1K (4) and RULER's niah_single_2 at 1K
# (preset study, 2), each batched as the job batches it. bf16 is timed where the CPU runs it natively (else the
# rows say fp32 only), with the memory roof beside it (wall over roofline_floor_s: every matmul at the slower of its
# flops at the peak and its bytes at the streaming bandwidth). Rows: results/profile/roofline-{task}-{ctx}-{dtype}.parquet;
# a table at the end.
#   bash benchmarks/roofline.sh [DTYPE ...]      (default: bfloat16 float32; needs the model and its calibration:
#                                                 snakemake --cores 2 results/calibration/qwen2.5-0.5b)
# A job's first round takes minutes (prose_kl in bf16 on 2 cores: 4.5 min plain, 7 min more counted and profiled).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=resources/models/qwen2.5-0.5b
CAL=results/calibration/qwen2.5-0.5b
OUT=results/profile
[ -d "$MODEL" ] && [ -d "$CAL" ] || { echo "no $MODEL or $CAL: snakemake --cores 2 $CAL"; exit 2; }
mkdir -p "$OUT"
DTYPES=("$@")
[ ${#DTYPES[@]} -gt 0 ] || DTYPES=(bfloat16 float32)
JOBS=("prose_kl 512 10 default" "variable_tracking 1024 4 default" "ruler_niah_single_2 1024 2 study")
for dtype in "${DTYPES[@]}"; do
  for job in "${JOBS[@]}"; do
    read -r task ctx samples preset <<< "$job"
    echo "$task at $ctx, $samples samples, $dtype"
    .venv/bin/python -m kvlab.profile_eval --model-dir "$MODEL" --calibration "$CAL" --task "$task" --ctx "$ctx" \
      --samples "$samples" --preset "$preset" --dtype "$dtype" --out "$OUT/roofline-$task-$ctx-$dtype.parquet" \
      > "$OUT/roofline-$task-$ctx-$dtype.log" 2>&1
  done
done
.venv/bin/python - "${DTYPES[@]}" <<'PY'
import sys, glob
import pandas as pd
rows = pd.concat(pd.read_parquet(f) for d in sys.argv[1:] for f in glob.glob(f"results/profile/roofline-*-{d}.parquet"))
by = rows.pivot_table(index=["task", "context_tokens", "samples", "dtype", "cpu_kind"], columns="name", values=["seconds", "value"],
                      aggfunc="first")
table = pd.DataFrame({"wall_s": by[("seconds", "wall_s")], "matmul_floor_s": by[("seconds", "matmul_floor_s")],
                      "wall_over_floor": by[("value", "wall_over_floor")], "matmul_gflops": by[("value", "matmul_gflops")],
                      "peak_gflops": by[("value", "peak_matmul_gflops")], "roofline_floor_s": by[("seconds", "roofline_floor_s")],
                      "wall_over_roofline": by[("value", "wall_over_roofline")], "bandwidth_gbs": by[("value", "peak_bandwidth_gbs")]})
print(table.round(2).to_string())
PY
