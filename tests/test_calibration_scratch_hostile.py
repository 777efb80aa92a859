"""Hostile tests of the calibration's resident scratch memory (ee60972): each file tier has one
region of ``_calibration_rows()`` rows (fewer if the tier holds fewer), reused by every
calibration of the tier, one at a time.
Real FileTiers in tmp_path; faults only at the I/O boundary (``PosixSlabIo.readv``) or on disk."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import random
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tierutil import facts, hit_prefix, key, row_for

import tiering.backends.staging as staging
from tiering.advisor import PromotionAdvisor, rate_min_rows
from tiering.backends.file_tier import FileTier
from tiering.backends.slab_io import ALIGN, PosixSlabIo, resident_buffer
from tiering.backends.staging import StagingRegion
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier

ROW = 8192
# seeds of the random interleavings: 6 in CI, more for a long run
SEEDS = int(os.environ.get("TIERING_CALIBRATION_SEEDS", "6"))


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


# -- helpers ---------------------------------------------------------------------------------
def addr(buf: memoryview) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data


def resident_fraction(start: int, nbytes: int) -> float | None:
    """Share of the pages of [start, start+nbytes) in memory; None if the range is unmapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    base = start - start % page
    pages = -(-(start + nbytes - base) // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(pages * page), vec) != 0:
        assert ctypes.get_errno() == errno.ENOMEM, ctypes.get_errno()
        return None
    return sum(v & 1 for v in vec) / pages


def disk(tmp_path: Path, name: str = "disk", rows: int = 64, row: int = ROW, **cfg) -> FileTier:
    return FileTier({"path": str(tmp_path / name), "capacity": rows * row, "io": "posix",
                     "policy": "lru", **cfg}, facts(row, model=name))


def chain(tmp_path: Path, tiers: list[FileTier], cpu_rows: int = 40, advisor: bool = True,
          name: str = "e", row: int = ROW) -> TierChain:
    adv = PromotionAdvisor(len(tiers), row, chunk_tokens=16) if advisor else None
    return TierChain(CpuTier(StagingRegion(name, cpu_rows, row), "lru"), tiers, advisor=adv)


def fill(c: TierChain, keys: list[bytes]) -> None:
    stored, rows, _ = c.prepare_store(keys)
    for k, r in zip(stored, rows, strict=True):
        np.frombuffer(c.region.row(r), np.uint8)[:] = np.frombuffer(row_for(k, c.row_bytes),
                                                                     np.uint8)
    c.complete_store(stored)


@contextlib.contextmanager
def filled(tmp_path: Path, n: int) -> Iterator[tuple[TierChain, list[bytes]]]:
    """A chain over one disk tier holding ``n`` keys written down, closed afterwards."""
    ks = [key(i) for i in range(n)]
    c = chain(tmp_path, [disk(tmp_path)])
    try:
        fill(c, ks)
        c.wait_idle()
        yield c, ks
    finally:
        c.close()


def settle_books(c: TierChain) -> None:
    """Wait until the chain is idle; then nothing of a calibration is left."""
    c.wait_idle()
    idle_books(c)


def idle_books(c: TierChain) -> None:
    """Nothing of a calibration is left (the chain is idle: waited for, or closed)."""
    c.check()
    assert c._reads_queued == [0] * len(c.file_tiers), c._reads_queued
    assert c._calibrating == {}, c._calibrating
    assert c._batches == {}, c._batches


class ReadFaults:
    """Fault injection at the I/O boundary: reads (``PosixSlabIo.readv``) into watched memory
    can be held until released, fail with EIO, or come back short."""

    def __init__(self, monkeypatch) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.release = threading.Event()
        self.release.set()
        self.fail = lambda a: False  # address of a watched buffer -> raise EIO
        self.short = lambda a: False  # -> one byte short
        self.seen: list[int] = []
        orig = PosixSlabIo.readv

        def readv(io, handle, bufs, offset):
            watched = [addr(b) for b in bufs if self.watched(b)]
            if not watched:
                return orig(io, handle, bufs, offset)
            self.seen.extend(watched)
            assert self.release.wait(30), "held read never released"
            if any(self.fail(a) for a in watched):
                raise OSError(errno.EIO, "injected EIO")
            n = orig(io, handle, bufs, offset)
            return n - 1 if any(self.short(a) for a in watched) else n

        monkeypatch.setattr(PosixSlabIo, "readv", readv)

    def watch(self, buf: memoryview) -> None:
        self.ranges.append((addr(buf), addr(buf) + len(buf)))

    def watched(self, b: memoryview) -> bool:
        a = addr(b)
        return any(lo <= a < hi for lo, hi in self.ranges)


def spy_gets(tier: FileTier) -> list[list[tuple[bytes, int]]]:
    """Record each ``get`` batch as (key, buffer address) and call through."""
    seen: list[list[tuple[bytes, int]]] = []
    real = tier.get

    def get(items):
        seen.append([(k, addr(b)) for k, b, _ in items])
        return real(items)

    tier.get = get
    return seen


# -- duplicate keys ---------------------------------------------------------------------------
def test_duplicate_keys_in_one_calibration_are_read_once(tmp_path):
    """``keys`` naming a chunk twice: one read per key, tracked and finished; the books idle."""
    with filled(tmp_path, 20) as (c, ks):
        pick = [ks[0], ks[0], *ks[1:16]]
        assert c.calibrate(1, pick)
        settle_books(c)
        assert c.calibrate(1, ks[:16])  # and the next calibration runs
        settle_books(c)


def test_a_key_written_twice_does_not_break_the_step_end_calibration(tmp_path):
    """Production path: a full disk tier evicts k0, the CPU tier stores k0 again after a reset
    and writes it down again, so the tier's recent writes name k0 twice; the scheduler step's
    end then calibrates the tier from those writes."""
    c = chain(tmp_path, [disk(tmp_path, rows=4)])
    try:
        first, later = [key(i) for i in range(4)], [key(i) for i in range(4, 8)]
        fill(c, first)
        c.wait_idle()
        fill(c, later)  # evicts first from the 4-row disk tier
        c.wait_idle()
        c.reset()
        fill(c, first[:1])  # k0 again: written down a second time
        c.wait_idle()
        assert list(c._written[0]).count(first[0]) == 2
        assert c.advisor is not None and c.advisor.needs_measuring(1)
        c.on_schedule_end()  # calibrates tier 1 from the rows last written
        settle_books(c)
        assert c.advisor.read_rate(1)
    finally:
        c.close()


# -- failing reads ----------------------------------------------------------------------------
def test_calibration_reads_that_all_fail_leave_nothing_behind(tmp_path, monkeypatch):
    faults = ReadFaults(monkeypatch)
    with filled(tmp_path, 40) as (c, ks):
        faults.watch(c._scratch(1))
        faults.fail = lambda a: True
        assert c.calibrate(1, ks[:16])
        settle_books(c)
        assert c.advisor is not None and c.advisor.read_rate(1) is None  # no rate from errors
        assert c.file_tiers[0].stats.snapshot().get("io_errors", 0) >= 16
        faults.fail = lambda a: False
        assert c.calibrate(1, ks[16:32])  # not stuck: the next one runs and measures
        settle_books(c)
        assert c.advisor.read_rate(1) and not c.advisor.rate_is_provisional(1)


def test_a_partly_failed_calibration_gives_only_a_provisional_rate(tmp_path, monkeypatch):
    faults = ReadFaults(monkeypatch)
    with filled(tmp_path, 40) as (c, ks):
        scratch = c._scratch(1)
        faults.watch(scratch)
        base = addr(scratch)
        faults.short = lambda a: (a - base) // ROW % 2 == 1  # every other row short
        assert c.calibrate(1, ks[:16])
        settle_books(c)
        adv = c.advisor
        assert adv is not None and adv.read_rate(1) and adv.rate_is_provisional(1)
        faults.short = lambda a: False
        assert c.calibrate(1, ks[16:32])
        settle_books(c)
        assert not adv.rate_is_provisional(1)


def test_corrupt_slots_fail_the_calibration_cleanly(tmp_path):
    ks = [key(i) for i in range(16)]
    d = disk(tmp_path)
    c = chain(tmp_path, [d])
    try:
        fill(c, ks)
        c.wait_idle()
        slabs = sorted((tmp_path / "disk").rglob("slab-*.dat"))
        assert slabs
        rng = np.random.default_rng(0)
        for p in slabs:
            p.write_bytes(rng.integers(0, 256, p.stat().st_size, dtype=np.uint8).tobytes())
        assert c.calibrate(1, ks)
        settle_books(c)
        assert d.stats.snapshot().get("checksum_failures", 0) == 16
        assert not any(d.contains(k) for k in ks)
        assert c.advisor is not None and c.advisor.read_rate(1) is None
        more = [key(i) for i in range(100, 116)]
        c.reset()
        fill(c, more)
        c.wait_idle()
        assert c.calibrate(1, more)
        settle_books(c)
        assert c.advisor.read_rate(1)
    finally:
        c.close()


# -- one at a time, reuse -----------------------------------------------------------------------
def test_one_calibration_per_tier_in_flight_then_the_same_rows_again(tmp_path, monkeypatch):
    faults = ReadFaults(monkeypatch)
    ks = [key(i) for i in range(40)]
    d = disk(tmp_path)
    c = chain(tmp_path, [d])
    try:
        fill(c, ks)
        c.wait_idle()
        scratch = c._scratch(1)
        faults.watch(scratch)
        gets = spy_gets(d)
        faults.release.clear()
        assert c.calibrate(1, ks[:16])
        assert not c.calibrate(1, ks[16:32])  # one at a time
        c.on_schedule_end()  # the step's end does not start another either
        assert len(gets) == 1
        # the keys being read cannot be dropped under the read
        assert d.drop(ks[:16]) == 0
        c.check()
        faults.release.set()
        settle_books(c)
        assert c.calibrate(1, ks[16:32])
        settle_books(c)
        lo, hi = addr(scratch), addr(scratch) + len(scratch)
        assert [a for _, a in gets[0]] == [a for _, a in gets[-1]]
        assert all(lo <= a and a + ROW <= hi for batch in gets for _, a in batch)
        assert len({a for _, a in gets[0]}) == 16
    finally:
        faults.release.set()
        c.close()


def test_two_file_tiers_have_their_own_scratch_and_calibrate_at_once(tmp_path, monkeypatch):
    faults = ReadFaults(monkeypatch)
    ks = [key(i) for i in range(20)]
    d1, d2 = disk(tmp_path, "d1"), disk(tmp_path, "d2")
    c = chain(tmp_path, [d1, d2])
    try:
        s1, s2 = c._scratch(1), c._scratch(2)
        assert addr(s1) + len(s1) <= addr(s2) or addr(s2) + len(s2) <= addr(s1)
        for s in (s1, s2):
            assert resident_fraction(addr(s), len(s)) == 1.0
            faults.watch(s)
        fill(c, ks)
        c.wait_idle()
        for k in ks[:16]:  # write-through put them on both
            assert d1.contains(k) and d2.contains(k)
        g1, g2 = spy_gets(d1), spy_gets(d2)
        faults.release.clear()
        assert c.calibrate(1, ks[:16]) and c.calibrate(2, ks[:16])
        assert set(c._calibrating) == {1, 2}
        assert c._reads_queued == [16, 16]
        faults.release.set()
        settle_books(c)
        assert all(addr(s1) <= a < addr(s1) + len(s1) for _, a in g1[0])
        assert all(addr(s2) <= a < addr(s2) + len(s2) for _, a in g2[0])
        adv = c.advisor
        assert adv is not None and adv.read_rate(1) and adv.read_rate(2)
    finally:
        faults.release.set()
        c.close()


def test_without_an_advisor_the_scratch_comes_with_the_first_calibration(tmp_path):
    ks = [key(i) for i in range(20)]
    d = disk(tmp_path)
    c = chain(tmp_path, [d], advisor=False)
    try:
        assert c._scratch_rows == {}
        fill(c, ks)
        c.wait_idle()
        gets = spy_gets(d)
        assert c.calibrate(1, ks[:3])  # too few: the 20 rows last written instead
        settle_books(c)
        s = c._scratch_rows[1]
        assert resident_fraction(addr(s), len(s)) == 1.0
        assert c.calibrate(1, ks[3:19])
        settle_books(c)
        assert [len(g) for g in gets] == [20, 16]
        assert [a for _, a in gets[1]] == [a for _, a in gets[0]][:16]
        assert c._scratch_rows[1] is s
    finally:
        c.close()


def test_a_tiny_tier_is_measured_with_what_it_holds(tmp_path):
    ks = [key(i) for i in range(4)]
    c = chain(tmp_path, [disk(tmp_path, rows=4)])
    try:
        assert rate_min_rows(ROW) > 4
        fill(c, ks)
        c.wait_idle()
        assert c.calibrate(1, ks)
        settle_books(c)
        assert c.advisor is not None and c.advisor.read_rate(1)
        assert not c.advisor.rate_is_provisional(1)  # all a 4-row tier can read
    finally:
        c.close()


def test_the_scratch_of_a_tiny_tier_is_no_larger_than_it_can_read(tmp_path):
    """A 2-row tier of 8 KiB rows can never read more than 2 rows in a calibration; it gets
    64 rows of resident memory for as long as the engine runs."""
    c = chain(tmp_path, [disk(tmp_path, rows=2)])
    try:
        capacity = c.file_tiers[0].usage()[1]
        assert len(c._scratch(1)) <= max(ALIGN, capacity), (len(c._scratch(1)), capacity)
    finally:
        c.close()


def test_large_rows_are_calibrated_in_their_own_slices(tmp_path):
    """4 MiB rows: a calibration of 16 rows reads into 16 disjoint 4 MiB slices of a resident
    64 MiB region and measures a full rate."""
    big = 4 << 20
    ks = [key(f"big{i}") for i in range(16)]
    d = disk(tmp_path, rows=16, row=big)
    c = chain(tmp_path, [d], cpu_rows=16, row=big)
    try:
        s = c._scratch(1)
        assert len(s) == c._calibration_rows() * big == 16 * big
        fill(c, ks)
        c.wait_idle()
        gets = spy_gets(d)
        assert c.calibrate(1, ks)
        settle_books(c)
        starts = sorted(a for _, a in gets[0])
        assert starts == [addr(s) + n * big for n in range(16)]
        assert c.advisor is not None and not c.advisor.rate_is_provisional(1)
    finally:
        c.close()


# -- close, memory ------------------------------------------------------------------------------
def test_close_while_a_calibration_is_in_flight(tmp_path, monkeypatch):
    faults = ReadFaults(monkeypatch)
    ks = [key(i) for i in range(16)]
    d = disk(tmp_path)
    c = chain(tmp_path, [d])
    fill(c, ks)
    c.wait_idle()
    faults.watch(c._scratch(1))
    faults.release.clear()
    assert c.calibrate(1, ks)
    threading.Timer(0.2, faults.release.set).start()
    c.close()  # waits for the reads
    assert d.closed
    idle_books(c)
    assert c.advisor is not None and c.advisor.read_rate(1)
    # a closed chain cannot start a calibration that never ends
    try:
        started = c.calibrate(1, ks)
    except RuntimeError:
        started = False
    assert not started and 1 not in c._calibrating


def test_the_scratch_is_unmapped_once_the_chain_is_closed_and_dropped(tmp_path):
    ks = [key(i) for i in range(16)]
    c = chain(tmp_path, [disk(tmp_path, "d1"), disk(tmp_path, "d2")])
    fill(c, ks)
    c.wait_idle()
    assert c.calibrate(1, ks) and c.calibrate(2, ks)
    c.wait_idle()
    where = [(addr(s), len(s)) for s in c._scratch_rows.values()]
    maps = [weakref.ref(s.obj) for s in c._scratch_rows.values()]
    assert all(resident_fraction(a, n) == 1.0 for a, n in where)
    c.close()
    del c
    gc.collect()
    assert all(m() is None for m in maps)
    assert all(resident_fraction(a, n) is None for a, n in where)


def test_a_calibration_never_writes_into_cpu_rows_or_a_promotion(tmp_path, monkeypatch):
    """Calibrations and promotions of the same keys at once: every CPU row holds its own bytes,
    and rows the calibration did not touch are unchanged to the byte."""
    faults = ReadFaults(monkeypatch)
    ks = [key(i) for i in range(32)]
    d = disk(tmp_path)
    c = chain(tmp_path, [d], cpu_rows=48, advisor=False)
    try:
        fill(c, ks)
        c.wait_idle()
        c.reset()  # all on disk only
        fill(c, ks[16:])  # and these on the CPU tier too
        c.wait_idle()
        before = c.region.rows.tobytes()
        faults.watch(c._scratch(1))
        faults.release.clear()
        assert c.calibrate(1, ks)
        for k in ks[:16]:
            assert c.lookup(k) is Lookup.PENDING
        c.on_schedule_end()  # promotions issued while the calibration is held
        faults.release.set()
        settle_books(c)
        for k in ks:
            assert c.cpu.contains(k)
            assert bytes(c.cpu.view(k)) == bytes(row_for(k)), k.hex()
        free = set(range(c.num_rows)) - {c.cpu.row_of(k) for k in ks}
        assert len(free) == 16
        now = c.region.rows.tobytes()
        for r in free:  # rows no promotion or store used: the bytes they had
            assert now[r * ROW:(r + 1) * ROW] == before[r * ROW:(r + 1) * ROW]
    finally:
        faults.release.set()
        c.close()


# -- resident_buffer ---------------------------------------------------------------------------
@pytest.mark.parametrize("populate", [True, False])
@pytest.mark.parametrize("nbytes", [0, 1, ALIGN - 1, ALIGN, 5 * ALIGN + 3, 3 << 20])
def test_resident_buffer_is_aligned_writable_and_resident(monkeypatch, populate, nbytes):
    if not populate:
        monkeypatch.delattr(mmap, "MAP_POPULATE", raising=False)
    b = resident_buffer(nbytes)
    assert len(b) == nbytes and not b.readonly
    assert addr(b) % ALIGN == 0
    if nbytes:
        assert resident_fraction(addr(b), nbytes) == 1.0
        assert not np.frombuffer(b, np.uint8).any()
        np.frombuffer(b, np.uint8)[:] = 7
        assert np.frombuffer(b, np.uint8).all()


# -- random interleavings -----------------------------------------------------------------------
@pytest.mark.parametrize("faulty", [False, True])
@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_interleavings_keep_books_and_bytes(tmp_path, monkeypatch, seed, faulty):
    """Stores, lookups, promotions, loads, calibrations (distinct keys), resets, drops, step
    ends and polls in random order; ``faulty``: reads are slowed at random and one in 15
    fails with EIO. The books hold after every step, every resident CPU row and every row
    the file tiers hold keeps its own bytes, and nothing is left in flight at the end."""
    rng = random.Random(seed)
    if faulty:
        io_rng, lock = random.Random(seed + 1000), threading.Lock()
        orig = PosixSlabIo.readv

        def readv(io, handle, bufs, offset):
            with lock:
                delay, fail = io_rng.random() * 0.003, io_rng.random() < 1 / 15
            time.sleep(delay)
            if fail:
                raise OSError(errno.EIO, "injected EIO")
            return orig(io, handle, bufs, offset)

        monkeypatch.setattr(PosixSlabIo, "readv", readv)
    tiers = [disk(tmp_path, f"d{i}", rows=rng.randint(4, 24), io_threads=rng.choice([1, 2, 4]),
                  demote=mode) for i, mode in enumerate(("on_store", "on_evict"))]
    c = chain(tmp_path, tiers, cpu_rows=rng.randint(4, 12), advisor=rng.random() < 0.7,
              name=f"r{seed}")
    universe = [key(f"{seed}-{i}") for i in range(30)]
    loading: list[list[bytes]] = []
    cal_starts = 0
    try:
        for _ in range(250):
            op = rng.random()
            if op < 0.25:  # lookups in prefix order, a load of what hit
                start = rng.randrange(len(universe) - 4)
                hits = hit_prefix(c, universe[start:start + rng.randint(1, 6)])
                if hits:
                    for k, r in zip(hits, c.prepare_load(hits), strict=True):
                        assert bytes(c.region.row(r)) == bytes(row_for(k)), k.hex()
                    loading.append(hits)
            elif op < 0.45:
                out = c.prepare_store(rng.sample(universe, rng.randint(1, 4)))
                if out is not None and out[0]:
                    for k, r in zip(out[0], out[1], strict=True):
                        np.frombuffer(c.region.row(r), np.uint8)[:] = np.frombuffer(
                            row_for(k), np.uint8)
                    c.complete_store(out[0])
            elif op < 0.55 and loading:
                c.complete_load(loading.pop(rng.randrange(len(loading))))
            elif op < 0.7:  # a calibration of distinct keys (maybe none held)
                i = rng.choice([1, 2])
                busy = i in c._calibrating
                ok = c.calibrate(i, rng.sample(universe, rng.randint(0, 20)))
                assert not (busy and ok), "two calibrations of one tier in flight"
                cal_starts += ok
            elif op < 0.75:
                c.reset()
                loading.clear()
            elif op < 0.8:
                t = rng.choice(tiers)
                t.drop(rng.sample(universe, 3))
            elif op < 0.93:
                c.on_schedule_end()
            else:
                c.poll(wait=0.01)
            c.check()
            for k, row in c.cpu.key_row.items():  # every resident row holds its own bytes
                if c.cpu.contains(k):
                    assert bytes(c.region.row(row.index)) == bytes(row_for(k)), k.hex()
        for job in loading:
            c.complete_load(job)
        settle_books(c)
        if faulty:
            monkeypatch.undo()
        for i, t in enumerate(tiers, start=1):
            for k in t.keys():
                if t.contains(k):
                    out = bytearray(ROW)
                    assert t.get([(k, memoryview(out), None)]) == [True]
                    (done,) = t.wait_idle()
                    assert done.ok and bytes(out) == bytes(row_for(k)), (i, k.hex())
        assert cal_starts == 0 or sum(t.stats.snapshot().get("calibration_reads", 0)
                                      for t in tiers) > 0
    finally:
        c.close()
