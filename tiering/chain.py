"""TierChain: the scheduler-side brain over tier 0 (CPU staging rows) and file tiers.

vLLM-agnostic: keys are bytes, rows are integers, results are plain enums; ``tiering.vllm``
translates. Every method runs on the owner thread (vLLM's scheduler) and never blocks on I/O:
file-tier reads and writes run on their tiers' threads and are applied in ``poll``.

Row life cycle::

    free ─prepare_store─▶ WRITING ─complete_store─▶ READY ─evict/reset─▶ free
    free ─lookup (lower-tier hit)─▶ PROMOTING ─read ok─▶ READY      (read failed ─▶ free)

A row is pinned (never evicted, never reused) while it is being written by the GPU, read by a
load, written down to a file tier (demotion) or filled from one (promotion). A row whose key is
dropped while pinned (reset) is *detached*: it returns to the free list when its last pin goes.

Demotion (``on_admit``): when a row becomes READY it is offered to every file tier; each tier's
own ``store_threshold`` decides whether it writes it. Evicting a READY row then costs nothing if a
file tier holds the chunk. Promotion: a lookup that misses tier 0 and hits a file tier allocates
a row at once, answers PENDING, and reads are issued in one batch per tier at the step's end.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tiering.backends.file_tier import FileTier, ReadResult, WriteDone
from tiering.backends.staging import StagingRegion
from tiering.policies import StoreThreshold, create

log = logging.getLogger(__name__)


class Lookup(enum.Enum):
    MISS = 0
    HIT = 1
    PENDING = 2


class RowState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    PROMOTING = 3


@dataclass
class Event:
    keys: list[bytes]
    medium: str  # "cpu" or "disk"
    removed: bool


@dataclass
class TierCounters:
    """Monotonic counters per tier, read (and diffed) by the metrics layer."""

    lookups: int = 0
    hits: int = 0
    hit_bytes: int = 0
    stores: int = 0
    store_bytes: int = 0
    evictions: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: {"threshold": 0, "full": 0,
                                                               "error": 0})
    demotions: int = 0
    demotion_bytes: int = 0
    promotions: int = 0
    promotion_bytes: int = 0
    promotion_failures: int = 0
    latencies: list[tuple[str, float]] = field(default_factory=list)  # (kind, seconds)


class TierChain:
    def __init__(self, region: StagingRegion, policy: str = "lru", store_threshold: int = 0,
                 tracker_size: int = 64_000, file_tiers: Sequence[FileTier] = (),
                 events: bool = False) -> None:
        self.region = region
        self.num_rows, self.row_bytes = region.num_rows, region.row_bytes
        self.policy = create(policy, self.num_rows)
        self.admission = StoreThreshold(store_threshold, tracker_size)
        self.file_tiers = list(file_tiers)
        self.events_enabled = events
        self.key_row: dict[bytes, int] = {}
        self.row_key: list[bytes | None] = [None] * self.num_rows
        self.row_state = [RowState.FREE] * self.num_rows
        self.row_pins = [0] * self.num_rows  # every pin: vLLM's (store, load) and file I/O
        self.row_io = [0] * self.num_rows  # the file-I/O share of row_pins
        self.row_from_disk = [False] * self.num_rows
        # Promoted rows not yet looked up: their first HIT is the disk tier's hit, counted when
        # the promotion started, so it does not count again as a CPU hit.
        self.row_fresh = [False] * self.num_rows
        self.free_rows = list(range(self.num_rows - 1, -1, -1))
        self.detached: set[int] = set()
        self._promote: list[list[tuple[bytes, int]]] = [[] for _ in self.file_tiers]
        self._promote_started: dict[bytes, float] = {}
        self._demoting: dict[tuple[int, bytes], tuple[int, float]] = {}  # -> (row, started)
        self._events: list[Event] = []
        self.counters = [TierCounters() for _ in range(1 + len(self.file_tiers))]

    # -- pins ------------------------------------------------------------------------------------
    def _pin(self, row: int, io: bool = False) -> None:
        self.row_pins[row] += 1
        self.row_io[row] += io
        key = self.row_key[row]
        if key is not None and row not in self.detached:
            self.policy.pin(key)

    def _unpin(self, row: int, io: bool = False) -> None:
        self.row_pins[row] -= 1
        self.row_io[row] -= io
        key = self.row_key[row]
        if row in self.detached:
            if self.row_pins[row] == 0:
                self.detached.discard(row)
                self._release(row)
            return
        if key is not None:
            self.policy.unpin(key)

    def _release(self, row: int) -> None:
        self.row_key[row] = None
        self.row_state[row] = RowState.FREE
        self.row_from_disk[row] = False
        self.row_fresh[row] = False
        self.free_rows.append(row)

    def _drop_key(self, key: bytes, event: bool = True) -> None:
        """Forget a key's row (evicted or failed); the row frees now or when unpinned."""
        row = self.key_row.pop(key)
        self.policy.remove(key)
        if self.row_pins[row]:
            self.detached.add(row)
        else:
            self._release(row)
        if event and self.events_enabled:
            self._events.append(Event([key], "cpu", True))

    def _allocate(self, n: int, protected: Iterable[bytes]
                  ) -> tuple[list[int], list[bytes]] | None:
        """(n free rows, evicted keys), evicting READY unpinned rows by policy; None (and no
        change) if impossible."""
        need = n - len(self.free_rows)
        victims: list[bytes] = []
        if need > 0:
            victims = self.policy.evict(need, protected=set(protected))
            if victims is None:
                return None
            for v in victims:  # already out of the policy (ghost entries kept), rows freed here
                self._drop_key(v)
            self.counters[0].evictions += len(victims)
        return [self.free_rows.pop() for _ in range(n)], victims

    # -- lookups and loads -------------------------------------------------------------------------
    def lookup(self, key: bytes, count: bool = True) -> Lookup:
        """``count=False`` for a repeated lookup of the same chunk by the same request (vLLM
        asks again every step while any chunk is pending): hit ratios stay per chunk."""
        self.poll()
        c0 = self.counters[0]
        row = self.key_row.get(key)
        if row is not None:
            if self.row_state[row] != RowState.READY:
                return Lookup.PENDING  # asked again next step: counted when it resolves
            if self.row_fresh[row]:
                self.row_fresh[row] = False
            elif count:
                c0.lookups += 1
                c0.hits += 1
                c0.hit_bytes += self.row_bytes
            return Lookup.HIT
        c0.lookups += count
        self.policy.on_miss(key)
        for i, tier in enumerate(self.file_tiers):
            c = self.counters[i + 1]
            c.lookups += count
            if not tier.lookup(key):
                continue
            c.hits += 1
            c.hit_bytes += self.row_bytes
            tier.touch([key])  # a promotion is a use: recency and the persisted hit count
            got = self._allocate(1, ())
            if got is None:
                self.counters[0].rejected["full"] += 1
                return Lookup.MISS
            row = got[0][0]
            self.key_row[key] = row
            self.row_key[row] = key
            self.row_state[row] = RowState.PROMOTING
            self.row_from_disk[row] = True
            self.policy.insert(key)
            self._pin(row, io=True)
            self._promote[i].append((key, row))
            self._promote_started[key] = time.perf_counter()
            return Lookup.PENDING
        return Lookup.MISS

    def hit_source(self, key: bytes) -> str:
        row = self.key_row.get(key)
        return "disk" if row is not None and self.row_from_disk[row] else "cpu"

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        rows = [self.key_row[k] for k in keys]
        for r in rows:
            self._pin(r)
        return rows

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            row = self.key_row.get(k)
            if row is not None:
                self._unpin(row)

    def touch(self, keys: Sequence[bytes]) -> None:
        present = [k for k in keys if k in self.key_row]
        self.policy.access_many(present)
        for tier in self.file_tiers:
            tier.touch(keys)

    # -- stores ------------------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes]
                      ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """(keys to store, their rows, evicted keys), or None if no room can be made now."""
        wanted = []
        for k in dict.fromkeys(keys):
            if k in self.key_row:
                continue
            if not self.admission.offer(k):
                self.counters[0].rejected["threshold"] += 1
                continue
            wanted.append(k)
        if not wanted:
            return [], [], []
        got = self._allocate(len(wanted), keys)
        if got is None:
            self.counters[0].rejected["full"] += len(wanted)
            return None
        rows, evicted = got
        for k, r in zip(wanted, rows, strict=True):
            self.key_row[k] = r
            self.row_key[r] = k
            self.row_state[r] = RowState.WRITING
        self.policy.insert_many(wanted)
        for r in rows:
            self._pin(r)
        return wanted, rows, evicted

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        ready = []
        for k in keys:
            row = self.key_row.get(k)
            if row is None or self.row_state[row] != RowState.WRITING:
                continue
            self._unpin(row)
            if not success:
                self._drop_key(k, event=False)
                continue
            self.row_state[row] = RowState.READY
            ready.append(k)
        if not ready:
            return
        c0 = self.counters[0]
        c0.stores += len(ready)
        c0.store_bytes += len(ready) * self.row_bytes
        if self.events_enabled:
            self._events.append(Event(list(ready), "cpu", False))
        self._demote(ready)

    def _demote(self, keys: list[bytes]) -> None:
        for i, tier in enumerate(self.file_tiers):
            before = tier.counter("rejected_threshold")
            accepted = tier.put(keys, [self.region.row(self.key_row[k]) for k in keys])
            self.counters[i + 1].rejected["threshold"] += (tier.counter("rejected_threshold")
                                                           - before)
            now = time.perf_counter()
            for k in accepted:
                row = self.key_row[k]
                self._pin(row, io=True)
                self._demoting[(i, k)] = (row, now)

    # -- background completions ----------------------------------------------------------------------
    def on_schedule_end(self) -> None:
        for i, tier in enumerate(self.file_tiers):
            batch, self._promote[i] = self._promote[i], []
            if not batch:
                continue
            ok = tier.get_many([(k, self.region.row(r), (k, r)) for k, r in batch])
            for (k, r), started in zip(batch, ok, strict=True):
                if not started:  # gone from the tier since the lookup: a miss after all
                    self._fail_promotion(i, k, r)
        self.poll()

    def _fail_promotion(self, tier_idx: int, key: bytes, row: int) -> None:
        self.counters[tier_idx + 1].promotion_failures += 1
        self._promote_started.pop(key, None)
        if self.key_row.get(key) == row:
            self._unpin(row, io=True)
            self._drop_key(key, event=False)
        else:
            self._unpin(row, io=True)

    def poll(self, wait: float = 0.0) -> None:
        """Apply finished file-tier I/O (``wait`` > 0 blocks up to that long per busy tier)."""
        for i, tier in enumerate(self.file_tiers):
            # always drained (cheap when empty): admin requests of tools arrive here too
            c = self.counters[i + 1]
            for r in tier.poll(wait=wait if tier.has_pending_work() else 0.0):
                if isinstance(r, WriteDone):
                    row, started = self._demoting.pop((i, r.key), (None, None))
                    if r.ok:
                        c.demotions += 1
                        c.demotion_bytes += r.nbytes
                        c.stores += 1
                        c.store_bytes += r.nbytes
                        if started is not None:
                            c.latencies.append(("demotion", time.perf_counter() - started))
                        if self.events_enabled:
                            self._events.append(Event([r.key], "disk", False))
                    else:
                        c.rejected["error"] += 1
                    if row is not None:
                        self._unpin(row, io=True)
                elif isinstance(r, ReadResult):
                    self._finish_promotion(i, r)

    def _finish_promotion(self, tier_idx: int, r: ReadResult) -> None:
        key, row = r.token
        c = self.counters[tier_idx + 1]
        started = self._promote_started.pop(key, None)
        if not r.ok or self.key_row.get(key) != row:
            self._fail_promotion(tier_idx, key, row)
            return
        self.row_state[row] = RowState.READY
        self.row_fresh[row] = True
        self._unpin(row, io=True)
        c.promotions += 1
        c.promotion_bytes += r.nbytes
        if started is not None:
            c.latencies.append(("promotion", time.perf_counter() - started))
        if self.events_enabled:
            self._events.append(Event([key], "cpu", False))

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until all file-tier I/O has been applied (tests, tools, shutdown)."""
        deadline = time.monotonic() + timeout
        self.on_schedule_end()
        while self.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"tier chain: I/O still in flight after {timeout}s")
            self.poll(wait=0.01)

    def has_pending_work(self) -> bool:
        return any(self._promote) or any(t.has_pending_work() for t in self.file_tiers)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every tier-0 row; file tiers keep their data.

        vLLM discards its in-flight jobs on a reset (their completions never come), so its pins
        go too; rows still read or written by a file tier stay detached until that I/O ends.
        """
        for queued in self._promote:  # promotions not issued yet: nothing to wait for
            for key, row in queued:
                self._unpin(row, io=True)
                self._promote_started.pop(key, None)
        self._promote = [[] for _ in self.file_tiers]
        for key, row in list(self.key_row.items()):
            if self.row_pins[row] != self.row_io[row]:
                for _ in range(self.row_pins[row] - self.row_io[row]):
                    self.policy.unpin(key)
                self.row_pins[row] = self.row_io[row]
            self._drop_key(key)
        self.admission.clear()

    def usage(self) -> dict[str, int]:
        pinned = sum(1 for p in self.row_pins if p)
        return {"rows": self.num_rows, "used": self.num_rows - len(self.free_rows),
                "pinned": pinned, "entries": len(self.key_row)}

    def close(self) -> None:
        try:
            self.wait_idle()
        except Exception:  # never let a stuck tier stop the shutdown of the others
            log.exception("tier chain: waiting for in-flight I/O at shutdown failed")
        for tier in self.file_tiers:
            try:
                tier.close()
            except Exception:  # never let shutdown of one tier stop the others
                log.exception("closing file tier %s failed", tier.folder)
