"""Slab files: fixed-size, 4096-aligned slots preallocated in a few large files.

Slot ``s`` lives in file ``s // slots_per_file`` at offset ``(s % slots_per_file) * slot_bytes``.
Big preallocated files (as LMCache's GDS slabs, Dynamo KVBM, CacheLib regions do) avoid a file
per chunk: no create/unlink/metadata traffic per write, aligned offsets for O_DIRECT, and
eviction is just an index delete. Files are capped (``slab_file_bytes``) so no single file
grows huge. ``fallocate`` reserves the blocks up front so writes never meet ENOSPC later; where
the filesystem refuses it, files are extended sparsely (``ftruncate``) and a log line says so.

A slab that is there but is not a regular file (a folder, a fifo: someone replaced it) is a
*damaged slab*: it was not written by us as it is, so it is never opened, resized or removed;
its slots are unusable (``damaged``), the rows indexed there are misses (the writer drops them
at open, counted as ``io_errors``), and the other files serve as before. ``tiering verify``
names it. Removing it by hand and restarting gives its slots back.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tiering.backends.checksum import namespace_seed
from tiering.backends.namespace import SLAB_FILE, NamespaceError, hard_link_problem
from tiering.backends.slab_io import SlabIo
from tiering.settings import MIN_RUN_BYTES

log = logging.getLogger(__name__)
Item = TypeVar("Item")


def slab_name(i: int) -> str:
    return f"slab-{i:04d}.dat"


def damage_of(path: Path) -> str | None:
    """Why ``path`` is a damaged slab (there, but neither a regular file nor a link), or None
    (a regular file, missing, or a link: links are refused before, by ``check_folder``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
        return None
    return "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"


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
        self.damaged: dict[int, str] = {}  # file index -> why it is not a slab file

    def file_slots(self, i: int) -> int:
        return min(self.slots_per_file, self.n_slots - i * self.slots_per_file)

    def slots_of_file(self, i: int) -> range:
        return range(i * self.slots_per_file, i * self.slots_per_file + self.file_slots(i))

    def mismatch(self) -> str | None:
        """Why the slab files on disk are not exactly this layout, or None. Tools that open a
        namespace as its writer check this first: a writer resizes to its layout, so a tool
        must never open with a layout the files do not already have. A damaged slab (not a
        regular file) is no mismatch: the writer leaves it exactly as it is."""
        for i in range(self.n_files):
            path = self.folder / slab_name(i)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return f"{path.name} is missing"
            if stat.S_ISLNK(st.st_mode):
                return f"{path.name} is a symbolic link"
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size != self.file_slots(i) * self.slot_bytes:
                return (f"{path.name} is {st.st_size} bytes, the layout says "
                        f"{self.file_slots(i) * self.slot_bytes}")
        if os.path.lexists(self.folder / slab_name(self.n_files)):
            return f"{slab_name(self.n_files)} exists beyond the recorded {self.n_slots} slots"
        return None

    def create_or_resize(self, preallocate: bool) -> None:
        """Make every slab file exactly as large as its slots; drop files beyond the capacity.
        A damaged slab (not a regular file) is left as it is and recorded in ``damaged``."""
        self.damaged = {}
        for i in range(self.n_files):
            path = self.folder / slab_name(i)
            size = self.file_slots(i) * self.slot_bytes
            problem = damage_of(path)
            if problem:
                self.damaged[i] = problem
                log.warning("%s: %s, not a slab file: a damaged slab, left as it is; its %d "
                            "slots are unused and the rows stored there are misses (remove it "
                            "and restart to get them back)", path, problem, self.file_slots(i))
                continue
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                st = os.fstat(fd)
                if st.st_nlink != 1:  # linked in after check_folder: never resize it
                    raise NamespaceError(hard_link_problem(path, path.name, st.st_nlink))
                current = st.st_size
                if current > size:
                    os.ftruncate(fd, size)
                elif current < size:
                    self._extend(fd, path, current, size, preallocate)
            finally:
                os.close(fd)
        i = self.n_files
        while os.path.lexists(self.folder / slab_name(i)):
            path = self.folder / slab_name(i)
            if damage_of(path):  # not a file we wrote as it is: never removed
                log.warning("%s: beyond the capacity and not a slab file; left as it is", path)
            else:
                path.unlink()
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

    def open(self, io: SlabIo) -> None:
        """Open every slab file but the damaged ones (their handle is None: no slot of theirs
        is ever read or written, ``unusable_slots``)."""
        self._handles = [None if i in self.damaged else io.open(str(self.folder / slab_name(i)))
                         for i in range(self.n_files)]

    def unusable_slots(self) -> list[range]:
        return [self.slots_of_file(i) for i in sorted(self.damaged)]

    def close(self, io: SlabIo) -> None:
        for h in self._handles:
            if h is not None:
                io.close(h)
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
            if SLAB_FILE.match(p.name) and p.is_file() and not p.is_symlink():
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


def adjacent_runs(items: list[Item], slabs: SlabSet, max_rows: int,
                  slot_of: Callable[[Item], int]) -> list[list[Item]]:
    """Split items into runs of consecutive slots in one slab file, at most max_rows each."""
    runs: list[list[Item]] = []
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
