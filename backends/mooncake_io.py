"""The Mooncake tier's I/O side: one Mooncake client and the threads that call it.

Nothing here runs on the owner's thread except ``submit`` (a queue put) and ``close``. Every
Mooncake call is made on these threads: ``io_threads`` threads for batches of stores and reads,
one thread that asks the master which names exist (it drains every query queued meanwhile into
one batch call), and one connector thread that sets the client up and retries while the master
is unreachable. Each finished batch comes back as a ``BatchDone`` on the results queue that
the tier's ``poll`` drains; these threads never touch the tier's state.

Bounded calls: Mooncake's own timeouts are set from ``timeout_s`` before the client is made
(``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS``, ``MC_TCP_PROGRESS_TIMEOUT_SEC``,
``MC_TCP_STATUS_TIMEOUT_SEC``, unless the operator set them), so a master or a peer that stops
answering fails each call within about that time; the tier's watchdog (``MooncakeTier.poll``)
also marks the link down when a call overruns. A batch always reports back once its call
returns; until then its rows stay pinned, because Mooncake may still be writing into them.

Zero copy: the first time a row of a memory region is seen (the staging region: every row view
is a slice of one mmap), the whole region is registered with the client, once; each thread has a
registered arena for the 64-byte headers. Stores and reads then move the rows between that memory
and the store with multi-buffer batch calls (header + row as one object), no copy in Python.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.backends.mooncake_config import MooncakeTierConfig
from tiering.backends.mooncake_value import HEADER_BYTES, META_NAME, ValueCodec, namespace_prefix
from tiering.settings import MOONCAKE_TRANSFER_AGAIN_WITHIN
from tiering.thread_names import name_os_thread

log = logging.getLogger(__name__)

# Mooncake's error codes (mooncake-store's ErrorCode) that decide what a failure is.
NOT_FOUND = -704  # OBJECT_NOT_FOUND: the name is not (or no longer) in the store
ALREADY_EXISTS = -705  # OBJECT_ALREADY_EXISTS: another engine stored it first
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room (the store is full)
RPC_RANGE = range(-999, -899)  # RPC_FAIL, RPC_TIMEOUT, ...: the master did not answer
# TRANSFER_FAIL (-800) and the transfer engine's other codes: a transfer that broke (TCP under
# load returns -800 now and then); the one failure that a second call may not meet
TRANSFER_RANGE = range(-899, -799)

RECONNECT_S = 1.0  # between setup attempts while the master is unreachable
SETUP_RETRIES = "1"  # Mooncake's own setup retries per attempt (we retry ourselves)


def reason_of(code: int) -> str:
    """Why a Mooncake call's per-item code is not a success ("" when it is)."""
    if code >= 0:
        return ""
    if code == NOT_FOUND:
        return "gone"
    if code == NO_SPACE:
        return "full"
    if code in RPC_RANGE:
        return "unavailable"
    return "transfer"


class Kind(enum.Enum):
    STORE = "store"
    READ = "read"
    EXISTS = "exists"
    REMOVE = "remove"


@dataclass
class Item:
    key: bytes
    name: str
    buf: memoryview | None = None  # the row to store / to read into
    token: Any = None


@dataclass
class Batch:
    kind: Kind
    items: list[Item]
    id: int = 0
    submitted: float = 0.0  # time.monotonic() at submit
    overran: bool = False  # the watchdog saw it overrun its timeout (owner thread only)


@dataclass
class BatchDone:
    batch: Batch
    reasons: list[str]  # one per item: "" done, or why not ("gone", "full", "checksum", ...)
    seconds: float = 0.0
    fault: str = ""  # the link failed during this batch ("unavailable", "not_set_up")
    detail: str = ""  # for the log line


@dataclass
class CallResult:
    """One Mooncake batch call, per item: why it failed ("" where it did not), what the log
    says of it, and whether a second call may succeed (a transfer that broke, or a binding
    that raised); and for the call: the link fault it met and its seconds."""

    reasons: list[str]
    details: list[str]
    again: list[bool]
    fault: str
    secs: float

    @property
    def detail(self) -> str:
        """What the log says of the batch: the first item that still failed."""
        return next((d for d, r in zip(self.details, self.reasons, strict=True) if r), "")


class LinkUp:
    """The connector's report: the client is set up (or setup failed with ``error``)."""

    def __init__(self, ok: bool, error: str = "") -> None:
        self.ok, self.error = ok, error


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _root_range(view: memoryview) -> tuple[int, int]:
    """(address, size) of the whole buffer ``view`` is a slice of (its exporting object)."""
    obj: Any = view.obj
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    try:
        whole = np.frombuffer(obj, dtype=np.uint8)
    except (TypeError, ValueError):
        return _address(view), len(view)
    start, size = int(whole.ctypes.data), whole.nbytes
    addr = _address(view)
    if not (start <= addr and addr + len(view) <= start + size):
        return addr, len(view)
    return start, size


def set_timeouts(timeout_s: float) -> None:
    """Bound Mooncake's master RPCs and TCP transfers by ``timeout_s`` (unless the operator set
    them; they are per process: the first mooncake tier of a process sets them). Without the TCP
    ones a transfer from a peer that stopped answering (frozen, partitioned) waits 30 s."""
    ms = str(max(100, int(timeout_s * 1000)))
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", ms)
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", ms)
    secs = str(max(1, math.ceil(timeout_s)))
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", secs)
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", secs)
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", SETUP_RETRIES)
    # Mooncake logs through glog at INFO by default (several lines per client and call); keep
    # its warnings and errors unless the operator chose a level
    os.environ.setdefault("GLOG_minloglevel", "1")


class MooncakeClient:
    """The client and its threads. ``submit``/``close`` from the owner; results on ``results``."""

    def __init__(self, cfg: MooncakeTierConfig, codec: ValueCodec, meta: dict[str, Any],
                 results: queue.SimpleQueue[BatchDone | LinkUp]) -> None:
        set_timeouts(cfg.timeout_s)
        from mooncake.store import MooncakeDistributedStore  # heavy import: only when used

        self.cfg, self.codec, self.results = cfg, codec, results
        self._meta = json.dumps(meta, sort_keys=True, default=str).encode()
        self._store = MooncakeDistributedStore()
        self._set_up = threading.Event()
        self._stop = threading.Event()
        self._registered: list[tuple[int, int]] = []
        self._register_lock = threading.Lock()
        # each I/O thread's slice of one header arena, registered right after setup
        self._headers = np.zeros(cfg.io_threads * cfg.batch_rows * HEADER_BYTES, dtype=np.uint8)
        self._data: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._exists: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self.hostname = ""
        self._threads = [threading.Thread(target=self._connect, name="mooncake-connect",
                                          daemon=True),
                         threading.Thread(target=self._exists_loop, name="mooncake-exists",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._data_loop, args=(i,),
                                           name=f"mooncake-io-{i}", daemon=True)
                          for i in range(cfg.io_threads)]
        for t in self._threads:
            t.start()

    # -- owner thread ---------------------------------------------------------------------------
    @property
    def set_up(self) -> bool:
        return self._set_up.is_set()

    def submit(self, batch: Batch) -> None:
        (self._exists if batch.kind is Kind.EXISTS else self._data).put(batch)

    def close(self, timeout: float) -> None:
        """Stop the threads (each finishes its current call) and close the client. A call that
        does not return within ``timeout`` is left behind (daemon threads), never waited for
        forever."""
        self._stop.set()
        for _ in range(self.cfg.io_threads):
            self._data.put(None)
        self._exists.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("mooncake tier: a Mooncake call did not return within %.0fs at shutdown; "
                        "leaving the client open", timeout)
            return
        if self.set_up:
            closer = threading.Thread(target=self._close_client, daemon=True)
            closer.start()
            closer.join(max(1.0, deadline - time.monotonic()))

    def _close_client(self) -> None:
        with contextlib.suppress(Exception):
            for addr, _ in self._registered:
                self._store.unregister_buffer(addr)
            self._store.close()

    # -- connector thread ----------------------------------------------------------------------
    def _connect(self) -> None:
        name_os_thread("mooncake-connect")
        cfg, last_error = self.cfg, None
        while not self._stop.is_set():
            try:
                rc = self._store.setup(cfg.local_hostname or _default_hostname(),
                                       cfg.metadata, cfg.segment_bytes, cfg.local_buffer_bytes,
                                       cfg.protocol, cfg.rdma_devices, cfg.master)
                error = "" if rc == 0 else f"setup returned {rc}"
            except Exception as exc:  # a bad address and the like: keep trying, say why
                error = f"setup raised {type(exc).__name__}: {exc}"
            if not error and not self._register(self._headers.data):
                error = "cannot register the header arena"
            if not error:
                self.hostname = str(self._store.get_hostname())
                self._set_up.set()
                self._publish_meta()
                self.results.put(LinkUp(True))
                return
            if error != last_error:
                self.results.put(LinkUp(False, error))
                last_error = error
            self._stop.wait(RECONNECT_S)

    def _publish_meta(self) -> None:
        """Record the namespace's facts beside its chunks (tools show them); best effort."""
        name = namespace_prefix(self.codec.namespace_id) + META_NAME
        with contextlib.suppress(Exception):
            if self._store.is_exist(name) != 1:
                self._store.put(name, self._meta)

    # -- I/O threads ------------------------------------------------------------------------------
    def _exists_loop(self) -> None:
        name_os_thread("mooncake-exists")
        while True:
            batch = self._exists.get()
            if batch is None:
                return
            batches = [batch]
            with contextlib.suppress(queue.Empty):
                while len(batches) < 256:
                    more = self._exists.get_nowait()
                    if more is None:
                        self._exists.put(None)
                        break
                    batches.append(more)
            names = [it.name for b in batches for it in b.items]

            def exists(names: list[str] = names) -> Sequence[int]:
                return self._store.batch_is_exist(names)  # type: ignore[no-any-return]

            reasons, fault, detail, secs = self._call(
                exists, len(names),
                lambda codes: ["" if c == 1 else ("gone" if c == 0 else "unavailable")
                               for c in codes])
            at = 0
            for b in batches:
                n = len(b.items)
                self.results.put(BatchDone(b, reasons[at:at + n], secs, fault, detail))
                at += n

    def _data_loop(self, i: int) -> None:
        name_os_thread(f"mooncake-io-{i}")
        n = self.cfg.batch_rows * HEADER_BYTES
        headers = self._headers[i * n:(i + 1) * n]
        while True:
            batch = self._data.get()
            if batch is None:
                return
            if batch.kind is Kind.REMOVE:
                self.results.put(self._remove(batch))
            elif not self.set_up:
                self.results.put(BatchDone(batch, ["unavailable"] * len(batch.items),
                                           fault="not_set_up", detail="client not set up"))
            else:
                self.results.put(self._transfer(batch, headers))

    def _call(self, fn: Callable[[], Sequence[int]], n: int,
              reasons_of: Callable[[Sequence[int]], list[str]]
              ) -> tuple[list[str], str, str, float]:
        """Run one Mooncake batch call: (reasons per item, link fault, detail, seconds)."""
        r = self._call_items(fn, n, reasons_of)
        return r.reasons, r.fault, r.detail, r.secs

    def _call_items(self, fn: Callable[[], Sequence[int]], n: int,
                    reasons_of: Callable[[Sequence[int]], list[str]]) -> CallResult:
        if not self.set_up:
            return CallResult(["unavailable"] * n, ["client not set up"] * n, [False] * n,
                              "not_set_up", 0.0)
        t0 = time.perf_counter()
        try:
            codes = list(fn())
        except Exception as exc:  # the binding raised (should not): every item failed
            return CallResult(["transfer"] * n, [f"{type(exc).__name__}: {exc}"] * n,
                              [True] * n, "", time.perf_counter() - t0)
        secs = time.perf_counter() - t0
        if len(codes) != n:
            return CallResult(["transfer"] * n, [f"{len(codes)} results for {n} items"] * n,
                              [True] * n, "", secs)
        reasons = reasons_of(codes)
        fault = "unavailable" if any(r == "unavailable" for r in reasons) else ""
        return CallResult(reasons, [f"code {c}" if r else "" for c, r in zip(codes, reasons,
                                                                               strict=True)],
                          [bool(r) and c in TRANSFER_RANGE for c, r in zip(codes, reasons,
                                                                         strict=True)],
                          fault, secs)

    def _transfer(self, batch: Batch, headers: np.ndarray) -> BatchDone:
        items, rb = batch.items, self.codec.row_bytes
        hview = headers.data
        haddr = _address(hview)
        bufs: list[memoryview] = []
        for it in items:
            assert it.buf is not None
            if not self._register(it.buf):
                return BatchDone(batch, ["transfer"] * len(items),
                                 detail="cannot register the row memory")
            bufs.append(it.buf)
        names = [it.name for it in items]
        ptrs = [[haddr + i * HEADER_BYTES, _address(b)] for i, b in enumerate(bufs)]
        sizes = [[HEADER_BYTES, rb]] * len(items)
        if batch.kind is Kind.STORE:
            for i, (it, b) in enumerate(zip(items, bufs, strict=True)):
                self.codec.pack(it.key, b, hview[i * HEADER_BYTES:(i + 1) * HEADER_BYTES])
            r = self._once_more(self._put, "puts", names, ptrs, sizes)
            return BatchDone(batch, r.reasons, r.secs, r.fault, r.detail)
        r = self._once_more(self._read, "reads", names, ptrs, sizes)
        for i, (it, b) in enumerate(zip(items, bufs, strict=True)):
            if not r.reasons[i]:
                r.reasons[i] = self.codec.check(
                    it.key, hview[i * HEADER_BYTES:(i + 1) * HEADER_BYTES], b, self.cfg.verify)
                if r.reasons[i]:
                    r.details[i] = f"the value's {r.reasons[i]} check failed"
        return BatchDone(batch, r.reasons, r.secs, r.fault, r.detail)

    def _once_more(self, call: Callable[[list[str], list[list[int]], list[list[int]]],
                                        CallResult],
                   what: str, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
                   ) -> CallResult:
        """``call`` (a batch put or get); the items whose failure a second call may not meet
        (``CallResult.again``: a transfer error, ``TRANSFER_RANGE``) are sent once more when the
        first call was quick (``MOONCAKE_TRANSFER_AGAIN_WITHIN``) and the link is not at fault.
        A put whose transfer failed was revoked by Mooncake's client, so sending it again cannot
        find a half-written value. Other failures (full, gone, invalid) would fail the same way
        and are not sent again."""
        r = call(names, ptrs, sizes)
        again = [i for i, a in enumerate(r.again) if a]
        if not again or r.fault or r.secs >= MOONCAKE_TRANSFER_AGAIN_WITHIN * self.cfg.timeout_s:
            return r
        log.debug("mooncake: %d of %d %s failed (%s); sending them again", len(again),
                  len(names), what, r.details[again[0]])
        r2 = call([names[i] for i in again], [ptrs[i] for i in again], [sizes[i] for i in again])
        for j, i in enumerate(again):
            r.reasons[i], r.details[i], r.again[i] = r2.reasons[j], r2.details[j], r2.again[j]
        r.fault, r.secs = r2.fault, r.secs + r2.secs
        return r

    def _put(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
             ) -> CallResult:
        return self._call_items(
            lambda: self._store.batch_put_from_multi_buffers(names, ptrs, sizes), len(names),
            lambda codes: ["" if c in (0, ALREADY_EXISTS) else reason_of(c) for c in codes])

    def _read(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
              ) -> CallResult:
        rb = self.codec.row_bytes
        return self._call_items(
            lambda: self._store.batch_get_into_multi_buffers(names, ptrs, sizes), len(names),
            lambda codes: [reason_of(c) if c < 0 else ("" if c == HEADER_BYTES + rb else "short")
                           for c in codes])

    def _remove(self, batch: Batch) -> BatchDone:
        reasons, fault, detail, secs = self._call(
            lambda: self._store.batch_remove([it.name for it in batch.items], False),
            len(batch.items), lambda codes: [reason_of(c) if c != NOT_FOUND else ""
                                             for c in codes])
        return BatchDone(batch, reasons, secs, fault, detail)

    def registered_regions(self) -> list[tuple[int, int]]:
        """(address, size) of every memory region registered with the client so far."""
        with self._register_lock:
            return list(self._registered)

    def _register(self, view: memoryview) -> bool:
        """Register the memory region ``view`` lies in with the client, once per region."""
        addr = _address(view)
        with self._register_lock:
            if any(a <= addr and addr + len(view) <= a + n for a, n in self._registered):
                return True
            start, size = _root_range(view)
            try:
                rc = self._store.register_buffer(start, size)
            except Exception as exc:
                log.warning("mooncake tier: registering %d bytes at %#x failed: %s", size, start,
                            exc)
                return False
            if rc != 0:
                log.warning("mooncake tier: registering %d bytes at %#x returned %d", size,
                            start, rc)
                return False
            self._registered.append((start, size))
            return True


def _default_hostname() -> str:
    """This host as other clients reach it, without a port (Mooncake picks a free one)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing address
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


@dataclass
class InFlight:
    """The owner's record of submitted batches (for the watchdog and has_pending_work)."""

    batches: dict[int, Batch] = field(default_factory=dict)
    next_id: int = 0

    def add(self, batch: Batch) -> Batch:
        batch.id, self.next_id = self.next_id, self.next_id + 1
        batch.submitted = time.monotonic()
        self.batches[batch.id] = batch
        return batch

    def done(self, batch: Batch) -> None:
        self.batches.pop(batch.id, None)

    def overrun(self, timeout_s: float) -> list[Batch]:
        """Batches in flight for longer than ``timeout_s`` not reported before."""
        now, late = time.monotonic(), []
        for b in self.batches.values():
            if not b.overran and now - b.submitted > timeout_s:
                b.overran = True
                late.append(b)
        return late
