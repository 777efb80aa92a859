#!/usr/bin/env bash
# The file tier as fast as a fast device: side by side with fio (and vLLM's fs tier, when vLLM
# imports) on a RAM-backed ext4 that accepts O_DIRECT, at 256 KiB and 2 MiB rows.
#
#   sudo bash scripts/fast_disk_bench.sh OUT_DIR [THREADS]
#
# A RAM disk stands in for a 7-14 GB/s NVMe drive: a slow disk hides the software's cost, this
# one exposes it. The filesystem is ext4 on a loop device over a file in a tmpfs (tmpfs itself
# would not be O_DIRECT the way a block device is); everything is unmounted and detached at
# exit, also on errors or Ctrl-C.
#
# Needs root (mount, losetup, drop_caches), python3 with numpy + lmdb + zstandard + xxhash
# (wheels in .whl/ are installed into a temporary folder when present, as gpu_check.sh does),
# and fio: $FIO, else `fio` on PATH, else .device/fio/fio (scripts/build_fio.sh makes one that
# runs on any x86-64 glibc Linux). Without fio the tier still runs and the table says so.
#
# Environment: TOTAL (bytes per run, default 2GiB), REPEAT (default 3), ROWS (default
# "256KiB 2MiB"), PARTS (default tier,vllm_tier,vllm_fs,fio,py_io,py_io_xxh3: py_io* are the
# ceiling of a Python tier, see tiering/bench.py), JOB_ROWS (chunks per vLLM
# transfer job, default 16), PYTHON (default python3).
# Writes OUT_DIR/fast_disk_<rows>.json per row size and OUT_DIR/fast_disk.json (all of them).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: fast_disk_bench.sh OUT_DIR [THREADS]}
THREADS=${2:-$(nproc)}
TOTAL=${TOTAL:-2GiB}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ "$(id -u)" != 0 ]; then
  echo "fast_disk_bench: needs root (mount -t tmpfs, losetup, mount, drop_caches)" >&2
  exit 2
fi

work=$(mktemp -d -t fastdisk.XXXXXX)
loopdev=""
cleanup() {
  set +e
  mountpoint -q "$work/mnt" && umount "$work/mnt"
  [ -n "$loopdev" ] && losetup -d "$loopdev"
  mountpoint -q "$work/ram" && umount "$work/ram"
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# Python: the package importable without installing (mirrors pyproject's package-dir mapping),
# plus wheels from .whl/ if the machine lacks lmdb/zstandard/xxhash.
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$work/site" .whl/*.whl
  export PYTHONPATH=$work/site:${PYTHONPATH:-}
fi
if ! "$PYTHON" -c "import tiering.backends" 2>/dev/null; then
  mkdir -p "$work/pkg/tiering"
  cp -r tiering/* "$work/pkg/tiering/"
  cp -r backends "$work/pkg/tiering/backends"
  cp -r policies "$work/pkg/tiering/policies"
  export PYTHONPATH=$work/pkg:${PYTHONPATH:-}
fi
"$PYTHON" -c "import numpy, lmdb, zstandard, xxhash" || {
  echo "fast_disk_bench: $PYTHON lacks numpy/lmdb/zstandard/xxhash (put wheels in .whl/)" >&2
  exit 2
}

# fio
fio_bin=${FIO:-$(command -v fio || true)}
[ -z "$fio_bin" ] && [ -x .device/fio/fio ] && fio_bin=$PWD/.device/fio/fio
if [ -z "$fio_bin" ] && [ -f .device/fio/fio.xz ]; then  # scripts/build_fio.sh's, compressed
  fio_bin=$(mktemp -t tiering-fio.XXXXXX) && xz -dc .device/fio/fio.xz > "$fio_bin" && chmod +x "$fio_bin"
fi
if [ -n "$fio_bin" ] && "$fio_bin" --version >/dev/null 2>&1; then
  export TIERING_FIO=$fio_bin
  echo "fio: $fio_bin ($("$fio_bin" --version))"
else
  echo "fio: NOT FOUND (no \$FIO, no fio on PATH, no .device/fio/fio): the fio column stays" \
    "empty; scripts/build_fio.sh builds one"
  PARTS=$(echo "${PARTS:-tier,vllm_tier,vllm_fs,fio,py_io,py_io_xxh3}" | tr ',' '\n' | grep -vx fio | paste -sd,)
fi

# RAM-backed ext4: room for one system's data at a time (each run's folder is removed after
# it) plus ext4's metadata and one-file-per-chunk overhead.
total_bytes=$("$PYTHON" -c "from tiering.backends.sizes import parse_size as p; print(p('$TOTAL', 'TOTAL'))")
img_mib=$(( total_bytes * 5 / 4 / 1048576 + 512 ))
mkdir -p "$work/ram" "$work/mnt"
mount -t tmpfs -o size=$(( img_mib + 64 ))m tmpfs "$work/ram"
truncate -s ${img_mib}M "$work/ram/ext4.img"
mkfs.ext4 -q -F "$work/ram/ext4.img"
loopdev=$(losetup -f --show "$work/ram/ext4.img")
mount "$loopdev" "$work/mnt"
echo "RAM-backed ext4: $loopdev on $work/mnt (${img_mib} MiB), $THREADS threads, $TOTAL per run"

"$PYTHON" scripts/fast_disk_bench.py "$work/mnt/scratch" "$OUT" --threads "$THREADS" \
  --total "$TOTAL" --repeat "${REPEAT:-3}" --rows ${ROWS:-256KiB 2MiB} \
  --parts "${PARTS:-tier,vllm_tier,vllm_fs,fio,py_io,py_io_xxh3}" --job-rows "${JOB_ROWS:-16}"
