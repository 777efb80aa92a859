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
#   disk-hit    docs/bench_disk_hit.py: a 32k prompt's disk hit (2048 chunks of 2 MiB, the 8B
#               shape's rows) through our spec's manager and through vLLM's
#               TieringOffloadingSpec over our FileTier, first and after a restart, on this
#               machine's disk and then on the RAM disk, fio reading the same slab file  ~2 min
#   disk-hit-ab docs/bench_disk_hit.py on both disks, ours only, a 16k prompt, one knob at a
#               time (DISKHIT_AB: run<MiB>:t<threads> ..., default 2/4/8 MiB runs at 8 threads,
#               4 and 2 MiB at 16): fio and plain preadv into distinct rows beside each  ~4 min
#   phases-ramdisk  gpu-bench, 8B, 2k/8k/32k, none,ours,vtier-fs, cold,recompute,disk,restart,
#               the file tiers on the RAM disk; then fio on it (OUT/fio_ramdisk.json)   ~4.5 min
#   throughput-wb   gpu-bench's throughput step for none,ours,ours-wb, CPU tier 0.5x, three
#               rounds an engine (one round swung +-15% between calls)           ~3.5 min
#   disk-sweep  gpu-bench prefill sweep with the disk holding the hits (issue 14 §3): 8B, 128
#               prompts, none,ours-disk at 0/50/100% on this machine's disk, then ours-disk
#               on the RAM disk (its none is the first one's); the advisor's decision lines
#               (VLLM_LOGGING_LEVEL=DEBUG) in OUT/disk_sweep_*_decisions.txt         ~5 min
#   copy-queue  docs/bench_copy_queue.py: does a queue of bulk loads hold up a small input copy
#               on the compute stream, and does feeding the loads in waves help (issue 15)  ~1 min
#   sweep-ab    the prefill sweep's 1B and 8B at 0/50/100%: none and ours-sched with the defaults
#               of now, then ours-sched with those before 2026-12-06 (max_loading_requests 256,
#               loads not fed: load_queue_bytes 0), with step traces                ~4.5 min
# The RAM disk: ext4 on a loop device over a file in /dev/shm (O_DIRECT works, as on NVMe),
# RAMDISK_GIB (default 40) or what /dev/shm has free less RAMDISK_SPARE_GIB (default 12, for the
# CPU tiers' shared memory); made by the first step that needs it, removed at exit. Needs root.
# fio: $FIO, else fio on PATH, else .device/fio/fio (scripts/build_fio.sh).
# Every step writes into OUT as it goes (a log per step, JUnit XML, gpu-bench's JSON after each
# config), so a run cut short still returns what it measured. A step starts only if the budget
# left covers its minimum (printed otherwise; STEP_MIN_S replaces every step's minimum, for a
# short call whose step is known to fit: 2026-12-07e's last call had 242 s, the sweep's minimum
# is 90 s a step, and a bare `timeout` around gpu-bench instead left its engine process holding
# the GPU's memory); gpu-bench gets the rest of the budget and skips
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
STEP_NAMES="tests, phases, throughput, 32b, sweep, disk-hit, disk-hit-ab, phases-ramdisk, throughput-wb, disk-sweep, copy-queue, sweep-ab"
BUDGET_S=${BUDGET_S:-540}
TAG=${TAG:-h200}
MARGIN_S=15  # for gpu-bench to write its table and exit after its last step
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for step in "${STEPS[@]}"; do
  case $step in tests|phases|throughput|32b|sweep|disk-hit|disk-hit-ab|phases-ramdisk|throughput-wb|disk-sweep|copy-queue|sweep-ab) ;;
    *) echo "gpu_session: unknown step '$step' ($STEP_NAMES)" >&2; exit 2 ;;
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
  local step=$1 min_s=${STEP_MIN_S:-$2} max_s=$3
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

# -- the RAM disk -------------------------------------------------------------------------------
ram_img="" ram_loop="" ram_mnt=""
ramdisk_down() {
  [ -n "$ram_mnt" ] && mountpoint -q "$ram_mnt" && umount "$ram_mnt"
  [ -n "$ram_loop" ] && losetup -d "$ram_loop"
  [ -n "$ram_img" ] && rm -f "$ram_img"
  [ -n "$ram_mnt" ] && rmdir "$ram_mnt" 2>/dev/null
  ram_img="" ram_loop="" ram_mnt=""
  return 0
}
trap ramdisk_down EXIT
trap 'exit 130' INT TERM
# ramdisk_up: mount it (once) at $ram_mnt; 1 with a line in the summary if it cannot be made
ramdisk_up() {
  [ -n "$ram_mnt" ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "[session] RAM disk: needs root (losetup, mount)" | tee -a "$summary"
    return 1
  fi
  local free_gib want
  free_gib=$(( $(df --output=avail -k /dev/shm | tail -1) / 1048576 ))
  want=${RAMDISK_GIB:-40}
  [ $((free_gib - ${RAMDISK_SPARE_GIB:-12})) -lt "$want" ] && want=$((free_gib - ${RAMDISK_SPARE_GIB:-12}))
  if [ "$want" -lt "${RAMDISK_MIN_GIB:-16}" ]; then
    echo "[session] RAM disk: /dev/shm has ${free_gib} GiB free, too little for a" \
      "${RAMDISK_MIN_GIB:-16} GiB disk beside the CPU tiers" | tee -a "$summary"
    return 1
  fi
  ram_img=/dev/shm/tiering-ramdisk-$$.img
  # discard: blocks freed by a config's removed folder go back to /dev/shm
  if truncate -s "${want}G" "$ram_img" && mkfs.ext4 -q -F "$ram_img" \
      && ram_loop=$(losetup -f --show "$ram_img") \
      && ram_mnt=$(mktemp -d -t tiering-ramdisk.XXXXXX) && mount -o discard "$ram_loop" "$ram_mnt"; then
    echo "[session] RAM disk: ext4 on $ram_loop over $ram_img (${want} GiB) at $ram_mnt" \
      | tee -a "$summary"
    return 0
  fi
  echo "[session] RAM disk: could not be made (see above)" | tee -a "$summary"
  ramdisk_down
  return 1
}

fio_bin=${FIO:-$(command -v fio || true)}
[ -z "$fio_bin" ] && [ -x .device/fio/fio ] && fio_bin=$PWD/.device/fio/fio
# a static fio carried xz-compressed (docs/gpu.md says how to build it): the GPU machine has none
if [ -z "$fio_bin" ] && [ -f .device/fio/fio.xz ]; then
  fio_bin=$(mktemp -t tiering-fio.XXXXXX) && xz -dc .device/fio/fio.xz > "$fio_bin" && chmod +x "$fio_bin"
fi
export TIERING_FIO=${fio_bin}
# fio_disk NAME DIR: write, then read 4 GiB (a 32k prompt of the 8B shape; less if DIR's file
# system has not twice that free) in DIR: 16 jobs (the file tier's io_threads), 2 MiB blocks
# (its rows), O_DIRECT, psync; both reports in OUT/fio_NAME.json
fio_disk() {
  local name=$1 dir=$2 rw per_job
  if [ -z "$fio_bin" ] || ! "$fio_bin" --version >/dev/null 2>&1; then
    echo "[session] fio $name: no fio (\$FIO, PATH, .device/fio/fio, .device/fio/fio.xz)" | tee -a "$summary"
    return 0
  fi
  per_job=$(( $(df --output=avail -m "$dir" | tail -1) / 32 / 2 * 2 ))
  [ "$per_job" -gt 256 ] && per_job=256
  for rw in write read; do
    "$fio_bin" --name="$name-$rw" --filename="$dir/fio.dat" --rw=$rw --bs=2M --size=${per_job}M \
      --offset_increment=${per_job}M --numjobs=16 --thread --group_reporting --direct=1 \
      --ioengine=psync --end_fsync=1 --output-format=json > "$OUT/.fio_$rw.json" \
      2> "$OUT/.fio_err" || { echo "[session] fio $name $rw failed: $(head -c 300 "$OUT/.fio_err")" \
        | tee -a "$summary"; rm -f "$dir/fio.dat" "$OUT/.fio_err"; return 0; }
  done
  # the same reads with 8 in flight per job (io_uring): 16 x 8 buffers of 2 MiB, 256 MiB in
  # all, beyond the CPU's caches as KV rows are; psync's one buffer a job stays cache-hot, an
  # edge on a RAM disk (where the "device" is a memcpy) that no reader landing rows has
  "$fio_bin" --name="$name-read-deep" --filename="$dir/fio.dat" --rw=read --bs=2M \
    --size=${per_job}M --offset_increment=${per_job}M --numjobs=16 --thread --group_reporting \
    --direct=1 --ioengine=io_uring --iodepth=8 --output-format=json > "$OUT/.fio_read_deep.json" \
    2> "$OUT/.fio_err" || { echo "[session] fio $name read (io_uring) failed:" \
      "$(head -c 300 "$OUT/.fio_err")" | tee -a "$summary"; rm -f "$OUT/.fio_read_deep.json"; }
  rm -f "$OUT/.fio_err"
  rm -f "$dir/fio.dat"
  python3 - "$OUT" "$name" <<'PY' | tee -a "$summary"
import json, os, sys
out, name = sys.argv[1], sys.argv[2]
runs = {rw: json.load(open(f"{out}/.fio_{rw}.json")) for rw in ("write", "read", "read_deep")
        if os.path.exists(f"{out}/.fio_{rw}.json")}
json.dump(runs, open(f"{out}/fio_{name}.json", "w"), indent=1)
gbps = {rw: r["jobs"][0][rw.split("_")[0]]["bw_bytes"] / 1e9 for rw, r in runs.items()}
deep = (f", read {gbps['read_deep']:.2f} GB/s with 8 in flight a job (io_uring)"
        if "read_deep" in gbps else "")
print(f"[session] fio {name}: write {gbps['write']:.2f} GB/s, read {gbps['read']:.2f} GB/s "
      f"(16 jobs, 2 MiB blocks, O_DIRECT, psync){deep}")
PY
  rm -f "$OUT/.fio_write.json" "$OUT/.fio_read.json" "$OUT/.fio_read_deep.json"
}

for step in "${STEPS[@]}"; do
  # gpu-bench, given the budget left at the step's start minus the margin
  # (the 8B phases' filler prompts write ~9 GB just before the disk phase: ~9 s at 1 GB/s)
  bench=(python3 -P -m benchmarks.gpu_bench --out "$OUT" --budget-s $(($(left) - MARGIN_S))
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
    disk-hit)
      hit=(python3 -P docs/bench_disk_hit.py --chunks "${DISKHIT_CHUNKS:-2048}" --row-mib 2
           --threads 16 --rounds "${DISKHIT_ROUNDS:-2}")
      run disk-hit-vdisk 60 "${DISKHIT_MAX_S:-150}" "${hit[@]}" \
        "${TIERING_BENCH_DIR:-/tmp}/tiering-disk-hit" --json "$OUT/disk_hit_vdisk.json"
      rm -rf "${TIERING_BENCH_DIR:-/tmp}/tiering-disk-hit"
      if ramdisk_up; then
        run disk-hit-ramdisk 45 "${DISKHIT_MAX_S:-150}" "${hit[@]}" "$ram_mnt/disk-hit" \
          --json "$OUT/disk_hit_ramdisk.json"
        rm -rf "$ram_mnt/disk-hit"
      fi ;;
    disk-hit-ab)
      # the read path's two knobs, one at a time, on both disks: the largest vectored read
      # (MAX_READ_RUN_BYTES) and the I/O threads; a 16k prompt (1024 chunks of 2 MiB), ours only
      for where in vdisk ramdisk; do
        dir="${TIERING_BENCH_DIR:-/tmp}/tiering-disk-hit-ab"
        if [ "$where" = ramdisk ]; then ramdisk_up || continue; dir="$ram_mnt/disk-hit-ab"; fi
        for knob in ${DISKHIT_AB:-run2:t8 run4:t8 run8:t8 run4:t16 run2:t16}; do
          mib=${knob%%:*}; mib=${mib#run}; thr=${knob##*:t}
          run "disk-hit-ab-$where-$mib-$thr" 30 60 python3 -P docs/bench_disk_hit.py \
            --chunks "${DISKHIT_AB_CHUNKS:-1024}" --row-mib 2 --threads "$thr" --rounds 1 \
            --systems ours --read-run-mib "$mib" "$dir" \
            --json "$OUT/disk_hit_ab_${where}_${mib}_${thr}.json"
          rm -rf "$dir"
        done
      done ;;
    phases-ramdisk)
      if ramdisk_up; then
        run phases-ramdisk 120 "$BUDGET_S" "${bench[@]}" --scratch "$ram_mnt/scratch" \
          --tag "${TAG}ramdisk" --shape 8b --lengths 2048,8192,32768 --configs none,ours,vtier-fs \
          --phases cold,recompute,disk,restart "${extra[@]}"
        rm -rf "$ram_mnt/scratch"
        fio_disk ramdisk "$ram_mnt"
      fi ;;
    throughput-wb)
      run throughput-wb 90 "$BUDGET_S" "${bench[@]}" --tag "${TAG}tpwb" --shape 8b --phases throughput \
        --configs none,ours,ours-wb --tp-cpu-fraction 0.5 --tp-rounds 3 "${extra[@]}" ;;
    disk-sweep)
      dsweep=(--phases prefill-sweep --sweep-shapes 8b --sweep-prompts 128 --sweep-hit-rates 0,50,100)
      VLLM_LOGGING_LEVEL=DEBUG run disk-sweep-vdisk 150 "$BUDGET_S" "${bench[@]}" \
        --tag "${TAG}dsv" "${dsweep[@]}" --sweep-configs none,ours-disk "${sweep_extra[@]}" "${extra[@]}"
      grep -E "request_scan|chain.py|promotion advisor|\[sweep\]" "$OUT/disk-sweep-vdisk.log" \
        > "$OUT/disk_sweep_vdisk_decisions.txt" 2>/dev/null
      gzip -f "$OUT/disk-sweep-vdisk.log"
      if ramdisk_up; then
        bench[7]=$(($(left) - MARGIN_S))  # --budget-s: what is left now
        VLLM_LOGGING_LEVEL=DEBUG run disk-sweep-ramdisk 90 "$BUDGET_S" "${bench[@]}" \
          --scratch "$ram_mnt/scratch" --tag "${TAG}dsr" "${dsweep[@]}" --sweep-configs ours-disk \
          "${sweep_extra[@]}" "${extra[@]}"
        grep -E "request_scan|chain.py|promotion advisor|\[sweep\]" "$OUT/disk-sweep-ramdisk.log" \
          > "$OUT/disk_sweep_ramdisk_decisions.txt" 2>/dev/null
        gzip -f "$OUT/disk-sweep-ramdisk.log"
        rm -rf "$ram_mnt/scratch"
      fi ;;
    copy-queue)
      run copy-queue 30 90 python3 -P docs/bench_copy_queue.py --bulk-gib 0,1,4,8 \
        --json "$OUT/copy_queue.json" ;;
    sweep-ab)
      ab=(--phases prefill-sweep --sweep-shapes 1b,8b --sweep-hit-rates 0,50,100 --sweep-trace)
      run sweep-ab-new 90 "$BUDGET_S" "${bench[@]}" --tag "${TAG}new" "${ab[@]}" \
        --sweep-configs none,ours-sched "${extra[@]}"
      bench[7]=$(($(left) - MARGIN_S))  # --budget-s: what is left now
      run sweep-ab-old 60 "$BUDGET_S" "${bench[@]}" --tag "${TAG}old" "${ab[@]}" \
        --sweep-configs ours-sched --sweep-max-loading 256 --sweep-load-queue-mib 0 "${extra[@]}" ;;
  esac
done
echo "[session] done in ${SECONDS}s; results in $OUT" | tee -a "$summary"
ls -l "$OUT"
