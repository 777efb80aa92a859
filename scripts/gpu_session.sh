#!/usr/bin/env bash
# A whole GPU session in one command, step by step, within a time budget (docs/gpu.md):
#   BUDGET_S=540 bash scripts/gpu_session.sh OUT [STEP ...]
# Steps, in this order (default: all of them):
#   tests       the GPU tests (pytest -m gpu, scripts/gpu_tests.sh)                 ~3-4 min
#   phases      gpu-bench, 8B shape, TTFT per cache phase, 2k/8k/32k prompts,
#               none,ours,cpu,vtier-fs,vtier-ours                                    ~8.5 min
#   throughput  gpu-bench, 8B shape, throughput, CPU tier 0.5x and 2x the working set,
#               none + ours,ours-wb,cpu,vtier-fs,vtier-ours at each size             ~6 min
#   32b         gpu-bench, 32B shape, none,cpu,ours at 2k/8k, cold,cpu,recompute,disk ~2.5 min
#   sweep       gpu-bench prefill sweep (issue 15): 1B, 8B, 32B shapes, none,cpu,ours, hit rates
#               0-100%, unique 512-token prompts, prefix caching off                ~7 min
#               (SWEEP_ARGS adds options to it alone: --profile cprofile,py-spy,
#               --sweep-chunk-tokens 16,64,256, --sweep-shapes 8b ...)
# Every step writes into OUT as it goes (a log per step, JUnit XML, gpu-bench's JSON after each
# config), so a run cut short still returns what it measured. A step starts only if the budget
# left covers its minimum (printed otherwise); gpu-bench gets the rest of the budget and skips
# the configs that would not fit; each step is killed (with its engine processes) when the
# budget runs out. BENCH_ARGS adds options to every gpu-bench step, after the step's own (the
# last wins: BENCH_ARGS="--promote always"; a CPU smoke run of the script itself:
# BENCH_ARGS="--cpu-platform --shape tiny --lengths 256,1024 ...", docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: BUDGET_S=540 bash scripts/gpu_session.sh OUT [tests|phases|throughput|32b ...]}
shift
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests phases throughput 32b)
BUDGET_S=${BUDGET_S:-540}
TAG=${TAG:-h200}
MARGIN_S=15  # for gpu-bench to write its table and exit after its last step
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for step in "${STEPS[@]}"; do
  case $step in tests|phases|throughput|32b|sweep) ;;
    *) echo "gpu_session: unknown step '$step' (tests, phases, throughput, 32b, sweep)" >&2; exit 2 ;;
  esac
done
source scripts/gpu_env.sh
nvidia-smi -L || true
# shellcheck disable=SC2206
extra=(${BENCH_ARGS:-})  # last on gpu-bench's command line: they override the step's options
# shellcheck disable=SC2206
sweep_extra=(${SWEEP_ARGS:-})  # the sweep step's own extra options (before BENCH_ARGS)
summary="$OUT/session.txt"
echo "session $(date -u +%FT%TZ) budget ${BUDGET_S}s steps: ${STEPS[*]}" >> "$summary"

left() { echo $((BUDGET_S - SECONDS)); }

# run STEP MIN_S MAX_S CMD...: run CMD if at least MIN_S seconds are left, killed (the whole
# process group: vLLM's engine processes too) after MAX_S seconds or when the budget runs out
run() {
  local step=$1 min_s=$2 max_s=$3
  shift 3
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt "$min_s" ]; then
    echo "[session] $step skipped: ${remaining}s of the budget left, it needs at least ${min_s}s" \
      | tee -a "$summary"
    return 0
  fi
  local limit=$((remaining < max_s ? remaining : max_s))
  echo "[session] $step: start, ${remaining}s left, at most ${limit}s: $*" | tee -a "$summary"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$step.log"
  rc=${PIPESTATUS[0]}
  echo "[session] $step: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (time ran out: killed)')" \
    | tee -a "$summary"
}

for step in "${STEPS[@]}"; do
  # gpu-bench, given the budget left at the step's start minus the margin
  # (the 8B phases' filler prompts write ~9 GB just before the disk phase: ~9 s at 1 GB/s)
  bench=(python3 -P -m tiering.gpu_bench --out "$OUT" --budget-s $(($(left) - MARGIN_S))
         --settle-max-s 60)
  case $step in
    tests)
      # at most TESTS_MAX_S (300): a hanging test must not take the steps after it
      run tests 120 "${TESTS_MAX_S:-300}" env OUT="$OUT" bash scripts/gpu_tests.sh ;;
    phases)
      # none first: every other row is compared with its outputs
      run phases 120 "$BUDGET_S" "${bench[@]}" --tag "${TAG}phases" --shape 8b --lengths 2048,8192,32768 \
        --configs none,ours,cpu,vtier-fs,vtier-ours \
        --phases cold,gpu,cpu,recompute,disk,restart "${extra[@]}" ;;
    throughput)
      run throughput 90 "$BUDGET_S" "${bench[@]}" --tag "${TAG}tp" --shape 8b --phases throughput \
        --configs none,ours,ours-wb,cpu,vtier-fs,vtier-ours --tp-cpu-fraction 0.5,2 "${extra[@]}" ;;
    32b)
      run 32b 90 "$BUDGET_S" "${bench[@]}" --tag "$TAG" --shape 32b --lengths 2048,8192 --configs none,cpu,ours \
        --phases cold,cpu,recompute,disk "${extra[@]}" ;;
    sweep)
      run sweep 90 "$BUDGET_S" "${bench[@]}" --tag "$TAG" --phases prefill-sweep \
        --sweep-shapes 1b,8b,32b --sweep-configs none,cpu,ours "${sweep_extra[@]}" "${extra[@]}" ;;
  esac
done
echo "[session] done in ${SECONDS}s; results in $OUT" | tee -a "$summary"
ls -l "$OUT"
