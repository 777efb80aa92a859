"""The file tier's slot table: which key holds each disk slot, in which state, with what record.

A slot's life (``SlotTable`` asserts each move; anything else is a bug and raises
``IllegalTransition``)::

    FREE ─reserve─▶ WRITING ─published─▶ READY ─start_read─▶ READING ─end_read (last)─▶ READY
    WRITING ─write_failed─▶ FREE                       (never published: free at once)
    READY ─release─▶ DROPPING ─freed─▶ FREE            (dropped, evicted, a bad read)
    READY ─reuse─▶ WRITING                             (evicted by ``put`` for another key)
    WRITING ─write_failed (reused slot)─▶ DROPPING     (the old key's record may remain)
    UNUSABLE                                           (in a damaged slab file: no moves)

* WRITING: ``put`` gave the slot to a key; the committer writes and publishes it. Pinned.
* READY: published in the index; readable.
* READING: READY with reads in flight (``readers``); readable, pinned: never dropped or reused.
* DROPPING: its key is gone from memory; the slot is reusable only once the committer has
  deleted the key's record (``SlotsFreed``). A delete that fails keeps it here until the next
  open, rather than let two records claim one slot.
* UNUSABLE: the slot lies in a slab file that is damaged (not a regular file, say): its
  record was dropped at load (a miss) and the slot is never handed out while the tier is open.
* A reused slot needs no DROPPING: the committer deletes the old key's record in the same
  batch, durably, before it writes the new bytes. If that batch fails, the delete may not
  have happened either, so the slot goes to DROPPING and the old key is dropped again
  (``write_failed`` returns it): never two records on one slot.

Pins: the table is their one source for the file tier (a WRITING slot holds one, a READING
slot one per read). The tier's policy mirrors them so that ``evict`` steps over pinned keys;
``pins`` says what the mirror must hold and ``FileTier.check`` compares the two.

Layout: columns by slot (plain lists and a ``bytearray`` of states), not one object per slot:
a reopen of a million entries builds them from numpy arrays in a few calls
(``load``), and the scheduler's ``lookup`` reads one dict and one byte.
"""

from __future__ import annotations

import enum
import gc
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tiering.backends.index import Index, pack_record
from tiering.tier import IllegalTransition

log = logging.getLogger(__name__)


class SlotState(enum.IntEnum):
    # the order matters: held by a key from WRITING on, readable from READY on
    FREE = 0
    UNUSABLE = 1  # in a damaged slab file: never handed out
    DROPPING = 2  # key gone; its record's delete not yet committed
    WRITING = 3  # reserved for a key; being written and published
    READY = 4  # published, readable
    READING = 5  # readable, with reads in flight


# plain ints for the hot paths (comparing IntEnum members costs more than ints)
_FREE, _UNUSABLE, _DROPPING = int(SlotState.FREE), int(SlotState.UNUSABLE), int(SlotState.DROPPING)
_WRITING, _READY, _READING = int(SlotState.WRITING), int(SlotState.READY), int(SlotState.READING)

#: a slot is readable when its state code is at least this (READY, READING)
READABLE = _READY
#: the state code of a slot being written (for the owner's completion loop)
WRITING = _WRITING

_LEGAL: frozenset[tuple[int, int]] = frozenset({
    (_FREE, _WRITING), (_READY, _WRITING),
    (_WRITING, _READY), (_WRITING, _FREE), (_WRITING, _DROPPING),
    (_READY, _READING), (_READING, _READY),
    (_READY, _DROPPING), (_DROPPING, _FREE),
})


# the moves the batch methods make inline, without ``_move``
assert (_READING, _READY) in _LEGAL and (_WRITING, _READY) in _LEGAL


class Entry(NamedTuple):
    """A snapshot of one key's slot record (for tools and tests)."""

    slot: int
    length: int
    codec: int
    checksum: int
    created: float
    last_access: float
    hits: int
    ready: bool


class SlotTable:
    """Every slot of one file tier: state, key, record fields, free list, in-flight counts.

    Owned by the tier's owner thread (vLLM's scheduler); the committer and I/O threads never
    see it. Record fields (``length`` .. ``hits``) are valid while the slot holds a key.
    """

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.slot_of: dict[bytes, int] = {}  # keys WRITING, READY or READING
        self.state = bytearray(n_slots)  # SlotState per slot
        self.free: list[int] = list(range(n_slots - 1, -1, -1))  # pop() gives low slots first
        self.length = [0] * n_slots
        self.codec = [0] * n_slots
        self.checksum = [0] * n_slots
        self.created = [0.0] * n_slots
        self.last = [0.0] * n_slots
        self.hits = [0] * n_slots
        self.readers: dict[int, int] = {}  # READING slot -> reads in flight
        self.replaced: dict[int, bytes] = {}  # reused WRITING slot -> the key it held before
        self.writing = 0  # slots WRITING
        self.reads = 0  # reads in flight (sum of ``readers``)
        self.dropped_unusable = 0  # records dropped at load: in a damaged slab file

    # -- loading --------------------------------------------------------------------------
    @classmethod
    def load(cls, index: Index, n_slots: int, folder: Path, unusable: Sequence[range] = ()
             ) -> tuple[SlotTable, list[bytes], list[bool]]:
        """The whole index in one snapshot as a table of READY slots; also the keys oldest
        access first and, per key, whether it was hit (for the policy's ``bulk_load``).
        Records beyond a shrunk capacity, and slots claimed by two keys, are deleted from the
        index (never trusted). ``unusable``: the slots of damaged slab files; their records are
        deleted too (misses: ``dropped_unusable`` says how many) and the slots are UNUSABLE."""
        # Millions of new objects would trigger repeated full garbage collections for nothing
        # (none of them can be cyclic garbage yet): pause the collector while loading.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return cls._load(index, n_slots, folder, unusable)
        finally:
            if enabled:
                gc.enable()

    @classmethod
    def _load(cls, index: Index, n_slots: int, folder: Path, unusable: Sequence[range]
              ) -> tuple[SlotTable, list[bytes], list[bool]]:
        keys, recs = index.load_all()
        slots = recs["slot"] if len(recs) else np.empty(0, np.uint64)
        bad = slots >= n_slots  # capacity shrank
        uniq, counts = np.unique(slots, return_counts=True)
        dup = np.isin(slots, uniq[counts > 1])  # never trust a slot claimed twice
        lost = np.zeros(len(slots), dtype=bool)
        for rng in unusable:  # rows in a damaged slab file: misses
            lost |= (slots >= rng.start) & (slots < rng.stop)
        lost &= ~(bad | dup)
        drop = [keys[i] for i in np.nonzero(bad | dup | lost)[0]]
        if drop:
            log.warning("%s: dropping %d index entries (beyond capacity, sharing a slot, or in a "
                        "damaged slab file: %d)", folder, len(drop), int(lost.sum()))
            index.publish([], [], drop_keys=drop)
        bad |= lost
        keep = np.nonzero(~(bad | dup))[0]
        order = keep[np.argsort(recs["last_access"][keep], kind="stable")]
        r = recs[order]
        slot_list = r["slot"].astype(np.int64)
        table = cls.__new__(cls)
        table.n_slots = n_slots
        for name, col in (("length", "length"), ("codec", "codec"), ("checksum", "checksum"),
                          ("created", "created"), ("last", "last_access"), ("hits", "hits")):
            arr = np.zeros(n_slots, dtype=r[col].dtype)
            arr[slot_list] = r[col]
            setattr(table, name, arr.tolist())
        state = np.full(n_slots, _FREE, dtype=np.uint8)
        state[slot_list] = _READY
        for rng in unusable:
            state[rng.start:rng.stop] = _UNUSABLE
        table.dropped_unusable = int(lost.sum())
        table.state = bytearray(state.tobytes())
        table.free = np.nonzero(state == _FREE)[0][::-1].tolist()  # pop() gives low slots first
        ordered_keys = np.array(keys, dtype=object)[order].tolist() if len(keys) else []
        table.slot_of = dict(zip(ordered_keys, slot_list.tolist(), strict=True))
        table.readers, table.replaced, table.writing, table.reads = {}, {}, 0, 0
        return table, ordered_keys, (r["hits"] > 0).tolist()

    # -- queries --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self.slot_of

    def readable(self, key: bytes) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and self.state[slot] >= _READY

    def state_of(self, key: bytes) -> SlotState | None:
        slot = self.slot_of.get(key)
        return None if slot is None else SlotState(self.state[slot])

    def entry(self, key: bytes) -> Entry | None:
        s = self.slot_of.get(key)
        if s is None:
            return None
        return Entry(s, self.length[s], self.codec[s], self.checksum[s], self.created[s],
                     self.last[s], self.hits[s], self.state[s] >= _READY)

    def record(self, key: bytes) -> bytes:
        """The key's index record as it stands now (access stats included)."""
        s = self.slot_of[key]
        return pack_record(s, self.length[s], self.codec[s], self.checksum[s], self.created[s],
                           self.last[s], self.hits[s])

    def pins(self, key: bytes) -> int:
        """How many pins the key holds: 1 while WRITING, one per read while READING."""
        s = self.slot_of[key]
        st = self.state[s]
        return 1 if st == _WRITING else self.readers.get(s, 0)

    def free_count(self) -> int:
        return len(self.free)

    def ready_keys(self, last_used_before: float | None = None) -> list[bytes]:
        """Readable keys that no read uses (all, or those last used before a time)."""
        st, last = self.state, self.last
        return [k for k, s in self.slot_of.items() if st[s] == _READY and (
            last_used_before is None or last[s] < last_used_before)]

    # -- moves ----------------------------------------------------------------------------
    def _move(self, slot: int, new: int) -> None:
        old = self.state[slot]
        if (old, new) not in _LEGAL:
            raise IllegalTransition(f"slot {slot}: {SlotState(old).name} -> "
                                    f"{SlotState(new).name}")
        self.state[slot] = new

    def reserve(self, key: bytes, now: float) -> int:
        """FREE -> WRITING: a free slot for ``key`` (the caller checked ``free``)."""
        slot = self.free.pop()
        self._bind(key, slot, now)
        return slot

    def reuse(self, victim: bytes, key: bytes, now: float) -> int:
        """READY -> WRITING: the slot of ``victim`` (evicted) for ``key`` at once."""
        slot = self.slot_of.pop(victim)
        self._bind(key, slot, now)
        self.replaced[slot] = victim
        return slot

    def _bind(self, key: bytes, slot: int, now: float) -> None:
        self._move(slot, _WRITING)
        self.slot_of[key] = slot
        self.hits[slot] = 0
        self.created[slot] = self.last[slot] = now
        self.writing += 1

    def published(self, slot: int, length: int, codec: int, checksum: int) -> None:
        """WRITING -> READY: the committer published the slot's record."""
        st = self.state
        if st[slot] != _WRITING:  # (the one legal way to READY but from READING)
            raise IllegalTransition(f"slot {slot}: {SlotState(st[slot]).name} -> READY")
        st[slot] = _READY
        self.length[slot], self.codec[slot], self.checksum[slot] = length, codec, checksum
        self.writing -= 1
        if self.replaced:
            self.replaced.pop(slot, None)  # its batch deleted the old key's record first

    def write_failed(self, key: bytes, slot: int) -> bytes | None:
        """The write of ``key`` failed, so nothing in the index names it. WRITING -> FREE;
        for a reused slot WRITING -> DROPPING, returning the key it held before, whose
        record the failed batch may not have deleted: the caller drops it again."""
        del self.slot_of[key]
        self.writing -= 1
        victim = self.replaced.pop(slot, None)
        if victim is not None:
            self._move(slot, _DROPPING)
            return victim
        self._move(slot, _FREE)
        self.free.append(slot)
        return None

    def start_read(self, key: bytes) -> int | None:
        """READY/READING -> READING: one more read of ``key``; its slot, or None if the key
        is not readable."""
        slot = self.slot_of.get(key)
        if slot is None:
            return None
        st = self.state[slot]
        if st == _READY:
            self._move(slot, _READING)
        elif st != _READING:
            return None
        self.readers[slot] = self.readers.get(slot, 0) + 1
        self.reads += 1
        return slot

    def end_reads(self, slots: list[int]) -> None:
        """One read of each of ``slots`` ended; a slot's last one moves READING -> READY.
        (One call per batch: the owner applies a run of reads at a time.)"""
        readers, st = self.readers, self.state
        for slot in slots:
            n = readers.get(slot, 0)
            if n == 0 or st[slot] != _READING:
                raise IllegalTransition(f"slot {slot}: a read ended that never started "
                                        f"({SlotState(st[slot]).name})")
            if n == 1:
                del readers[slot]
                st[slot] = _READY  # READING -> READY (in _LEGAL)
            else:
                readers[slot] = n - 1
        self.reads -= len(slots)

    def hit(self, key: bytes, now: float) -> bool:
        """Record a use of a readable key (hit count, last access); False if not readable."""
        slot = self.slot_of.get(key)
        if slot is None or self.state[slot] < _READY:
            return False
        self.hits[slot] += 1
        self.last[slot] = now
        return True

    def release(self, key: bytes) -> int | None:
        """READY -> DROPPING: forget ``key``; its slot, or None if the key is absent, being
        written or being read (such keys are not dropped)."""
        slot = self.slot_of.get(key)
        if slot is None or self.state[slot] != _READY:
            return None
        self._move(slot, _DROPPING)
        del self.slot_of[key]
        return slot

    def freed(self, slots: list[int]) -> None:
        """DROPPING -> FREE: the committer deleted these slots' records."""
        for slot in slots:
            self._move(slot, _FREE)
            self.free.append(slot)

    # -- consistency ----------------------------------------------------------------------
    def check(self) -> None:
        """Assert the table agrees with itself (tests; O(slots))."""
        st = self.state
        assert len(st) == self.n_slots, (len(st), self.n_slots)
        free = set(self.free)
        assert len(free) == len(self.free), "a slot is free twice"
        held = set(self.slot_of.values())
        assert len(held) == len(self.slot_of), "two keys share a slot"
        counts = {s: 0 for s in SlotState}
        for slot in range(self.n_slots):
            s = SlotState(st[slot])
            counts[s] += 1
            assert (s is SlotState.FREE) == (slot in free), (slot, s.name, "free list")
            assert (s >= SlotState.WRITING) == (slot in held), (slot, s.name, "key")
            assert (s is SlotState.READING) == (slot in self.readers), (slot, s.name, "readers")
        for slot, key in ((s, k) for k, s in self.slot_of.items()):
            if st[slot] >= _READY:
                assert 0 < self.length[slot], (key.hex(), slot, "a readable slot's record")
        assert all(n > 0 for n in self.readers.values()), self.readers
        assert all(st[s] == _WRITING for s in self.replaced), ("replaced", self.replaced)
        assert self.writing == counts[SlotState.WRITING], (self.writing, counts)
        assert self.reads == sum(self.readers.values()), (self.reads, self.readers)
