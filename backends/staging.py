"""The staging region: tier 0's rows, in one shared-memory file per engine.

The scheduler process (file-tier I/O reads and writes rows) and every worker process (DMA between
the GPU and rows) map the same file, so a row never has to be copied between processes. Rows are
``row_bytes`` apart (4096-aligned, so O_DIRECT reads and writes work on them directly). Inside a
row each worker rank owns one cell, and inside a cell each KV tensor owns ``page × blocks_per_chunk``
bytes, as in vLLM's own CPU tier; within them a chunk's blocks lie last position first
(``block_copy.CopyLayout``; vLLM's tier stores them first position first, so chunks of more
than one block are other bytes than its rows, and another namespace).

Lifecycle: whichever process comes first creates ``/dev/shm/vllm_tiering_<engine>.shm`` at full
size; the others open it. Every mapper holds a shared ``flock`` on it while mapped, so a region
whose lock can be taken exclusively has no live user: ``remove_stale`` deletes those (left by an
engine that was killed) at start; an opener checks, once it holds its lock, that the name still
leads to the file it locked (a remover may take a region in the instant between its creation and
its first lock), and nothing is opened through a link or with a second name. The scheduler unlinks its region at shutdown; workers keep
their mapping until they exit.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tiering.backends.namespace import make_dirs

log = logging.getLogger(__name__)
SHM_DIR = Path(os.environ.get("TIERING_SHM_DIR", "/dev/shm"))
_PREFIX = "vllm_tiering_"


def region_path(engine_id: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))[:100]
    return SHM_DIR / f"{_PREFIX}{safe}.shm"  # module attribute read at call time (tests move it)


def remove_stale(keep: Path | None = None) -> list[Path]:
    """Delete regions that no process has mapped (their engine died).

    Only what a region of ours can be: a regular file of this user with one name, whole pages,
    named ``vllm_tiering_*.shm``, on which nobody holds a lock; and only if the name still
    leads to the file that was checked and locked (another engine may have removed it and
    created its own meanwhile). Nothing is opened before ``lstat`` says it is a regular file
    (never a device or a fifo), nothing through a link.
    """
    removed: list[Path] = []
    if not SHM_DIR.is_dir():
        return removed
    uid = os.geteuid()
    for p in SHM_DIR.glob(f"{_PREFIX}*.shm"):
        if keep is not None and p == keep:
            continue
        try:
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fst = os.fstat(fd)
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or fst.st_uid != uid \
                    or fst.st_nlink != 1 or fst.st_size % mmap.PAGESIZE:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # mapped by a live engine
            if _same_file(p, fst):
                p.unlink()
                removed.append(p)
                log.warning("removed stale staging region %s (its engine is gone)", p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _same_file(path: Path, st: os.stat_result) -> bool:
    """``path`` still names the file ``st`` was taken of."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _open_region(path: Path) -> int:
    """Open (creating it if missing) the region file at ``path`` with a shared lock held, once
    the lock is held on the file the name leads to: a remover of stale regions may unlink a
    file between its creation and its lock (it is 0 bytes and unlocked then); mapping that one
    would give this process rows no other process sees. Never through a link, never a file
    that is not a region of this user's (another name elsewhere: someone's file)."""
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(exc.errno, f"{path}: a symbolic link where the staging region "
                              "should be; refusing to map it (remove the link)") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
                raise OSError(errno.EEXIST, f"{path}: not a staging region of this user (a "
                              f"regular file of one name owned by uid {os.geteuid()}); "
                              "refusing to map it")
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _same_file(path, st):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed as stale between the open and the lock: open the new one
    raise OSError(errno.EAGAIN, f"{path}: keeps being removed while it is opened")


class StagingRegion:
    """One engine's rows. ``populate``: map every page now (``MAP_POPULATE``), for the process
    whose file tier reads into the rows (the scheduler). O_DIRECT reads fault each unmapped
    4 KiB page of their buffer in one at a time, on the I/O threads: a fresh engine's first
    disk hits paid that (0.23 s per GiB on the build machine, where mapping them at once takes
    0.04 s; docs/benchmarks.md). vLLM's own CPU tier pre-faults its region for the same reason.
    Mapping allocates the region's memory (the CPU tier's size) at engine start instead of as
    rows are first used."""

    def __init__(self, engine_id: str, num_rows: int, row_bytes: int,
                 populate: bool = False) -> None:
        if row_bytes <= 0 or row_bytes % mmap.PAGESIZE:
            raise ValueError(f"row_bytes must be a positive multiple of {mmap.PAGESIZE}, "
                             f"got {row_bytes}")
        if num_rows < 1:
            raise ValueError(f"the CPU tier holds no row: num_rows={num_rows} "
                             f"(cpu_bytes_to_use is smaller than one row of {row_bytes} bytes)")
        self.path = region_path(engine_id)
        self.num_rows, self.row_bytes = num_rows, row_bytes
        # after the rows, whole pages holding one byte per row: set by a worker whose copy into
        # the row failed, read and cleared by the scheduler when vLLM reports the store done
        # (vLLM's interface has no failed store: the worker reports it done, the region says)
        self.flags_offset = num_rows * row_bytes
        size = self.flags_offset + -(-num_rows // mmap.PAGESIZE) * mmap.PAGESIZE
        make_dirs(self.path.parent)  # 0700 whatever the umask (TIERING_SHM_DIR may be new)
        fd = _open_region(self.path)
        try:
            current = os.fstat(fd).st_size
            if current == 0:
                free = shutil.disk_usage(self.path.parent).free
                if size > free:
                    raise OSError(
                        f"{self.path.parent} has {free} bytes free, the CPU tier needs {size} "
                        "(in Docker, raise --shm-size; or lower cpu_bytes_to_use)")
                os.ftruncate(fd, size)
            elif current != size:
                raise OSError(f"{self.path}: exists with {current} bytes, expected {size} "
                              "(another engine with the same id and a different config?)")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.rows = np.frombuffer(self._mmap, dtype=np.uint8,
                                  count=self.flags_offset).reshape(num_rows, row_bytes)
        self._store_failed = np.frombuffer(self._mmap, dtype=np.uint8, count=num_rows,
                                           offset=self.flags_offset)
        self.base_address = self.rows.ctypes.data

    # -- failed stores: the worker marks, the scheduler takes ---------------------------------
    def mark_store_failed(self, rows: Iterable[int]) -> None:
        """Worker side: the GPU's copy into these rows failed (what they hold is not the KV).
        A row outside the region is a ValueError naming it, and then no row is marked."""
        self._store_failed[self._rows(rows)] = 1

    def clear_store_failed(self, rows: Iterable[int]) -> None:
        """Scheduler side: these rows are reserved for a new store (no mark left from before)."""
        self._store_failed[self._rows(rows)] = 0

    def _rows(self, rows: Iterable[int]) -> np.ndarray:
        idx = np.fromiter(rows, dtype=np.int64)
        bad = idx[(idx < 0) | (idx >= self.num_rows)]
        if bad.size:
            raise ValueError(f"{self.path}: rows {bad[:8].tolist()} are outside the region's "
                             f"{self.num_rows} rows")
        return idx

    def take_store_failed(self, row: int) -> bool:
        """Scheduler side: did the store into ``row`` fail? The mark is cleared."""
        if not self._store_failed[row]:
            return False
        self._store_failed[row] = 0
        return True

    def row(self, i: int) -> memoryview:
        if not 0 <= i < self.num_rows:  # past the rows lie the store marks, not a row
            raise IndexError(f"{self.path}: row {i} of {self.num_rows}")
        return memoryview(self._mmap)[i * self.row_bytes:(i + 1) * self.row_bytes]

    def close(self, unlink: bool = False) -> None:
        if self._fd < 0:
            return
        self.rows = None  # type: ignore[assignment]
        self._store_failed = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive (e.g. a torch tensor): leave it mapped
            pass
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1
