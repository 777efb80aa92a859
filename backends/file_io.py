"""The file tier's write side: the committer thread and the write protocol (reads: ``slot_reads.py``).

Write protocol (one batch = all jobs queued since the last one, up to ``max_batch`` rows):

1. **reserve** — one LMDB txn deletes the keys this batch evicts or drops and marks the batch's
   slots reserved (owner pid). If a slot is being reused, that txn is synced to disk first: the
   old key must be gone from the index before its slot holds other bytes.
2. **write** — each row is encoded (optional zstd), checksummed (xxh3-64 seeded by its key and
   namespace, so a record pointing at another key's slot fails the check) and written to its slot
   on the slab I/O's worker threads, in parallel.
3. **sync** — one ``fdatasync`` per slab file the batch touched.
4. **publish** — one LMDB txn adds the records of the rows that were written, clears the
   reservations and adds the batch's counters.

A crash anywhere leaves each slot either published with a checksum that matches its bytes, or
unindexed (free on the next open). Reads verify the checksum, so even a slot whose bytes were
lost after publish (power loss with a lying disk cache) is a miss, never wrong KV.

Nothing here touches the tier's in-memory state: results go back through ``out`` (a queue the
scheduler thread drains in ``FileTier.poll``).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import stat
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from tiering.backends.checksum import checksum_of
from tiering.backends.codec import ZstdCodec
from tiering.backends.index import Index, pack_record
from tiering.backends.namespace import load_json
from tiering.backends.slab import SlabSet, adjacent_runs, run_rows
from tiering.backends.slab_io import ALIGN, SlabIo
from tiering.settings import (
    HOUSEKEEPING_SECONDS,
    MIN_RUN_BYTES,
    MIN_WRITE_RUN_BYTES,
    OVERLAP_BATCHES,
)
from tiering.thread_names import name_os_thread

log = logging.getLogger(__name__)
REQUEST_NAME = re.compile(r"^[0-9a-f]{12}\.json$")  # what admin.submit_request writes


def _read_request(path: Path) -> bytes:
    """A tool's request file: a regular file of one name, at most 1 MiB, never through a link
    and never waiting on a fifo (the committer thread must not block on what was planted)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ValueError("not a regular file of one name; a tool writes one")
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


def failure_reason(exc: BaseException) -> str:
    """How a failed write is counted: ``full`` for a full disk or index, else ``error``."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "full"
    if isinstance(exc, lmdb.MapFullError) or (
            isinstance(exc, lmdb.Error) and "No space left" in str(exc)):
        return "full"  # LMDB reports the system's ENOSPC as its own error type
    return "error"


@dataclass
class WriteItem:
    key: bytes
    slot: int
    row: memoryview
    created: float


@dataclass
class Job:
    """Work for the committer. Any field may be empty (a stats-only flush is a Job too)."""

    writes: list[WriteItem] = field(default_factory=list)
    drop_keys: list[bytes] = field(default_factory=list)  # delete from the index first
    reused_slots: bool = False  # a slot in ``writes`` belonged to a key in drop_keys
    freed_slots: list[int] = field(default_factory=list)  # hand back once drop_keys are gone
    records: list[tuple[bytes, bytes]] = field(default_factory=list)  # refreshed access stats
    stats: dict[str, int] = field(default_factory=dict)
    done: threading.Event | None = None
    reply: tuple[str, dict[str, Any]] | None = None  # admin reply written once this job is committed


@dataclass(slots=True)
class WriteResult:
    key: bytes
    slot: int
    ok: bool
    length: int = 0
    codec: int = 0
    checksum: int = 0
    reason: str = ""
    seconds: float = 0.0


@dataclass
class WritesDone:
    """The outcome of one group commit: one WriteResult per row, in one queue message."""

    results: list[WriteResult]


@dataclass
class SlotsFreed:
    slots: list[int]


@dataclass
class AdminRequest:
    """An operation a tool left in ``requests/`` (see ``admin.py``); applied by the owner."""

    reply_path: str
    op: dict[str, Any]


class PendingMeta:
    """Access stats and counters waiting to be persisted, shared by owner and committer.

    The owner thread adds packed records (``touch``) and counts; any job it submits takes them
    along, and when the committer has been idle for a second it takes them itself, so recency
    and counters reach LMDB even when no write follows (an idle server, a killed process).
    A dropped key is discarded here before its drop job is queued, so a stale record can never
    bring it back (the committer takes and publishes a snapshot before processing later jobs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[bytes, bytes] = {}
        self._stats: dict[str, int] = {}

    def record(self, key: bytes, packed: bytes) -> None:
        with self._lock:
            self._records[key] = packed

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._records.pop(key, None)

    def count(self, name: str, n: int) -> None:
        with self._lock:
            self._stats[name] = self._stats.get(name, 0) + n

    def give_back(self, stats: dict[str, int]) -> None:
        """Counters whose transaction failed (a full disk): persisted with a later one.
        (Access-stat records are not given back: a key dropped meanwhile must stay dropped.)"""
        with self._lock:
            for name, n in stats.items():
                self._stats[name] = self._stats.get(name, 0) + n

    def take(self) -> tuple[list[tuple[bytes, bytes]], dict[str, int]]:
        with self._lock:
            records, stats = list(self._records.items()), self._stats
            self._records, self._stats = {}, {}
        return records, stats


@dataclass
class _Flight:
    """A batch whose slots are reserved and whose rows are being written."""

    batch: list[Job]
    writes: list[WriteItem]
    drop: list[bytes]
    slots: list[int]
    futures: list[Future[list[WriteResult]]]


class Committer(threading.Thread):
    """Single thread that owns every write transaction of one namespace."""

    def __init__(self, index: Index, slabs: SlabSet, io: SlabIo, out: queue.SimpleQueue[object],
                 codec: ZstdCodec | None, max_batch: int, pending: PendingMeta) -> None:
        super().__init__(name="tier-committer", daemon=True)
        self.index, self.slabs, self.io, self.out = index, slabs, io, out
        self.codec = codec
        self.max_batch = max_batch
        self.pending = pending
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.pid = os.getpid()
        # the tier's own work between jobs (the promotion advisor's state to keep), if any
        self.housekeeping_hook: Callable[[], None] | None = None
        # overlap only batches that give every I/O thread at least one full-size run
        self._overlap_rows = io.threads * -(-MIN_RUN_BYTES // slabs.slot_bytes)

    def run(self) -> None:
        name_os_thread(self.name)
        # Two batches overlap when enough work is queued: once a batch's rows are written, the
        # next batch (the jobs queued meanwhile) is reserved and its writes started before the
        # first one is synced and published, so the device is not idle during fdatasync and
        # the index commits. With too little queued (a closed loop whose next jobs wait for
        # this batch's completions), the batch in flight is finished first and the jobs gather
        # into a larger group commit. A lone write or a flush never waits for a later job.
        flight: _Flight | None = None
        next_housekeeping = 0.0
        while True:
            now = time.monotonic()
            if now >= next_housekeeping:  # bounded, however busy the writer is
                next_housekeeping = now + HOUSEKEEPING_SECONDS
                self._housekeeping()
            if flight is None:
                try:
                    job = self.jobs.get(timeout=1.0)
                except queue.Empty:  # idle for a second
                    self._idle()
                    continue
                if job is None:
                    return
                batch, stop = self._gather([job])
            else:
                wait_futures(flight.futures)  # the next batch gathers while these are written
                batch, stop = self._gather([])
                if not stop and sum(len(j.writes) for j in batch) < self._overlap_rows:
                    self._finish(flight, set())
                    flight = None
                    if not batch:
                        continue
                    batch, stop = self._gather(batch)  # what came in during the commit
            if batch:
                started = self._start(batch)
                if flight is not None:
                    # keys this batch drops were deleted by its reserve: the batch before it
                    # must not bring them back through an older access-stats record
                    self._finish(flight, {k for j in batch for k in j.drop_keys})
                flight = started
                if not OVERLAP_BATCHES:
                    self._finish(flight, set())
                    flight = None
            if stop:
                self._finish(flight, set())
                return

    def _gather(self, batch: list[Job]) -> tuple[list[Job], bool]:
        """Add queued jobs (without waiting) up to ``max_batch`` rows; True if told to stop."""
        rows = sum(len(j.writes) for j in batch)
        while rows < self.max_batch:
            try:
                nxt = self.jobs.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return batch, True
            batch.append(nxt)
            rows += len(nxt.writes)
        return batch, False

    def _idle(self) -> None:
        records, stats = self.pending.take()
        if records or stats:
            try:
                self.index.publish(records, [], stat_delta=stats)
            except Exception:  # a full disk: keep serving, counters go with a later txn
                log.exception("file tier: persisting access stats failed")
                self.pending.give_back(stats)

    def _housekeeping(self) -> None:
        """Between jobs: free the reader slots of killed tools (a dead reader pins LMDB's
        oldest snapshot, so freed pages are never reused and the map fills up), then hand
        the owner the tools' admin requests."""
        try:
            cleared = self.index.clear_stale_readers()
            if cleared:
                log.warning("file tier %s: cleared %d reader slot(s) of dead processes",
                            self.index.path.parent, cleared)
            self._take_requests()
            if self.housekeeping_hook is not None:
                self.housekeeping_hook()
        except Exception:  # housekeeping must never stop the committer
            log.exception("file tier: committer housekeeping failed")

    def _start(self, batch: list[Job]) -> _Flight | None:
        """Reserve the batch's slots and start writing its rows; None if that failed (the
        batch's writes are then reported failed and its waiters released)."""
        try:
            return self._begin(batch)
        except Exception as exc:  # never let the thread die: fail the batch's writes instead
            self._fail(batch, exc)
            return None

    def _finish(self, flight: _Flight | None, later_drops: set[bytes]) -> None:
        if flight is None:
            return
        try:
            self._complete(flight, later_drops)
        except Exception as exc:
            self._fail(flight.batch, exc)
            return
        self._release(flight.batch)

    def _fail(self, batch: list[Job], exc: BaseException) -> None:
        if sys.is_finalizing():  # the process is exiting without close(): nothing
            return  # was published, so the slots are free on the next open
        reason = failure_reason(exc)
        log.error("file tier: batch commit failed (%s): %s", reason, exc)
        for j in batch:  # their counters are persisted with a later transaction
            self.pending.give_back(j.stats)
        failed = [WriteResult(w.key, w.slot, False, reason=reason)
                  for j in batch for w in j.writes]
        if failed:
            self.out.put(WritesDone(failed))
        self._release(batch)

    def _release(self, batch: list[Job]) -> None:
        for j in batch:
            if j.reply is not None:
                self._reply(*j.reply)
            if j.done is not None:
                j.done.set()

    def _take_requests(self) -> None:
        req_dir = self.index.path.parent / "requests"
        if os.path.islink(req_dir) or not req_dir.is_dir():  # never read requests via a link
            return
        for path in sorted(req_dir.glob("*.json")):
            if not REQUEST_NAME.match(path.name):  # only a tool's request (uuid hex): never
                continue  # rename a file someone else put there
            try:
                op = load_json(_read_request(path))
                path.rename(path.with_suffix(".taken"))
            except (OSError, ValueError) as exc:
                log.warning("file tier: ignoring unreadable admin request %s: %s", path, exc)
                continue
            self.out.put(AdminRequest(str(path.with_suffix(".done")), op))

    def _reply(self, path: str, payload: dict[str, Any]) -> None:
        from tiering.backends.namespace import write_json

        try:
            write_json(Path(path), payload)
            Path(path).with_suffix(".taken").unlink(missing_ok=True)
        except OSError as exc:
            log.warning("file tier: cannot write admin reply %s: %s", path, exc)

    def _begin(self, batch: list[Job]) -> _Flight:
        writes = [w for j in batch for w in j.writes]
        drop = [k for j in batch for k in j.drop_keys]
        slots = [w.slot for w in writes]
        # Deleting a key whose slot will hold other bytes must reach the disk first.
        durable = any(j.reused_slots or j.freed_slots for j in batch)
        if writes or drop:
            self.index.reserve(slots, drop, self.pid, durable)
        # Adjacent slots are written with one vectored call; runs are sized so that every
        # slab I/O thread gets work (the device sees as many I/Os in flight as there are threads).
        per_run = run_rows(len(writes), self.io.threads, self.slabs.slot_bytes, 0,
                           MIN_WRITE_RUN_BYTES)
        runs = adjacent_runs(writes, self.slabs, per_run, lambda w: w.slot)
        futures: list[Future[list[WriteResult]]] = [self.io.submit(self._write_run, run) for run in runs]
        return _Flight(batch, writes, drop, slots, futures)

    def _complete(self, flight: _Flight, later_drops: set[bytes]) -> None:
        """Wait for the batch's rows, sync the slab files they went to, publish the batch."""
        batch, writes, slots = flight.batch, flight.writes, flight.slots
        stats: dict[str, int] = {}
        for j in batch:
            for name, v in j.stats.items():
                stats[name] = stats.get(name, 0) + v
        by_key = {r.key: r for f in flight.futures for r in f.result()}
        results: list[WriteResult] = [by_key[w.key] for w in writes]
        touched = {self.slabs.locate(r.slot)[2] for r in results if r.ok}
        for f in touched:
            try:
                self.io.sync(self.slabs.handle(f))
            except OSError as exc:  # data may not be durable: publish none of this file
                log.error("file tier: fdatasync of slab %d failed: %s", f, exc)
                for r in results:
                    if r.ok and self.slabs.locate(r.slot)[2] == f:
                        r.ok, r.reason = False, "error"
        # A key dropped in this batch must not come back through an older access-stats record.
        dropped = set(flight.drop) | later_drops
        records = [rec for j in batch for rec in j.records if rec[0] not in dropped]
        for r, w in zip(results, writes, strict=True):
            if r.ok:  # (counted by the owner when it applies the result)
                records.append((r.key, pack_record(r.slot, r.length, r.codec, r.checksum,
                                                   w.created, w.created, 0)))
        self.index.publish(records, slots, stat_delta=stats)
        if results:
            self.out.put(WritesDone(results))
        freed = [s for j in batch for s in j.freed_slots]
        if freed:
            self.out.put(SlotsFreed(freed))

    def _write_run(self, run: list[WriteItem]) -> list[WriteResult]:
        """Encode and checksum each row, then write the run (vectored where rows are raw)."""
        t0 = time.perf_counter()
        staged = []
        for w in run:
            codec, payload = 0, w.row
            if self.codec is not None:
                packed = self.codec.encode(w.row)
                if len(packed) < len(w.row) - ALIGN:  # worth it only if it saves a page
                    codec, payload = 1, memoryview(packed)
            staged.append((w, codec, payload, checksum_of(self.slabs.seed, w.key, payload)))
        results = []
        i = 0
        while i < len(staged):
            j = i + 1
            if staged[i][1] == 0:  # extend over following raw rows (slots are consecutive)
                while j < len(staged) and staged[j][1] == 0:
                    j += 1
            group = staged[i:j]
            handle, offset, _ = self.slabs.locate(group[0][0].slot)
            try:
                self.io.writev(handle, [g[2] for g in group], offset)
                ok, reason = True, ""
            except OSError as exc:
                log.warning("file tier: write of slots %d..%d failed: %s", group[0][0].slot,
                            group[-1][0].slot, exc)
                ok, reason = False, failure_reason(exc)
            secs = time.perf_counter() - t0
            for w, codec, payload, checksum in group:
                results.append(WriteResult(w.key, w.slot, ok, len(payload), codec, checksum,
                                           reason, secs) if ok else
                               WriteResult(w.key, w.slot, False, reason=reason))
            i = j
        return results
