#!/usr/bin/env bash
# The GPU device check (README "GPU check"): on a bare GPU machine with torch and triton, install kvlab and the
# wheels in gpu/wheels/ (make gpu-wheels), then run the CUDA tests, the decode-kernel benchmark, one end-to-end
# decode point and one 8K evaluation sample's peak memory beside kvlab.state.memory's prediction, and print one screen of
# results against the targets. Each stage has a time limit (<= 8 min in
# all); a failed stage does not stop the next. --dry-run: no GPU, no install; the CUDA tests are only collected,
# the benchmark and the decode point run on the CPU at toy sizes, and the summary reads their rows.
set -uo pipefail

usage="usage: gpu/check.sh [--dry-run] [--out DIR]"
dry=0
out=${OUT:-gpu-out}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    --out) [ $# -ge 2 ] || { echo "gpu/check.sh: --out needs a folder; $usage" >&2; exit 2; }; out=$2; shift ;;
    *) echo "gpu/check.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
rm -f "$out/kernels.parquet" "$out/e2e.parquet" "$out/memory.parquet"  # the summary reads only this run's rows
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

tests=(tests/test_decode_attention.py tests/test_triton_quant.py)  # CUDA tests needing no kvpress, snakemake, duckdb
if [ $dry = 1 ]; then
  export TRITON_INTERPRET=1  # Triton kernels in its CPU interpreter
  tests_cmd=("$py" -m pytest -q -p no:cacheprovider --collect-only "${tests[@]}")
  bench_args=(--device cpu --dtype float32 --contexts 128 --batches 1 --repeats 1)
  e2e_args=(--device cpu --dtype float32 --context 64 --batch 2 --new-tokens 4 --layers 2)
  mem_args=(--device cpu --dtype float32 --context 384 --layers 2)
  at=(--context 128 --batch 1)
else
  "$py" -c 'import xdist' 2>/dev/null && workers=(-n 8) || workers=()  # pytest-xdist: kernels compiled in parallel
  tests_cmd=("$py" -m pytest -q -p no:cacheprovider "${workers[@]}" "${tests[@]}")
  bench_args=(--contexts 32768 --batches 1,8)
  e2e_args=(--context 32768 --batch 8)
  mem_args=(--context 8192)
  at=(--context 32768 --batch 8)
fi

failed=()
stage() {  # name, seconds, command...: run with its limit, its output in $out/NAME.log; the tail shown on failure
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    echo "   ok in $((SECONDS - t0)) s; $(tail -n 1 "$out/$name.log")"
  else
    echo "   FAILED (exit $rc$([ $rc = 124 ] && echo ", past ${limit}s")) after $((SECONDS - t0)) s; the end of $name.log:"
    tail -n 15 "$out/$name.log" | sed 's/^/   | /'
    failed+=("$name")
  fi
}

install() {
  local site=/tmp/kvlab-site
  compgen -G "gpu/wheels/*.whl" >/dev/null || { echo "gpu/wheels/ holds no wheels; fill it with: make gpu-wheels"; return 1; }
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" gpu/wheels/*.whl . || return 1
  echo "installed in $site: $(ls gpu/wheels)"
}

if [ $dry = 1 ]; then
  echo "== install: skipped in a dry run (would install gpu/wheels/*.whl and kvlab, --no-deps, into /tmp/kvlab-site)"
else
  echo "== install"
  install || { echo "gpu/check.sh: install failed"; exit 1; }
  export PYTHONPATH=/tmp/kvlab-site
fi
"$py" -c 'import torch, triton, transformers; print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"))'
stage tests 150 "${tests_cmd[@]}"
stage kernels 120 "$py" -m kvlab.steps.kernel_bench --shape 8,32,128 --shape 2,14,64 "${bench_args[@]}" --out "$out/kernels.parquet"
stage e2e 120 "$py" -m kvlab.tools.gpu_check e2e "${e2e_args[@]}" --out "$out/e2e.parquet"
stage memory 180 "$py" -m kvlab.tools.gpu_check memory "${mem_args[@]}" --out "$out/memory.parquet"
echo "== summary"
timeout 30 "$py" -m kvlab.tools.gpu_check summary --kernels "$out/kernels.parquet" --e2e "$out/e2e.parquet" \
  --memory "$out/memory.parquet" "${at[@]}" | tee "$out/summary.txt" || failed+=(summary)
if [ ${#failed[@]} -gt 0 ]; then
  echo "stages failed: ${failed[*]} (logs in $out)"
  exit 1
fi
echo "all stages ran (logs in $out)"
