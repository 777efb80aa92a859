"""Slab I/O: how slot bytes move between memory and slab files.

Every slab I/O offers the same blocking primitives (``readv``/``read_into``, ``writev``, ``sync``) that
the file tier calls from its worker threads, plus ``submit`` to run a task on its own pool and get
a future back, so the tier's public API never blocks its caller.

* ``posix``  — ``os.preadv``/``os.pwritev`` on file descriptors opened with ``O_DIRECT`` when the
  filesystem accepts it (page cache bypassed: no double buffering of tens of GiB, no writeback
  storms), else buffered. Unaligned buffers go through a per-thread aligned bounce buffer.
* ``kvikio`` — ``kvikio.CuFile`` ``pread``/``pwrite`` (its own C++ thread pool splits large
  requests; compat mode when GPUDirect Storage is absent). Needs a CUDA driver even for host
  buffers: ``auto`` only picks it when one is present.
* ``auto``   — ``kvikio`` if it imports and a CUDA driver answers, else ``posix``; the choice is
  logged.
"""

from __future__ import annotations

import collections
import ctypes.util
import errno
import logging
import mmap
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from tiering.settings import SLAB_IO_URGENT_BURST
from tiering.thread_names import name_os_thread

log = logging.getLogger(__name__)
T = TypeVar("T")
ALIGN = 4096
IO_KINDS = ("auto", "posix", "kvikio", "gds")
_STOP = object()  # the token that tells a worker thread to return


def is_aligned(buf: memoryview) -> bool:
    if len(buf) % ALIGN:
        return False
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data % ALIGN == 0


def aligned_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory (mmap), suitable for O_DIRECT."""
    size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
    return memoryview(mmap.mmap(-1, size))[:nbytes]


def resident_buffer(nbytes: int) -> memoryview:
    """``aligned_buffer`` whose pages are all in memory before it is returned (MAP_POPULATE,
    else one write a page). A read into fresh anonymous memory faults its pages in as the read
    runs: timing one measures page faults as much as the device (on an ext4 RAM disk, 8 reads of
    8 MiB ran at 1.3-2.7 GB/s into fresh memory and at 3.9-4.4 GB/s into resident memory)."""
    size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    if not populate:
        np.frombuffer(m, np.uint8)[::ALIGN] = 0  # touch every page
    return memoryview(m)[:nbytes]


class SlabIo(ABC):
    """Moves bytes between buffers and open slab files.

    Threading: ``readv``/``read_into``/``writev``/``sync`` block and are called only from worker
    threads (``post``/``submit``); they may run concurrently on different offsets of the same
    file. Failure: they raise ``OSError``; the tier turns that into a miss or a rejected write.

    Reads go first: a task posted ``urgent`` (a read some request waits for) runs before every
    task posted plain (the writer's runs), whatever their order. Under write-through the writer
    keeps the device busy at its limit, and a promotion queued behind its runs would wait out
    their whole backlog. Tasks wait in two deques; ``post`` appends the task, then puts one
    wake-up token on a ``SimpleQueue`` (no future, no condition variable, which matters when a
    task is one 256 KiB read); a worker takes a token, then the first urgent task, else the
    first plain one. A task is appended before its token, so a worker holding a token always
    finds one (a worker that looks for a plain task first looks again until it has one).

    Never a stalled writer: a worker that has run ``SLAB_IO_URGENT_BURST`` urgent tasks in a row
    while plain ones wait runs the first plain one next. Under a stream of reads at the device's
    limit the writer's runs would otherwise wait forever (the committer waits on them, their CPU
    rows stay pinned).

    Shutdown: every task posted before ``shutdown`` runs before it returns; a post after it
    raises ``RuntimeError`` (no worker is left: a read's key would stay pinned, a write's future
    pending). No post may race ``shutdown`` from another thread.
    """

    name = "base"

    def __init__(self, threads: int) -> None:
        self.threads = threads
        # (function, its arguments) per task, reads first; one token per task, _STOP to stop
        self._urgent: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._plain: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._tokens: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._shut = False
        self._workers = [threading.Thread(target=self._work, name=f"tier-{self.name}-{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._workers:
            t.start()

    def _work(self) -> None:
        name_os_thread(threading.current_thread().name)
        get, urgent, plain = self._tokens.get, self._urgent, self._plain
        streak = 0  # urgent tasks this worker ran in a row while plain ones waited
        while True:
            if get() is _STOP:
                return
            if streak < SLAB_IO_URGENT_BURST:
                try:
                    fn, args = urgent.popleft()
                    streak = streak + 1 if plain else 0
                except IndexError:  # none urgent: a plain one, unless another worker that
                    # looked at the plain ones first took it meanwhile (then an urgent one
                    # came, behind its token)
                    fn, args = self._take_plain_first()
                    streak = 0
            else:
                fn, args = self._take_plain_first()
                streak = 0
            try:
                fn(*args)
            except BaseException:  # a task reports its own failures; this is a bug
                log.exception("I/O task %r failed", fn)

    def _take_plain_first(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The first plain task, else the first urgent one, for a worker holding a token. A
        token promises a task in one of the deques, not in the one looked at second: another
        worker may take it between the two looks, so look again (rare, and brief)."""
        urgent, plain = self._urgent, self._plain
        while True:
            try:
                return plain.popleft()
            except IndexError:
                pass
            try:
                return urgent.popleft()
            except IndexError:
                pass

    def post(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> None:
        """Run ``fn(*args)`` on a worker thread, before every plain task if ``urgent``; it must
        report its own result. ``RuntimeError`` after ``shutdown``."""
        if self._shut:
            raise RuntimeError(f"slab I/O {self.name}: shut down; no worker would run {fn!r}")
        (self._urgent if urgent else self._plain).append((fn, args))
        self._tokens.put(None)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a worker thread (a plain task); its result in the future."""
        fut: Future[T] = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

        self.post(run)
        return fut

    @abstractmethod
    def open(self, path: str) -> Any: ...

    @abstractmethod
    def close(self, handle: Any) -> None: ...

    @abstractmethod
    def readv(self, handle: Any, bufs: list[memoryview], offset: int) -> int:
        """Fill ``bufs`` (in order) from consecutive bytes at ``offset``; bytes read."""

    @abstractmethod
    def writev(self, handle: Any, bufs: list[memoryview], offset: int) -> int:
        """Write ``bufs`` (in order) to consecutive bytes at ``offset``; bytes written."""

    def read_into(self, handle: Any, buf: memoryview, offset: int) -> int:
        return self.readv(handle, [buf], offset)

    @abstractmethod
    def sync(self, handle: Any) -> None: ...

    def describe(self) -> str:
        return self.name

    def shutdown(self) -> None:
        """Run every task queued, then stop the workers (blocks; a second call does nothing)."""
        if self._shut:
            return
        self._shut = True
        for _ in self._workers:  # behind every queued task's token
            self._tokens.put(_STOP)
        for t in self._workers:
            t.join()


class PosixSlabIo(SlabIo):
    name = "posix"

    def __init__(self, threads: int, direct: bool = True) -> None:
        super().__init__(threads)
        self.want_direct = direct
        self.direct_files = 0
        self.buffered_files = 0
        self._local = threading.local()

    def open(self, path: str) -> tuple[int, bool]:
        if self.want_direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW)
                self.direct_files += 1
                return fd, True
            except OSError as exc:
                log.info("%s: O_DIRECT refused (%s); using buffered I/O", path, exc)
        self.buffered_files += 1
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW), False

    def close(self, handle: tuple[int, bool]) -> None:
        os.close(handle[0])

    def _bounce(self, nbytes: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = aligned_buffer(nbytes)
            self._local.buf = buf
        return buf[:nbytes]

    def readv(self, handle: tuple[int, bool], bufs: list[memoryview], offset: int) -> int:
        fd, direct = handle
        try:
            return _full_io(os.preadv, fd, bufs, offset)
        except OSError as exc:  # O_DIRECT refuses unaligned memory with EINVAL
            if not (direct and exc.errno == errno.EINVAL) or all(is_aligned(b) for b in bufs):
                raise
        done = 0
        for b in bufs:  # one bounce per buffer
            tmp = self._bounce(-(-len(b) // ALIGN) * ALIGN)
            n = min(_full_io(os.preadv, fd, [tmp], offset + done), len(b))
            b[:n] = tmp[:n]
            done += n
            if n < len(b):
                break
        return done

    def writev(self, handle: tuple[int, bool], bufs: list[memoryview], offset: int) -> int:
        fd, direct = handle
        try:
            return _full_io(os.pwritev, fd, bufs, offset)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL) or all(is_aligned(b) for b in bufs):
                raise
        done = 0
        for b in bufs:
            tmp = self._bounce(-(-len(b) // ALIGN) * ALIGN)
            tmp[: len(b)] = b
            tmp[len(b):] = bytes(len(tmp) - len(b))
            done += min(_full_io(os.pwritev, fd, [tmp], offset + done), len(b))
        return done

    def sync(self, handle: tuple[int, bool]) -> None:
        os.fdatasync(handle[0])

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct_files and not self.buffered_files else (
            "buffered" if not self.direct_files else "mixed")
        return f"posix ({mode}, {self.threads} threads)"


def _full_io(op: Callable[[int, list[memoryview], int], int], fd: int, bufs: list[memoryview], offset: int) -> int:
    """Run preadv/pwritev until every buffer is done or (reads) end of file is reached."""
    total = sum(len(b) for b in bufs)
    done = 0
    while done < total:
        n = op(fd, bufs, offset + done)
        if n == 0:
            if op is os.pwritev:
                raise OSError(f"pwritev wrote 0 bytes at offset {offset + done}")
            break  # end of file: a short read, the caller checks the length
        done += n
        if done < total:  # drop the buffers (and the part of one) already transferred
            skip = n
            while skip and skip >= len(bufs[0]):
                skip -= len(bufs[0])
                bufs = bufs[1:]
            if skip:
                bufs = [bufs[0][skip:], *bufs[1:]]
    return done


class KvikioSlabIo(SlabIo):
    """kvikio CuFile I/O (compat mode without GDS). Imports kvikio lazily."""

    name = "kvikio"

    def __init__(self, threads: int) -> None:
        import kvikio  # fail early with ImportError if absent
        import kvikio.defaults  # noqa: F401 - a submodule, not imported by the package

        self._kvikio = kvikio
        kvikio.defaults.set("num_threads", max(1, threads))
        super().__init__(threads)

    def open(self, path: str) -> Any:
        # CuFile exposes no descriptor for fdatasync: keep a plain one beside it
        return self._kvikio.CuFile(path, "r+"), os.open(path, os.O_RDWR)

    def close(self, handle: Any) -> None:
        handle[0].close()
        os.close(handle[1])

    def readv(self, handle: Any, bufs: list[memoryview], offset: int) -> int:
        handle = handle[0]
        futs, pos = [], offset
        for b in bufs:  # kvikio splits each request over its own thread pool
            futs.append(handle.pread(np.frombuffer(b, dtype=np.uint8), len(b), pos))
            pos += len(b)
        return sum(f.get() for f in futs)

    def writev(self, handle: Any, bufs: list[memoryview], offset: int) -> int:
        handle = handle[0]
        futs, pos = [], offset
        for b in bufs:
            futs.append(handle.pwrite(np.frombuffer(b, dtype=np.uint8), len(b), pos))
            pos += len(b)
        return sum(f.get() for f in futs)

    def sync(self, handle: Any) -> None:
        os.fdatasync(handle[1])

    def describe(self) -> str:
        compat = self._kvikio.defaults.get("compat_mode")
        return f"kvikio (compat_mode={compat}, {self.threads} threads)"


def cuda_driver_present() -> bool:
    """True if libcuda can be loaded and reports at least one device."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return False
    try:
        if lib.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        return lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except AttributeError:
        return False


def make_slab_io(name: str, threads: int, direct: bool = True) -> SlabIo:
    """Build a slab I/O by kind (see module doc); ValueError for unknown names."""
    if name not in IO_KINDS:
        raise ValueError(f"io: unknown I/O kind {name!r}; expected one of {', '.join(IO_KINDS)}")
    if name in ("kvikio", "gds"):
        if not cuda_driver_present():
            raise ValueError(f"io: {name!r} needs a CUDA driver (libcuda) and none was found; "
                             "use io='posix' or io='auto'")
        return KvikioSlabIo(threads)
    if name == "auto":
        if cuda_driver_present():
            try:
                io = KvikioSlabIo(threads)
                log.info("io=auto chose kvikio (CUDA driver present)")
                return io
            except ImportError:
                log.info("io=auto: CUDA driver present but kvikio not installed; using posix")
        else:
            log.info("io=auto chose posix (no CUDA driver)")
    return PosixSlabIo(threads, direct=direct)
