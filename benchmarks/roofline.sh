#!/usr/bin/env bash
# The roofline issue's ratio, wall time over matmul floor (kvlab.tools.profile_eval), of three evaluate jobs' first rounds
# in each dtype given: prose_kl at 512 (10 samples), variable_tracking at 1K (4) and RULER's niah_single_2 at 1K
# (preset study, 2), each batched as the job batches it. bf16 is timed where the CPU runs it natively (else the
# rows say fp32 only), with the memory roof beside it (wall over roofline_floor_s: every matmul at the slower of its
# flops at the peak and its bytes at the streaming bandwidth), and the floor that adds attention's own products (scores
# and weighted values, inside SDPA) to the matmuls'. Each job is timed REPEATS times (default 3): a ratio is the
# median run's, [fastest, slowest] beside it. Rows: results/profile/roofline-{task}-{ctx}-{dtype}.parquet; a table
# at the end.
#   [REPEATS=3] bash benchmarks/roofline.sh [DTYPE ...]   (default: bfloat16 float32; needs the model and its calibration:
#                                                 snakemake --cores 2 results/calibration/qwen2.5-0.5b)
# A job's first round takes minutes (prose_kl in bf16 on 2 cores: 2.7 min a run, 7 min more counted and profiled).
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
    .venv/bin/python -m kvlab.tools.profile_eval --model-dir "$MODEL" --calibration "$CAL" --task "$task" --ctx "$ctx" \
      --samples "$samples" --preset "$preset" --dtype "$dtype" --repeats "${REPEATS:-3}" --out "$OUT/roofline-$task-$ctx-$dtype.parquet" \
      > "$OUT/roofline-$task-$ctx-$dtype.log" 2>&1
  done
done
.venv/bin/python - "${DTYPES[@]}" <<'PY'
import sys, glob
import pandas as pd
rows = pd.concat(pd.read_parquet(f) for d in sys.argv[1:] for f in glob.glob(f"results/profile/roofline-*-{d}.parquet"))
by = rows.pivot_table(index=["task", "context_tokens", "samples", "dtype", "cpu_kind"], columns="name",
                      values=["seconds", "value", "low", "high"], aggfunc="first", dropna=False)
by = by[by[("seconds", "wall_s")].notna()]  # dropna=False keeps a column the rows of an older run lack, and every index combination
def spread(name):  # median run's ratio [fastest, slowest]
    return [f"{m:.2f} [{lo:.2f}, {hi:.2f}]" for m, lo, hi in zip(by[("value", name)], by[("low", name)], by[("high", name)])]
table = pd.DataFrame({"wall_s": by[("seconds", "wall_s")].round(1), "matmul_floor_s": by[("seconds", "matmul_floor_s")].round(1),
                      "wall_over_floor": spread("wall_over_floor"),
                      "with_attention_floor_s": by[("seconds", "matmul_attention_floor_s")].round(1),
                      "wall_over_with_attention": spread("wall_over_matmul_attention_floor"),
                      "matmul_gflops": by[("value", "matmul_gflops")].round(0), "peak_gflops": by[("value", "peak_matmul_gflops")].round(0),
                      "wall_over_roofline": spread("wall_over_roofline")}, index=by.index)
print(table.to_string())
PY
