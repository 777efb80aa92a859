"""CpuTier: tier 0, the rows of the shared-memory staging region.

The GPU workers fill and drain the rows (vLLM's store and load jobs); file tiers read rows when
they store a chunk (demotion) and write rows when they serve one (promotion). This module owns
every row's state; the chain and the vLLM adapter only call its methods.

A row's life (``Row.move`` asserts each transition; anything else is a bug and raises)::

    FREE ─reserve_store─▶ WRITING ─finish_store(ok)─▶ READY ─drop (unpinned)─▶ FREE
    FREE ─reserve_promotion─▶ PROMOTING ─finish_promotion(ok)─▶ READY
    WRITING / PROMOTING ─failed─▶ FREE
    WRITING / READY / PROMOTING ─drop while pinned─▶ DETACHED ─last unpin─▶ FREE

Pins: a row is pinned while a GPU job reads or writes it (vLLM's pins: ``pins``) and while a file
tier reads or writes it (``io_pins``). A pinned row is never evicted or reused. vLLM forgets its
in-flight jobs on a reset, so a reset removes vLLM's pins but keeps the I/O pins: such rows are
detached until their I/O ends.

One source of pins: ``Row.pins``. The policy keeps a mirror (``EvictionPolicy.pin``) only so
that ``evict`` steps over pinned keys; ``pin``/``unpin_row``/``reset`` are the one place both
change, and ``check`` asserts they agree. ``pinned`` counts the rows with a pin.

Rows kept for promotions: while the chain asks for it (``keep_for_promotions``, after a
promotion found every row pinned), a store takes a row only if at least ``promotion_reserve``
unpinned rows are left after it; the keys past that are rejected (``rejections{reason=
"reserved"}``). A store is a bet on a later hit; a promotion serves a request waiting now.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Iterable, Sequence
from operator import attrgetter

from tiering.backends.staging import StagingRegion
from tiering.policies import EvictionPolicy, StoreThreshold, create, evict_or_none
from tiering.stats import TierStats
from tiering.tier import IllegalTransition, Lookup, PutOutcome, RowTier

log = logging.getLogger(__name__)


class RowState(enum.IntEnum):
    FREE = 0
    WRITING = 1  # a GPU store job is filling it
    READY = 2  # readable
    PROMOTING = 3  # a file tier is filling it
    DETACHED = 4  # its key was dropped while pinned; freed by the last unpin


_LEGAL = {
    (RowState.FREE, RowState.WRITING), (RowState.FREE, RowState.PROMOTING),
    (RowState.WRITING, RowState.READY), (RowState.PROMOTING, RowState.READY),
    (RowState.WRITING, RowState.FREE), (RowState.PROMOTING, RowState.FREE),
    (RowState.READY, RowState.FREE),
    (RowState.WRITING, RowState.DETACHED), (RowState.READY, RowState.DETACHED),
    (RowState.PROMOTING, RowState.DETACHED), (RowState.DETACHED, RowState.FREE),
}


_READY = RowState.READY  # (a module constant: enum member lookups cost on the hot path)
_ROW_INDEX = attrgetter("index")


class Row:
    __slots__ = ("index", "state", "key", "pins", "io_pins", "source", "fresh")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = RowState.FREE
        self.key: bytes | None = None
        self.pins = 0  # every pin: vLLM's jobs and file-tier I/O
        self.io_pins = 0  # the file-tier I/O share of ``pins``
        self.source = "cpu"  # "cpu", or the label of the file tier it was promoted from
        self.fresh = False  # promoted and not looked up yet (that hit was the file tier's)

    def move(self, new: RowState) -> None:
        if (self.state, new) not in _LEGAL:
            raise IllegalTransition(f"row {self.index}: {self.state.name} -> {new.name}")
        self.state = new

    def __repr__(self) -> str:
        return f"Row({self.index}, {self.state.name}, pins={self.pins}/{self.io_pins})"


class CpuTier(RowTier):
    """The row tier over a staging region: one ``Row`` record per row, a free list, a policy
    over the resident keys and tier 0's ``store_threshold`` admission (the contract:
    ``tiering.tier.RowTier``)."""

    medium = "cpu"
    policy: EvictionPolicy[bytes]

    def __init__(self, region: StagingRegion, policy: str = "lru", store_threshold: int = 0,
                 tracker_size: int = 64_000) -> None:
        self.region = region
        self.num_rows, self.row_bytes = region.num_rows, region.row_bytes
        self.policy_spec = policy
        self.policy = create(policy, self.num_rows)
        self.admission = StoreThreshold(store_threshold, tracker_size)
        self.stats = TierStats()
        self.rows = [Row(i) for i in range(self.num_rows)]
        self.key_row: dict[bytes, Row] = {}
        self.free_rows = list(range(self.num_rows - 1, -1, -1))  # pop() hands out row 0 first
        self.pinned = 0  # rows with at least one pin: not free, not evictable
        self.promotion_reserve = 0  # unpinned rows a store must leave (keep_for_promotions)

    # -- queries -----------------------------------------------------------------------------
    def lookup(self, key: bytes, count: bool = True, per_request: bool = False) -> Lookup:
        """``per_request``: the caller counts once per request (the request that promoted a
        row counted its disk hit when it found it, and passes ``count=False`` after), so a
        promoted row's first hit is not the promoter's: it counts like any other."""
        row = self.key_row.get(key)
        if row is not None:
            if row.state is not _READY:
                return Lookup.PENDING  # asked again next step: counted when it resolves
            if row.fresh:
                row.fresh = False
                if not per_request:  # the promoting caller's own hit: the file tier's
                    return Lookup.HIT
            if count:  # count_lookup(key, True) without its call (once per block)
                self.stats.lookup(True, self.row_bytes)
            return Lookup.HIT
        if count:
            self.count_lookup(key, False)
        return Lookup.MISS

    def contains(self, key: bytes) -> bool:
        row = self.key_row.get(key)
        return row is not None and row.state is RowState.READY

    def row_of(self, key: bytes) -> int:
        return self.key_row[key].index

    def view(self, key: bytes) -> memoryview:
        return self.region.row(self.key_row[key].index)

    def source_of(self, key: bytes) -> str:
        row = self.key_row.get(key)
        return row.source if row is not None else "cpu"

    def usage(self) -> tuple[int, int, int]:
        n = len(self.key_row)
        return n * self.row_bytes, self.num_rows * self.row_bytes, n

    def pinned_rows(self) -> int:
        return self.pinned

    def __len__(self) -> int:
        return len(self.key_row)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, key: bytes, io: bool = False) -> None:
        row = self.key_row[key]
        self.pinned += row.pins == 0
        row.pins += 1
        row.io_pins += io
        self.policy.pin(key)

    def unpin_row(self, index: int, io: bool = False) -> None:
        """Release one pin of a row (by index: its key may have been dropped meanwhile)."""
        row = self.rows[index]
        assert row.pins > 0 and (not io or row.io_pins > 0), f"unbalanced unpin of {row!r}"
        row.pins -= 1
        row.io_pins -= io
        self.pinned -= row.pins == 0
        if row.state is RowState.DETACHED:
            if row.pins == 0:
                self._free(row)
            return
        if row.key is not None:
            self.policy.unpin(row.key)

    # -- row allocation --------------------------------------------------------------------
    def _free(self, row: Row) -> None:
        row.move(RowState.FREE)
        row.key, row.source, row.fresh = None, "cpu", False
        self.free_rows.append(row.index)

    def drop(self, key: bytes) -> None:
        """Forget a key's row (evicted or failed): free now, or detached until unpinned."""
        row = self.key_row.pop(key)
        self.policy.remove(key)
        if row.pins:
            row.move(RowState.DETACHED)
        else:
            self._free(row)

    def _allocate(self, n: int, protected: Collection[bytes]
                  ) -> tuple[list[Row], list[bytes]] | str:
        """(n free rows, keys evicted for them), or the rejection reason (nothing changed)."""
        need = n - len(self.free_rows)
        victims: list[bytes] = []
        if need > 0:
            got = evict_or_none(self.policy, need, protected)
            if got is None:
                return "pinned" if self.pinned else "full"
            victims = got
            for v in victims:  # already out of the policy (ghost entries kept)
                row = self.key_row.pop(v)
                self._free(row)
            self.stats.add("evictions", len(victims))
        rows = [self.rows[self.free_rows.pop()] for _ in range(n)]
        # highest first: the caller gives them to its chunks in order, and a store or load job's
        # pages join into one copy where its chunks' rows descend as its GPU blocks do (vLLM
        # hands out descending blocks, TieringScheduler sorts them so: backends/block_copy.py
        # CopyLayout, tiering/vllm/block_order.py)
        rows.sort(key=_ROW_INDEX, reverse=True)
        return rows, victims

    def _bind(self, key: bytes, row: Row, state: RowState, source: str = "cpu") -> None:
        row.move(state)
        row.key, row.source = key, source
        self.key_row[key] = row

    # -- stores: reserve_store (rows for a GPU job) then finish_store ----------------------
    def reserve_store(self, keys: Sequence[bytes]) -> PutOutcome:
        """Reserve rows for ``keys`` (the GPU writes them).

        Keys already here and keys under the admission threshold are skipped. All or none:
        if rows for every admitted key cannot be found, none is reserved and all are rejected.
        """
        out = PutOutcome()
        wanted = []
        for k in dict.fromkeys(keys):
            if k in self.key_row:
                continue
            if not self.admission.offer(k):
                out.rejected[k] = "threshold"  # counted once per call, below
                continue
            wanted.append(k)
        self.stats.reject("threshold", len(out.rejected))
        if self.promotion_reserve:
            wanted = self._leave_reserve(wanted, out)
        if not wanted:
            return out
        got = self._allocate(len(wanted), set(keys))
        if isinstance(got, str):
            for k in wanted:
                out.rejected[k] = got
                self.admission.not_stored(k)
            self.stats.reject(got, len(wanted))
            return out
        new_rows, out.evicted = got
        self.region.clear_store_failed(row.index for row in new_rows)
        for k, row in zip(wanted, new_rows, strict=True):
            self._bind(k, row, RowState.WRITING)
        self.policy.insert_many(wanted)
        for k in wanted:
            self.pin(k)
        out.admitted = wanted
        return out

    def _leave_reserve(self, wanted: list[bytes], out: PutOutcome) -> list[bytes]:
        """The keys of ``wanted`` (a prefix, in the caller's order) that leave at least
        ``promotion_reserve`` rows unpinned once their rows are taken; the rest are rejected."""
        room = max(0, self.num_rows - self.pinned - self.promotion_reserve)
        if room >= len(wanted):
            return wanted
        for k in wanted[room:]:
            out.rejected[k] = "reserved"
            self.admission.not_stored(k)  # its offers still count: refused for room, not reuse
        self.stats.reject("reserved", len(wanted) - room)
        return wanted[:room]

    def keep_for_promotions(self, rows: int) -> None:
        """From now on stores leave ``rows`` rows unpinned for promotions (0: no reserve).
        Set at each step's end by the chain's ``tiering.promotion_reserve.PromotionReserve``."""
        assert 0 <= rows < max(self.num_rows, 1), (rows, self.num_rows)
        self.promotion_reserve = rows

    def finish_store(self, keys: Iterable[bytes], ok: bool = True) -> list[bytes]:
        """The GPU job for these keys ended; returns the keys now READY. A row the worker
        marked failed in the region (its copy could not be enqueued) is dropped: a miss,
        counted as a rejection for ``error``, never KV that was not written."""
        ready = []
        failed = 0
        for k in keys:
            row = self.key_row.get(k)
            if row is None or row.state is not RowState.WRITING:
                continue  # dropped meanwhile (reset), or a duplicate completion
            self.unpin_row(row.index)
            if self.region.take_store_failed(row.index):
                failed += 1
                self.drop(k)
                continue
            if not ok:
                self.drop(k)
                continue
            row.move(RowState.READY)
            ready.append(k)
        if failed:
            self.stats.reject("error", failed)
            log.error("vllm-tiering: %d chunk(s) of a store job were not copied from the GPU; "
                      "dropped from the CPU tier (misses from now on)", failed)
        self.stats.add("stores", len(ready))
        self.stats.add("store_bytes", len(ready) * self.row_bytes)
        return ready

    # -- promotions: a file tier fills a row -----------------------------------------------
    def reserve_promotion(self, key: bytes, source: str, protected: Collection[bytes] = ()
                          ) -> tuple[int, list[bytes]] | None:
        """(a row for ``key`` that a file tier will fill, pinned for that I/O; the keys evicted
        for it, never one of ``protected``), or None."""
        got = self._allocate(1, protected)
        if isinstance(got, str):
            self.stats.reject(got)
            return None
        (row,), evicted = got
        self._bind(key, row, RowState.PROMOTING, source)
        self.policy.insert(key)
        self.pin(key, io=True)
        return row.index, evicted

    def next_victims(self, n: int) -> list[bytes]:
        """About the next ``n`` keys the policy would evict (pinned ones included)."""
        return self.policy.peek_victims(n)

    def free_count(self) -> int:
        return len(self.free_rows)

    def finish_promotion(self, key: bytes, index: int, ok: bool) -> bool:
        """The read into row ``index`` ended; True if ``key`` is now READY there."""
        row = self.rows[index]
        current = self.key_row.get(key)
        if ok and current is row and row.state is RowState.PROMOTING:
            row.move(RowState.READY)
            row.fresh = True
            self.unpin_row(index, io=True)
            return True
        if current is row:  # failed read: the key goes (a miss); the row frees on unpin
            self.unpin_row(index, io=True)
            self.drop(key)
        else:  # reset or evicted meanwhile: only the I/O pin remains
            self.unpin_row(index, io=True)
        return False

    # -- loads to the GPU ------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the rows of a load job's keys (each READY: vLLM saw them hit); their indices.
        One pass and one policy call per job, not per key (vLLM loads a request's hits in one
        job; this runs on the scheduler thread for every loaded block).

        A load is a use: the policy records it here, in the request's prefix order. vLLM's
        connector (0.32, 0.33) never calls ``touch``, so without this LRU would evict by store
        order and drop prompts served a moment ago (2-6% of the prefill sweep's hits)."""
        key_row = self.key_row
        rows = [key_row[k] for k in keys]
        self.policy.access_many(keys)
        self.policy.pin_many(keys)
        newly = 0
        for row in rows:
            newly += row.pins == 0
            row.pins += 1
        self.pinned += newly
        self.stats.add("loads", len(rows))
        self.stats.add("load_bytes", len(rows) * self.row_bytes)
        return [row.index for row in rows]

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """Release the pins of ``prepare_load`` (a key dropped since, by a reset, lost them
        with its row: skipped)."""
        key_row = self.key_row
        pinned = []
        for k in keys:
            row = key_row.get(k)
            if row is not None:  # bound to k, so not DETACHED
                assert row.pins > 0, f"unbalanced unpin of {row!r}"
                row.pins -= 1
                self.pinned -= row.pins == 0
                pinned.append(k)
        self.policy.unpin_many(pinned)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.policy.access_many([k for k in keys if k in self.key_row])

    def reset(self) -> list[bytes]:
        """Drop every key. vLLM's pins go (its jobs are forgotten); I/O pins stay, so rows
        still read or written by a file tier are detached until that I/O ends."""
        dropped = list(self.key_row)
        for key, row in list(self.key_row.items()):
            for _ in range(row.pins - row.io_pins):
                self.policy.unpin(key)
            self.pinned -= row.pins > 0 and row.io_pins == 0
            row.pins = row.io_pins
            self.drop(key)
        self.admission.clear()
        return dropped

    def check(self) -> None:
        """Consistency of the row table (tests call it after every step)."""
        free = set(self.free_rows)
        assert len(free) == len(self.free_rows), "a row is free twice"
        for row in self.rows:
            assert row.io_pins <= row.pins, row
            if row.state is RowState.FREE:
                assert row.index in free and row.key is None and row.pins == 0, row
            else:
                assert row.index not in free, row
            if row.state is RowState.DETACHED:
                assert row.key is not None and row.pins > 0, row
                assert self.key_row.get(row.key) is not row, row
            elif row.state is not RowState.FREE:
                assert row.key is not None and self.key_row.get(row.key) is row, row
        assert len(self.key_row) == len(self.policy), (len(self.key_row), len(self.policy))
        assert self.pinned == sum(1 for r in self.rows if r.pins), \
            ("pinned rows miscounted", self.pinned, sum(1 for r in self.rows if r.pins))
        # the policy's pins mirror the rows' (detached rows' keys are out of the policy)
        pins = {k: r.pins for k, r in self.key_row.items() if r.pins}
        mirror = self.policy.pin_counts()
        assert mirror == pins, ("policy pins disagree with the rows'",
                                {k.hex(): (mirror.get(k, 0), pins.get(k, 0))
                                 for k in mirror.keys() | pins.keys()
                                 if mirror.get(k, 0) != pins.get(k, 0)})

    def close(self) -> None:
        pass
