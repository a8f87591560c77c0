#!/usr/bin/env bash
# The GPU run, in one call: GPU-marked tests, then the benchmarks, results under $OUT, a short
# table last. Run from the repository root on a CUDA machine:
#   HISPARSE_COMMIT=$(git rev-parse --short=12 HEAD) OUT=out bash benchmarks/gpu_suite.sh [bench ...]
# (set HISPARSE_COMMIT where you run git: a copied tree's .git, if any, may be older than its files)
# Runs with ${PYTHON:-python3}, so `PYTHON=.venv/bin/python bash benchmarks/gpu_suite.sh` uses that venv.
# Benchmarks default to every benchmarks/bench_*.py; name some (e.g. `resolve`) to run fewer, `none` for none;
# TESTS=path narrows the tests (TESTS=none skips them); BENCH_TIMEOUT caps each benchmark (s);
# HOST_GROW_GIB (default 64, 0 = off) pins and frees that much host memory first: the lent machines'
# RAM grows as it is used (3 s per 8 GiB), so a large host pool then finds it there.
# ATTENTION_TIMER=cudagraph passes --cudagraph to the attention benchmarks (graph replays, as the
# decode loop runs them; default do_bench); PREFETCH_ARGS adds options to bench_prefetch (e.g.
# "--hidden 7168 --intermediate 18432 --batches 32 128 --prefetch-programs 32 128"); RESOLVE_ARGS likewise
# to bench_resolve ("--decode-like" runs its points instead of the sweep: resolve_layers.csv, and no
# resolve.csv or its target lines); SWEEP_ARGS (e.g. "--config experiments/configs/h200.toml --kind decode
# --runs-per-process 3") first runs experiments.sweep with them into $OUT/sweep/ (every point: the copied
# results/ are not read), capped by SWEEP_TIMEOUT (s, default 540; its lines reach the log as they come, so a
# call stopped from outside keeps them); with --draw-cache among them the serving
# requests' selections are drawn beside the GPU tests (--draw-only), not after them. NCU=1 first profiles one launch of each
# of NCU_TARGETS (experiments/tools/ncu_kernels.py arguments, "|"-separated; default the resolve at 20% and
# 100% misses, and DSA decode at batch 64) with Nsight Compute: $OUT/ncu_*.ncu-rep, with each report's
# details and SASS source view as text beside it.
# $OUT/gpu_monitor.txt samples clocks, temperature and power every 0.5 s (runs print wall-clock times).
# Copy $OUT/*.csv into results/ afterwards (rows carry the GPU, versions and commit).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$OUT/gpu_log.txt"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  echo "commit ${HISPARSE_COMMIT:-unknown}"
} 2>&1 | tee "$log"

# The GPU's clocks, temperature and power every half second while the suite runs, in $OUT/gpu_monitor.txt,
# to tell a slower run from a slower clock (the fields the driver offers; event reasons where it has them).
query=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$query --format=csv >/dev/null 2>&1 || query=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw
nvidia-smi --query-gpu=$query --format=csv,nounits -lms 500 > "$OUT/gpu_monitor.txt" 2>&1 &
monitor=$!
draws=
trap 'kill $monitor $draws 2>/dev/null' EXIT

# capped SECONDS CMD...: CMD under a time limit, saying in the output when the limit stopped it
# (rows a benchmark wrote before then are kept)
capped() {
  local limit=$1; shift
  timeout "$limit" "$@"
  local rc=$?
  [ $rc = 124 ] && echo "!! stopped at its time limit of $limit s: $*"
  return $rc
}

status=0
if [ "${HOST_GROW_GIB:-64}" != 0 ]; then
  "$py" -c "import time, torch; t = time.time(); b = torch.empty(${HOST_GROW_GIB:-64} << 30, dtype=torch.uint8, \
pin_memory=True); print(f'host memory: pinned and freed ${HOST_GROW_GIB:-64} GiB in {time.time() - t:.0f} s')" \
    2>&1 | tail -1 | tee -a "$log"
fi
# a sweep with a draw cache (written "--draw-cache DIR") draws its serving requests' selections on the
# host's cores beside the GPU tests
if [ -n "${SWEEP_ARGS:-}" ] && [[ " ${SWEEP_ARGS} " == *" --draw-cache "* ]]; then
  read -r -a sweep <<< "$SWEEP_ARGS"
  CUDA_VISIBLE_DEVICES= timeout "${SWEEP_TIMEOUT:-540}" "$py" -m experiments.sweep --out "$OUT/sweep" "${sweep[@]}" \
    --draw-only > "$OUT/draws_log.txt" 2>&1 &      # the host's cores only: no CUDA context beside the tests
  draws=$!
fi
if [ "${TESTS:-tests}" != none ]; then
  "$py" -m pytest -m gpu -q -p no:cacheprovider --durations=5 ${TESTS:-tests} 2>&1 | tee -a "$log" || status=1
fi

benches=("$@")
if [ ${#benches[@]} -eq 0 ]; then
  for f in benchmarks/bench_*.py; do b=${f#benchmarks/bench_}; benches+=("${b%.py}"); done
fi
if [ -n "$draws" ]; then
  wait "$draws" || status=1
  tail -2 "$OUT/draws_log.txt" | tee -a "$log"
fi
if [ -n "${SWEEP_ARGS:-}" ]; then
  echo "== experiments.sweep ${SWEEP_ARGS} --out $OUT/sweep" | tee -a "$log"
  read -r -a sweep <<< "$SWEEP_ARGS"
  capped "${SWEEP_TIMEOUT:-540}" "$py" -m experiments.sweep --out "$OUT/sweep" "${sweep[@]}" 2>&1 | grep --line-buffered -v Warning \
    | tee -a "$log" || status=1
fi
if [ "${NCU:-0}" = 1 ]; then
  # Nsight Compute, one launch per target (experiments/tools/ncu_kernels.py): NCU_TARGETS, "|"-separated argument lists
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
  IFS='|' read -r -a targets <<< "${NCU_TARGETS:-resolve --miss 0.2|resolve --miss 1.0|dsa --batch 64}"
  if [ ! -x "$ncu_bin" ]; then
    echo "NCU=1: no ncu (Nsight Compute) on PATH or under /opt/nvidia/nsight-compute" | tee -a "$log"
    status=1
    targets=()
  fi
  for t in "${targets[@]}"; do
    name=$(echo "ncu $t" | tr -s ' -' '_' | tr -d '.')
    echo "== $name ($ncu_bin)" | tee -a "$log"
    read -r -a targs <<< "$t"
    capped "${BENCH_TIMEOUT:-300}" "$ncu_bin" --profile-from-start off --set full --import-source yes \
      --clock-control none -f -o "$OUT/$name" "$py" -m experiments.tools.ncu_kernels "${targs[@]}" 2>&1 | tail -3 | tee -a "$log" \
      || status=1
    [ -f "$OUT/$name.ncu-rep" ] || { echo "$name: no report" | tee -a "$log"; status=1; continue; }
    "$ncu_bin" -i "$OUT/$name.ncu-rep" --page details > "$OUT/$name.details.txt" 2>&1
    "$ncu_bin" -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>&1
    grep -E "Duration|Elapsed Cycles|Registers Per|Achieved Occupancy|L1/TEX Hit|Mem Busy|Issue Slots Busy" \
      "$OUT/$name.details.txt" | head -12 | tee -a "$log"
  done
fi
for b in "${benches[@]}"; do
  [ "$b" = none ] && continue
  echo "== bench_$b" | tee -a "$log"
  extra=()
  if [[ "$b" == attention_* && "${ATTENTION_TIMER:-do_bench}" == cudagraph ]]; then extra=(--cudagraph); fi
  if [[ "$b" == prefetch ]]; then read -r -a extra <<< "${PREFETCH_ARGS:-}"; fi
  if [[ "$b" == resolve ]]; then read -r -a extra <<< "${RESOLVE_ARGS:-}"; fi
  capped "${BENCH_TIMEOUT:-300}" "$py" -m "benchmarks.bench_$b" --out "$OUT" "${extra[@]}" 2>&1 | tee -a "$log" || status=1
done
"$py" -m benchmarks.summary "$OUT" 2>&1 | tee -a "$log"
exit $status
