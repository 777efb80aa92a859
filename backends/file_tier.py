"""FileTier: a bounded, crash-safe, restart-persistent store of fixed-size rows on a filesystem.

On disk: ``<path>/<namespace>/`` holds ``meta.json``, ``writer.lock``, ``index.lmdb/`` and
``slab-NNNN.dat`` files (see ``namespace.py``, ``index.py``, ``slab.py``, docs/file-tier.md).

Threading contract: every public method is called from one thread (the owner: vLLM's scheduler
thread) and none of them blocks on I/O. Writes and reads run on the slab I/O's threads and the
committer thread; their results come back through a queue that ``poll()`` drains, and only then
does the in-memory state change. ``wait_idle`` and ``close`` are the only blocking calls.

State of a key and its slot: the slot table (``slot_table.py``) holds it, one asserted state
per slot: a key is *writing* (``put`` accepted it; pinned, not readable), then *ready*
(``poll`` saw its publish), *reading* while reads of it are in flight (pinned), and absent
again once evicted, dropped or found bad (its slot *dropping* until the index forgets it).
A key is readable (``contains``) when ready or reading. The contract: ``tiering.tier.StoreTier``.

Failure rules: a failed or short write leaves no index entry (counted ``rejections{reason}``); a read
that fails, comes back short or fails its checksum is a miss — the key is dropped from the index
before its slot is reused, and counted. Nothing raises into the owner's thread on I/O faults.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiering.backends.admin_ops import apply_request
from tiering.backends.codec import ZstdCodec
from tiering.backends.file_config import FileTierConfig, check_types, validate
from tiering.backends.file_io import (
    AdminRequest,
    Committer,
    Job,
    PendingMeta,
    SlotsFreed,
    WriteItem,
    WritesDone,
)
from tiering.backends.file_state import (
    AdvisorStateKeeper,
    NamespaceLocked,  # noqa: F401 - part of this module's interface
    acquire_writer_lock,
    announce,
    load_advisor_state,
)
from tiering.backends.index import MAX_KEY_BYTES, Index
from tiering.backends.namespace import (
    NamespaceFacts,
    check_folder,
    check_for_writer,
    make_dirs,
    open_meta,
)
from tiering.backends.slab import SlabSet
from tiering.backends.slab_io import make_slab_io
from tiering.backends.slot_reads import ReadItem, ReadsDone, start_reads
from tiering.backends.slot_table import READABLE, WRITING, Entry, SlotState, SlotTable
from tiering.policies import EvictionPolicy, StoreThreshold, create, evict_or_none
from tiering.settings import (
    COMMIT_BATCH_BYTES,
    COMMIT_BATCH_MAX_ROWS,
    COMMIT_BATCH_MIN_ROWS,
    INDEX_MAP_BASE_BYTES,
    INDEX_MAP_BYTES_PER_SLOT,
)
from tiering.stats import TierStats
from tiering.tier import Completion, Lookup, PutOutcome, StoreTier, check_put

log = logging.getLogger(__name__)


class FileTier(StoreTier):
    """A store tier of slots in slab files with an LMDB index (the contract:
    ``tiering.tier.StoreTier``; slot states: ``slot_table.SlotTable``)."""

    medium = "file"
    policy: EvictionPolicy[bytes]
    _removed_listener: Callable[[list[bytes]], None] | None = None  # see on_removed

    def __init__(self, cfg: FileTierConfig | dict[str, Any], facts: NamespaceFacts,
                 info: dict[str, Any] | None = None) -> None:
        cfg = FileTierConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
        self.cfg, self.facts = cfg, facts
        self.row_bytes = facts.row_bytes
        self.policy_spec = cfg.policy
        self.demote = cfg.demote
        check_types(cfg)  # before the path is used at all
        self.folder = Path(cfg.path) / facts.namespace_id
        # raises before anything is created; counts what this namespace already holds as ours
        nums = validate(cfg, self.row_bytes, facts.namespace_id)
        self.capacity, self.n_slots = nums["capacity"], nums["n_slots"]

        make_dirs(Path(cfg.path))  # every folder it creates 0700, whatever the umask
        if os.path.lexists(self.folder):
            check_for_writer(self.folder)  # proven ours (or an empty start) before a byte is written
        else:
            make_dirs(self.folder)
        self._lock_fd = acquire_writer_lock(self.folder)
        try:
            self._open(cfg, facts, info or {}, nums)
        except BaseException:
            self._abandon_open()
            raise

    def _abandon_open(self) -> None:
        """Undo a failed ``_open``: no thread, file or lock of a half-opened tier survives."""
        committer = getattr(self, "committer", None)
        if committer is not None and committer.is_alive():
            committer.jobs.put(None)
            committer.join(timeout=30)
        undos: tuple[tuple[str, Callable[[Any], object]], ...] = (
            ("io", lambda e: e.shutdown()),
            ("slabs", lambda s: hasattr(self, "io") and s.close(self.io)),
            ("index", lambda i: i.close()))
        for name, undo in undos:
            part = getattr(self, name, None)
            if part is not None:
                try:
                    undo(part)
                except Exception:  # already failing: keep the first error
                    log.exception("file tier %s: cleaning up %s after a failed open", self.folder,
                                  name)
        os.close(self._lock_fd)

    def _open(self, cfg: FileTierConfig, facts: NamespaceFacts, info: dict[str, Any],
              nums: dict[str, int]) -> None:
        # no planted links, nothing of another user under our names; names the tier never
        # writes (a .nfsXXXX file, an editor's backup) stay as they are, never opened
        foreign = check_folder(self.folder, allow_foreign=True)
        if foreign:
            log.warning("%s: holds %s, which vllm-tiering does not write; serving anyway and "
                        "leaving them as they are (tiering evict/clear refuse this folder until "
                        "they are moved out)", self.folder, ", ".join(map(repr, foreign[:10])))
        self.meta = open_meta(self.folder, facts, {"element_bytes": cfg.element_bytes, **info},
                              nums["slab_file_bytes"], self.n_slots)
        self.index = Index.open_for_writer(
            self.folder, map_size=INDEX_MAP_BASE_BYTES + self.n_slots * INDEX_MAP_BYTES_PER_SLOT)
        reclaimed = self.index.reclaim_reservations()
        if reclaimed:
            log.warning("%s: reclaimed %d slots reserved by a writer that died mid-write",
                        self.folder, len(reclaimed))
        self.slabs = SlabSet(self.folder, self.row_bytes, self.n_slots, self.meta["slab_file_bytes"])
        self.slabs.create_or_resize(cfg.preallocate)
        self.index.reserve_headroom()  # after the slabs: they have the first claim on space
        self.io = make_slab_io(cfg.io, cfg.io_threads, direct=cfg.direct)
        self.slabs.open(self.io)
        self.codec = ZstdCodec(cfg.compression_level, int(self.meta.get("element_bytes", 2)))
        self.policy = create(cfg.policy, self.n_slots)
        self.admission = StoreThreshold(cfg.store_threshold, cfg.tracker_size)
        self._rebuild()
        self._results: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.pending = PendingMeta()  # access stats and counters not yet in LMDB
        self.committer = Committer(self.index, self.slabs, self.io, self._results,
                                   self.codec if cfg.compression == "zstd" else None,
                                   cfg.max_batch or max(COMMIT_BATCH_MIN_ROWS, min(
                                       COMMIT_BATCH_MAX_ROWS, COMMIT_BATCH_BYTES // self.row_bytes)),
                                   self.pending)
        # the promotion advisor's state, written between the committer's jobs while serving
        self._advisor_state = AdvisorStateKeeper(self.folder, lambda: self.closed)
        self.committer.housekeeping_hook = self._advisor_state.write_offer
        self.committer.start()
        # this process's counters; each increment is also persisted with the next index txn
        self.stats = TierStats(on_add=self.pending.count)
        if self._lost_to_damaged_slabs:  # rows in a damaged slab file: counted misses
            self.stats.add("io_errors", self._lost_to_damaged_slabs)
        self.closed = False
        announce(self)

    def _rebuild(self) -> None:
        """Load the index into the slot table, and the policy's order from it."""
        self.slots, ordered_keys, reused = SlotTable.load(self.index, self.n_slots, self.folder,
                                                          self.slabs.unusable_slots())
        self._lost_to_damaged_slabs = self.slots.dropped_unusable
        # read-only aliases for the scheduler's hottest path (lookup); only the table's
        # methods change them
        self._slot_of, self._state = self.slots.slot_of, self.slots.state
        self.policy.bulk_load(ordered_keys, reused)

    # -- queries (owner thread) ---------------------------------------------------------------
    def on_removed(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """Call ``listener(keys)`` on the owner thread whenever stored keys leave the tier
        (evicted by ``put``/``evict``, dropped after a bad read, by ``drop``/``clear`` or an
        admin request), e.g. to tell a KV-event consumer. ``None`` removes it."""
        self._removed_listener = listener

    def contains(self, key: bytes) -> bool:
        slot = self._slot_of.get(key)
        return slot is not None and self._state[slot] >= READABLE

    def lookup(self, key: bytes, count: bool = True) -> Lookup:
        slot = self._slot_of.get(key)
        if slot is not None and self._state[slot] >= READABLE:
            if count:
                self.count_lookup(key, True)
            return Lookup.HIT
        if count:
            self.count_lookup(key, False)
        return Lookup.MISS if slot is None else Lookup.PENDING

    def __len__(self) -> int:
        return len(self.slots)

    def keys(self) -> list[bytes]:
        """Every key held (writing, ready or being read), oldest loaded first."""
        return list(self._slot_of)

    def calibration_keys(self, limit: int) -> list[bytes]:
        """The most recently loaded readable keys, at most ``limit`` (a restarted engine's
        calibration read at start)."""
        out: list[bytes] = []
        for key in reversed(self._slot_of):  # newest first, without copying every key
            if len(out) >= limit:
                break
            if self.contains(key):
                out.append(key)
        return out[::-1]

    def entry(self, key: bytes) -> Entry | None:
        return self.slots.entry(key)

    def usage(self) -> tuple[int, int, int]:
        n = len(self.slots)
        return n * self.row_bytes, self.capacity, n

    @property
    def io_name(self) -> str:
        return self.io.describe()

    def has_pending_work(self) -> bool:
        return bool(self.slots.reads or self.slots.writing)

    # -- writes (owner thread) ------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], rows: Sequence[memoryview] | None) -> PutOutcome:
        """Offer rows for storing; the admitted ones are written in the background.

        ``keys`` are one request's chunks in prefix order. The caller keeps each admitted row's
        memory unchanged until ``poll`` reports that key's ``store`` completion.
        """
        rows = check_put(keys, rows, self.row_bytes, self._check_key)
        out = PutOutcome()
        accepted, items, drop, reused = out.admitted, [], [], False
        now = time.time()
        table = self.slots
        for key, row in zip(keys, rows, strict=True):
            if key in table:
                continue
            if not self.admission.offer(key):
                out.rejected[key] = "threshold"  # counted once per call, below
                continue
            if table.free:
                slot = table.reserve(key, now)
            else:
                victims = evict_or_none(self.policy, 1, protected=keys)
                if victims is None:
                    out.rejected[key] = "full"
                    self.stats.reject("full")
                    continue
                victim = victims[0]
                slot = table.reuse(victim, key, now)
                self.pending.discard(victim)
                drop.append(victim)
                out.evicted.append(victim)
                reused = True
                self.stats.add("evictions")
            items.append(WriteItem(key, slot, memoryview(row), now))
            accepted.append(key)
        if out.rejected:
            self.stats.reject("threshold", sum(r == "threshold" for r in out.rejected.values()))
        if accepted:
            self.policy.insert_many(accepted)
            for key in accepted:  # the policy's mirror of the WRITING slots' pins
                self.policy.pin(key)
        if items or drop:
            self._submit(Job(writes=items, drop_keys=drop, reused_slots=reused))
        if drop and self._removed_listener is not None:
            self._removed_listener(drop)
        return out

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")

    def _submit(self, job: Job) -> None:
        job.records, job.stats = self.pending.take()
        self.committer.jobs.put(job)

    # -- reads (owner thread) -------------------------------------------------------------------
    def get(self, items: Sequence[tuple[bytes, memoryview, Any]]) -> list[bool]:
        """Start reading ready keys into their buffers; one bool per item (False = miss, counted
        as a failed promotion: the key went since the caller's lookup).

        Each started key is pinned until ``poll`` reports its ``read`` completion (carrying the
        item's token). Reads of consecutive slots are merged into vectored calls.
        """
        for _key, out, _token in items:  # all checked before anything changes
            if len(out) != self.row_bytes:
                raise ValueError(f"get: buffer for key {_key.hex()} has {len(out)} bytes, "
                                 f"expected row_bytes={self.row_bytes}")
        started: list[ReadItem] = []
        answers = []
        table = self.slots
        for key, out, token in items:
            slot = table.start_read(key)
            if slot is None:
                self.stats.add("promotion_failures")
                answers.append(False)
                continue
            self.policy.pin(key)  # the mirror of the READING slot's pin
            started.append(ReadItem(key, slot, table.length[slot], table.codec[slot],
                                    table.checksum[slot], out, token))
            answers.append(True)
        if not started:
            return answers
        start_reads(self.io, self.slabs, self.codec, started, self.cfg.verify, self._results)
        return answers

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a hit on ready keys (prefix order): policy recency and persisted hit counts."""
        now = time.time()
        table = self.slots
        for key in keys:
            if table.hit(key, now):
                self.pending.record(key, table.record(key))
        self.policy.access_many([k for k in keys if k in table])

    # -- completions (owner thread) -------------------------------------------------------------
    def poll(self, wait: float = 0.0) -> list[Completion]:
        """Apply finished I/O to the in-memory state; returns what finished.

        ``wait`` > 0 blocks up to that many seconds for the first completion (benchmarks and
        tools; vLLM's scheduler always polls with 0).
        """
        done: list[Completion] = []
        block = wait > 0 and self.has_pending_work()
        if not block and self._results.empty():  # the scheduler's usual case: no exception
            return done
        while True:
            try:
                r = self._results.get(timeout=wait) if block else self._results.get_nowait()
            except queue.Empty:
                break
            block = False
            if isinstance(r, WritesDone):
                done.extend(self._finish_writes(r))
            elif isinstance(r, ReadsDone):
                done.extend(self._finish_reads(r))
            elif isinstance(r, SlotsFreed):
                self.slots.freed(r.slots)
            elif isinstance(r, AdminRequest):
                self._admin(r)
        return done

    def _finish_writes(self, batch: WritesDone) -> list[Completion]:
        """A group commit's rows, stores counted once per commit (two locked counter updates
        per row took the scheduler thread 1.3 us a row here, now 0.45 us in all)."""
        out, n_ok, ok_bytes = [], 0, 0
        table, unpin, published = self.slots, self.policy.unpin, self.slots.published
        slot_of, state = self._slot_of, self._state
        redrop: list[bytes] = []  # old keys of reused slots whose delete may have failed too
        redrop_slots: list[int] = []
        for r in batch.results:
            # (always true: a WRITING key is never dropped; inline, it is the hot loop)
            if slot_of.get(r.key) == r.slot and state[r.slot] == WRITING:
                unpin(r.key)
                if r.ok:
                    published(r.slot, r.length, r.codec, r.checksum)
                    n_ok += 1
                    ok_bytes += r.length
                else:
                    victim = table.write_failed(r.key, r.slot)
                    if victim is not None:
                        redrop.append(victim)
                        redrop_slots.append(r.slot)
                    self.policy.remove(r.key)
                    self.stats.reject("full" if r.reason == "full" else "error")
                    self.stats.add("io_errors")
            else:
                log.error("file tier %s: a write result for key %s slot %d that no slot "
                          "waits for; ignored", self.folder, r.key.hex(), r.slot)
            out.append(Completion("store", r.key, r.ok, r.reason, r.length, r.seconds))
        self.stats.add("stores", n_ok)
        self.stats.add("store_bytes", ok_bytes)
        if redrop:  # the slots come back (SlotsFreed) once these deletes are committed
            self._submit(Job(drop_keys=redrop, freed_slots=redrop_slots))
        return out

    def _finish_reads(self, batch: ReadsDone) -> list[Completion]:
        """A run of reads: counted once; a failed row takes ``_finish_read``'s miss path."""
        out, n_ok, ok_bytes, unpin, secs = [], 0, 0, self.policy.unpin, batch.seconds
        # a key being read is never dropped: each is still its slot's
        self.slots.end_reads([it.slot for it, _ in batch.outcomes])
        for it, reason in batch.outcomes:
            r = Completion("read", it.key, not reason, reason, it.length, secs, it.token)
            unpin(it.key)
            if reason:
                out.append(self._finish_read(r))
                continue
            n_ok += 1
            ok_bytes += it.length
            out.append(r)
        self.stats.add("promotions", n_ok)
        self.stats.add("promotion_bytes", ok_bytes)
        return out

    def _finish_read(self, r: Completion) -> Completion:
        """A failed read (its slot's read already ended): counted, and the key dropped
        unless another read of it is still in flight (that one's outcome decides then)."""
        self.stats.add("promotion_failures")
        self.stats.add("checksum_failures" if r.reason == "checksum" else "io_errors")
        log.warning("file tier: key %s is a miss (%s); dropping it", r.key.hex(), r.reason)
        self.drop([r.key])
        return r

    def _admin(self, r: AdminRequest) -> None:
        reply = apply_request(self, r.op)
        self._submit(Job(reply=(r.reply_path, reply)))  # replied once the deletions commit

    def drop(self, keys: Sequence[bytes]) -> int:
        """Remove ready keys; their slots return to the free list once the index forgets them."""
        gone, slots = [], []
        release = self.slots.release
        for key in keys:
            slot = release(key)  # None: absent, being written or being read
            if slot is None:
                continue
            self.policy.remove(key)
            self.pending.discard(key)
            gone.append(key)
            slots.append(slot)
        if gone:
            self._submit(Job(drop_keys=gone, freed_slots=slots))
            if self._removed_listener is not None:
                self._removed_listener(gone)
        return len(gone)

    def evict(self, n: int) -> list[bytes]:
        """Evict up to ``n`` keys by policy (e.g. to make room on request)."""
        victims = evict_or_none(self.policy, min(n, self.policy.evictable_count())) or []
        self.drop(victims)  # already out of the policy: drop() forgets entries and slots
        self.stats.add("evictions", len(victims))
        return victims

    def clear(self, last_access_before: float | None = None) -> int:
        """Drop every ready key (or those last used before a time); returns how many. In-flight
        ones finish, then can be dropped later."""
        return self.drop(self.slots.ready_keys(last_access_before))

    def check(self, index: bool = False) -> None:
        """Assert that the tier's books agree (tests and the fault suite call it after each
        scenario; O(slots), never on the scheduler's path):

        * the slot table agrees with itself (``SlotTable.check``: free list = FREE slots,
          disjoint from the keys' slots, in-flight counts = WRITING slots and reads);
        * every readable slot has a valid record (length within the slot; a raw row is
          ``row_bytes`` long; a known codec);
        * the policy holds exactly the table's keys, and its pins mirror the table's;
        * with ``index=True`` (call it idle, after ``wait_idle``), LMDB agrees: every readable
          key's record names its slot, length, codec and checksum, and every other record is
          one whose delete is still in flight (its slot DROPPING or being rewritten).
        """
        table = self.slots
        table.check()
        assert table.n_slots == self.n_slots, (table.n_slots, self.n_slots)
        policy = self.policy
        assert len(policy) == len(table), ("policy", len(policy), "table", len(table))
        slot_bytes = self.slabs.slot_bytes
        for key, slot in table.slot_of.items():
            assert key in policy, (key.hex(), "held but not in the policy")
            if table.state[slot] >= READABLE:
                length, codec = table.length[slot], table.codec[slot]
                assert 0 < length <= slot_bytes and codec in (0, 1), (key.hex(), slot, length,
                                                                      codec)
                assert codec or length == self.row_bytes, (key.hex(), slot, length)
        pins = {k: n for k in table.slot_of if (n := table.pins(k))}
        mirror = policy.pin_counts()
        assert mirror == pins, ("policy pins disagree with the slot table's",
                                {k.hex(): (mirror.get(k, 0), pins.get(k, 0))
                                 for k in mirror.keys() | pins.keys()
                                 if mirror.get(k, 0) != pins.get(k, 0)})
        if index:
            self._check_index()

    def _check_index(self) -> None:
        table = self.slots
        seen = set()
        for key, (slot, length, codec, _flags, checksum, *_rest) in self.index.iter_records():
            state = table.state_of(key)
            if state is not None and state >= SlotState.READY:
                ts = table.slot_of[key]
                mine = (ts, table.length[ts], table.codec[ts], table.checksum[ts])
                assert (slot, length, codec, checksum) == mine, (key.hex(), "index", slot,
                                                                 length, codec, "table", mine)
                seen.add(key)
            else:  # dropped or evicted, its delete not committed yet
                assert slot < self.n_slots and SlotState(table.state[slot]) in (
                    SlotState.DROPPING, SlotState.WRITING), (key.hex(), slot, state,
                                                             "an index record of no key")
        readable = {k for k in table.slot_of if table.readable(k)}
        assert readable == seen, ("readable keys missing from the index",
                                  [k.hex() for k in readable - seen][:5])

    def describe(self) -> dict[str, Any]:
        """This process's counters and the tier's size, in one dict (tools, logs)."""
        used, cap, entries = self.usage()
        return {**self.stats.snapshot(), "entries": entries, "capacity_bytes": cap,
                "usage_bytes": used, "slots": self.n_slots, "free_slots": self.slots.free_count(),
                "io": self.io.describe()}

    # -- blocking helpers -------------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> None:
        """Persist counters and access stats now (blocks until the committer has them)."""
        done = threading.Event()
        self._submit(Job(done=done))
        done.wait(timeout)
        self.poll()

    def load_advisor_state(self) -> dict[str, Any] | None:
        return load_advisor_state(self.folder)

    def offer_advisor_state(self, state: dict[str, Any]) -> None:
        self._advisor_state.offer(state)

    def save_advisor_state(self, state: dict[str, Any]) -> None:
        self._advisor_state.save(state)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.wait_idle()
            self.flush()
        finally:
            self.committer.jobs.put(None)
            self.committer.join(timeout=30)
            self.io.shutdown()
            self.slabs.close(self.io)
            self.index.close()
            os.close(self._lock_fd)

    def __enter__(self) -> FileTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
