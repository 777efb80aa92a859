#!/usr/bin/env bash
# Build a self-contained fio for machines that have none (the GPU machines have no fio and no
# package registry): fio's source from this machine's apt sources, every optional engine that
# would pull in a library (ceph, gluster, rdma, pmem, numa, libaio, ...) left out, so the binary
# needs only libc, libm and libz and runs on any x86-64 glibc Linux of the same age or newer.
#
#   bash scripts/build_fio.sh [DEST_DIR]      # default .device/fio (git-ignored) -> DEST/fio.xz
#
# gpu_session.sh and fast_disk_bench.sh find .device/fio/fio.xz by themselves; send .device/fio
# along (run's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.device/fio}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
work=$(mktemp -d -t fio-build.XXXXXX)
trap 'rm -rf "$work"' EXIT

# apt's own sources, as deb-src, in a private list (nothing on the system changes)
mkdir -p "$work/lists/partial" "$work/parts"
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && sed 's/^Types:.*/Types: deb-src/' "$f" > "$work/parts/$(basename "$f")"
done
if [ -f /etc/apt/sources.list ]; then
  sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > "$work/parts/plain.list"
fi
apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/parts"
          -o "Dir::State::Lists=$work/lists")
apt-get "${apt_opts[@]}" update -qq
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only -qq fio)
tar -C "$work" -xzf "$work"/fio_*.orig.tar.gz
src=$(ls -d "$work"/fio-*/ | head -1)
(
  cd "$src"
  ./configure --disable-native --disable-gfapi --disable-rbd --disable-rados --disable-rdma \
    --disable-pmem --disable-numa --disable-xnvme --disable-libzbc --disable-dfs \
    --disable-http --disable-tcmalloc --disable-libnfs --dynamic-libengines \
    > "$work/configure.log"  # library engines (libaio, ...) as plug-ins, not linked in
  make -j"$(nproc)" fio > "$work/make.log" 2>&1 || { tail -30 "$work/make.log"; exit 1; }
  strip -o "$dest/fio" fio
)
echo "built $dest/fio: $("$dest/fio" --version); needs:"
ldd "$dest/fio" | awk '{print "  " $1}'
if ldd "$dest/fio" | grep -vqE 'linux-vdso|ld-linux|lib(c|m|mvec|z|pthread|dl|rt)\.so'; then
  echo "build_fio: the binary needs more than libc/libm/libz: it may not run elsewhere" >&2
  exit 1
fi
# carried xz-compressed (~0.8 of 2.9 MB): a device call's working tree and carry share 64 MiB;
# gpu_session.sh and fast_disk_bench.sh unpack it
xz -9 -f "$dest/fio"
echo "wrote $dest/fio.xz"
