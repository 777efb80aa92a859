"""Slab files: fixed-size, 4096-aligned slots preallocated in a few large files.

Slot ``s`` lives in file ``s // slots_per_file`` at offset ``(s % slots_per_file) * slot_bytes``.
Big preallocated files (as LMCache's GDS slabs, Dynamo KVBM, CacheLib regions do) avoid a file
per chunk: no create/unlink/metadata traffic per write, aligned offsets for O_DIRECT, and
eviction is just an index delete. Files are capped (``slab_file_bytes``) so no single file
grows huge. ``fallocate`` reserves the blocks up front so writes never meet ENOSPC later; where
the filesystem refuses it, files are extended sparsely (``ftruncate``) and a log line says so.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Any

from tiering.backends.checksum import namespace_seed
from tiering.backends.io_engines import IoEngine
from tiering.settings import MIN_RUN_BYTES

log = logging.getLogger(__name__)


def slab_name(i: int) -> str:
    return f"slab-{i:04d}.dat"


class SlabSet:
    def __init__(self, folder: Path, slot_bytes: int, n_slots: int, slab_file_bytes: int) -> None:
        self.folder = folder
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.slots_per_file = max(1, slab_file_bytes // slot_bytes)
        self.n_files = -(-n_slots // self.slots_per_file)
        self.sparse = False
        self.seed = namespace_seed(folder.name)  # checksums bind bytes to key and namespace
        self._handles: list[Any] = []

    def file_slots(self, i: int) -> int:
        return min(self.slots_per_file, self.n_slots - i * self.slots_per_file)

    def mismatch(self) -> str | None:
        """Why the slab files on disk are not exactly this layout, or None. Tools that open a
        namespace as its writer check this first: a writer resizes to its layout, so a tool
        must never open with a layout the files do not already have."""
        for i in range(self.n_files):
            path = self.folder / slab_name(i)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return f"{path.name} is missing"
            if not stat.S_ISREG(st.st_mode):
                return f"{path.name} is not a regular file"
            if st.st_size != self.file_slots(i) * self.slot_bytes:
                return (f"{path.name} is {st.st_size} bytes, the layout says "
                        f"{self.file_slots(i) * self.slot_bytes}")
        if os.path.lexists(self.folder / slab_name(self.n_files)):
            return f"{slab_name(self.n_files)} exists beyond the recorded {self.n_slots} slots"
        return None

    def create_or_resize(self, preallocate: bool) -> None:
        """Make every slab file exactly as large as its slots; drop files beyond the capacity."""
        for i in range(self.n_files):
            path = self.folder / slab_name(i)
            size = self.file_slots(i) * self.slot_bytes
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                current = os.fstat(fd).st_size
                if current > size:
                    os.ftruncate(fd, size)
                elif current < size:
                    self._extend(fd, path, current, size, preallocate)
            finally:
                os.close(fd)
        i = self.n_files
        while os.path.lexists(self.folder / slab_name(i)):
            (self.folder / slab_name(i)).unlink()
            i += 1

    def _extend(self, fd: int, path: Path, current: int, size: int, preallocate: bool) -> None:
        if preallocate:
            try:
                os.posix_fallocate(fd, current, size - current)
                return
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise OSError(exc.errno, f"{path}: no space to preallocate "
                                  f"{size - current} bytes") from exc
                log.warning("%s: fallocate refused (%s); extending sparsely, so writes may "
                            "meet ENOSPC later if the filesystem fills up", path, exc)
        self.sparse = True
        os.ftruncate(fd, size)

    def open(self, engine: IoEngine) -> None:
        self._handles = [engine.open(str(self.folder / slab_name(i))) for i in range(self.n_files)]

    def close(self, engine: IoEngine) -> None:
        for h in self._handles:
            engine.close(h)
        self._handles = []

    def locate(self, slot: int) -> tuple[Any, int, int]:
        """(handle, offset, file index) of a slot."""
        f, s = divmod(slot, self.slots_per_file)
        return self._handles[f], s * self.slot_bytes, f

    def handle(self, file_index: int) -> Any:
        return self._handles[file_index]

    def existing_bytes(self) -> int:
        total = 0
        for p in self.folder.glob("slab-*.dat"):
            total += p.stat().st_blocks * 512
        return total


# -- runs of adjacent slots: one vectored call (preadv/pwritev) each ------------------------------
def run_rows(n: int, threads: int, row_bytes: int, max_bytes: int,
             min_bytes: int | None = None) -> int:
    """Rows per run: ``n`` rows split evenly over ``threads``, but no run under ``min_bytes``
    (default ``MIN_RUN_BYTES``: one task and one syscall per row would cost more than a 256 KiB
    I/O on a fast device) and none over ``max_bytes`` (0 = no cap)."""
    floor = MIN_RUN_BYTES if min_bytes is None else min_bytes
    rows = max(-(-n // threads), -(-floor // row_bytes))
    if max_bytes:
        rows = min(rows, max(1, max_bytes // row_bytes))
    return max(1, rows)


def adjacent_runs(items: list, slabs: SlabSet, max_rows: int, slot_of) -> list[list]:
    """Split items into runs of consecutive slots in one slab file, at most max_rows each."""
    runs: list[list] = []
    for item in sorted(items, key=slot_of):
        slot = slot_of(item)
        if runs:
            last = runs[-1]
            prev = slot_of(last[-1])
            if (slot == prev + 1 and len(last) < max_rows
                    and slot // slabs.slots_per_file == prev // slabs.slots_per_file):
                last.append(item)
                continue
        runs.append([item])
    return runs
