"""TierChain semantics over a real staging region and a real file tier (no vLLM needed)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from tierutil import facts, key

import tiering.backends.staging as staging
from tiering.backends.file_tier import FileTier
from tiering.backends.staging import StagingRegion, remove_stale
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier

ROW = 8192


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def make_chain(tmp_path, rows=4, disk_slots=16, cpu_threshold=0, disk_threshold=0,
               engine="e1", promotion_reserve: float | None = None) -> TierChain:
    region = StagingRegion(engine, rows, ROW)
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": disk_slots * ROW,
                     "io": "posix", "policy": "lru", "store_threshold": disk_threshold},
                    facts(ROW))
    share = {} if promotion_reserve is None else {"promotion_reserve": promotion_reserve}
    return TierChain(CpuTier(region, "lru", cpu_threshold), file_tiers=[tier], events=True,
                     **share)


def fill(chain: TierChain, keys, seed=0) -> dict[bytes, bytes]:
    """Store keys as the GPU would: prepare, write the rows, complete. Returns the contents."""
    out = chain.prepare_store(keys)
    assert out is not None
    stored, rows, _ = out
    data = {}
    rng = np.random.default_rng(seed)
    for k, r in zip(stored, rows, strict=True):
        chain.region.rows[r][:] = rng.integers(0, 256, ROW, dtype=np.uint8)
        data[k] = chain.region.rows[r].tobytes()
    chain.complete_store(stored)
    return data


def settle(chain: TierChain) -> None:
    chain.wait_idle()


def test_store_then_hit_from_cpu(tmp_path):
    c = make_chain(tmp_path)
    ks = [key(i) for i in range(2)]
    data = fill(c, ks)
    assert [c.lookup(k) for k in ks] == [Lookup.HIT, Lookup.HIT]
    rows = c.prepare_load(ks)
    assert c.region.rows[rows[0]].tobytes() == data[ks[0]]
    c.complete_load(ks)
    assert c.hit_source(ks[0]) == "cpu"
    # a copy to the GPU is a load, not a promotion (that word is a read from a tier below)
    assert (c.cpu.stats["loads"], c.cpu.stats["load_bytes"]) == (2, 2 * ROW)
    assert c.cpu.stats["promotions"] == 0
    c.close()


def test_a_store_the_worker_marked_failed_is_a_miss_not_its_bytes(tmp_path):
    """A worker whose copy into a row failed marks it in the staging region (its own mapping of
    the same file, as a worker process has); when vLLM completes the store, the chain drops that
    chunk: a miss in every tier, a rejection for ``error``; the job's other chunks are hits,
    and the row's next store is not taken for failed (the mark is cleared)."""
    c = make_chain(tmp_path, rows=4)
    ks = [key(i) for i in range(3)]
    stored, rows, _ = c.prepare_store(ks)
    worker_view = StagingRegion("e1", 4, ROW)  # the worker process's mapping
    worker_view.mark_store_failed([rows[1]])
    c.complete_store(stored)
    settle(c)
    assert [c.lookup(k) for k in ks] == [Lookup.HIT, Lookup.MISS, Lookup.HIT]
    assert c.cpu.stats["rejections:error"] == 1 and c.cpu.stats["stores"] == 2
    again, rows2, _ = c.prepare_store([ks[1]])
    assert again == [ks[1]]
    c.complete_store(again)
    assert c.lookup(ks[1]) == Lookup.HIT and c.cpu.stats["rejections:error"] == 1
    worker_view.mark_store_failed([rows2[0]])  # a mark left over (a worker that died)...
    c.cpu.drop(ks[1])
    out = c.prepare_store([ks[1]])  # ...is cleared when the row is reserved again
    c.complete_store(out[0])
    assert c.lookup(ks[1]) == Lookup.HIT
    worker_view.close()
    c.close()


def test_store_pending_until_complete(tmp_path):
    c = make_chain(tmp_path)
    out = c.prepare_store([key(1)])
    assert c.lookup(key(1)) == Lookup.PENDING
    c.complete_store(out[0])
    assert c.lookup(key(1)) == Lookup.HIT
    c.close()


def test_evicted_chunk_is_promoted_from_disk_byte_exact(tmp_path):
    c = make_chain(tmp_path, rows=2)
    a = [key("a0"), key("a1")]
    data = fill(c, a)
    settle(c)  # demoted to disk
    fill(c, [key("b0"), key("b1")], seed=1)  # pushes a out of the CPU rows
    settle(c)
    assert all(k not in c.cpu.key_row for k in a)
    assert c.lookup(a[0]) == Lookup.PENDING  # promotion started
    c.on_schedule_end()  # reads issued in one batch
    settle(c)
    assert c.lookup(a[0]) == Lookup.HIT
    assert c.hit_source(a[0]) == "disk"
    (row,) = c.prepare_load([a[0]])
    assert c.region.rows[row].tobytes() == data[a[0]]
    assert c.tiers[1].stats["promotions"] == 1 and c.tiers[1].stats["hits"] == 1
    assert c.tiers[0].stats["hits"] == 0  # the promoted chunk's first hit is the disk's, not the CPU's
    c.close()


def test_promotion_of_corrupt_slot_is_a_miss(tmp_path):
    c = make_chain(tmp_path, rows=1)
    fill(c, [key("x")])
    settle(c)
    disk = c.file_tiers[0]
    slot = disk.entry(key("x")).slot
    with open(disk.folder / "slab-0000.dat", "r+b") as fh:
        fh.seek(slot * ROW + 100)
        fh.write(b"\xff\x00\xff")
    fill(c, [key("y")], seed=3)  # evicts x from the single CPU row
    assert c.lookup(key("x")) == Lookup.MISS  # y's row is pinned while it is written down
    settle(c)
    assert c.lookup(key("x")) == Lookup.PENDING
    c.on_schedule_end()
    settle(c)
    assert c.lookup(key("x")) == Lookup.MISS  # checksum failed: dropped everywhere
    assert c.tiers[1].stats["promotion_failures"] == 1
    assert disk.stats["checksum_failures"] == 1
    c.close()


def test_pinned_rows_are_not_evicted_and_store_returns_none(tmp_path):
    c = make_chain(tmp_path, rows=2)
    ks = [key(0), key(1)]
    fill(c, ks)
    settle(c)  # demotions done: only the load pins remain
    c.prepare_load(ks)  # both pinned by a load
    assert c.prepare_store([key(2)]) is None
    c.complete_load(ks)
    out = c.prepare_store([key(2)])
    assert out is not None and out[0] == [key(2)] and len(out[2]) == 1
    c.close()


def test_store_threshold_on_each_tier(tmp_path):
    c = make_chain(tmp_path, rows=4, cpu_threshold=2, disk_threshold=2)
    k = key("t")
    assert c.prepare_store([k]) == ([], [], [])  # first offer to the CPU tier: counted only
    assert c.tiers[0].stats["rejections:threshold"] == 1
    fill(c, [k])  # second offer: admitted to CPU
    settle(c)
    disk = c.file_tiers[0]
    assert not disk.contains(k)  # first offer to disk: counted only
    assert c.tiers[1].stats["rejections:threshold"] == 1
    c.complete_store([k])  # not writing any more: ignored
    c.reset()
    fill(c, [key("u")])
    c.prepare_store([k])  # offer 1 after reset (tracker cleared)
    fill(c, [k])
    settle(c)
    assert disk.contains(k)  # second offer to disk: written
    c.close()


def test_reset_drops_cpu_rows_keeps_disk(tmp_path):
    c = make_chain(tmp_path, rows=4)
    ks = [key(i) for i in range(3)]
    fill(c, ks)
    pending = c.prepare_store([key(9)])  # an in-flight GPU store, discarded by vLLM on reset
    assert pending
    c.reset()
    assert not c.cpu.key_row
    settle(c)
    assert c.usage()["used"] == 0  # every row free again once demotions finished
    assert c.lookup(ks[0]) == Lookup.PENDING  # from disk
    c.close()


def test_events_report_cpu_and_disk(tmp_path):
    c = make_chain(tmp_path, rows=1)
    fill(c, [key(0)])
    settle(c)
    fill(c, [key(1)], seed=2)
    settle(c)
    ev = [(e.medium, e.removed, e.keys) for e in c.take_events()]
    assert ("cpu", False, [key(0)]) in ev
    assert ("file", False, [key(0)]) in ev
    assert ("cpu", True, [key(0)]) in ev  # evicted from the CPU row by key(1)
    c.close()


def test_stale_region_of_dead_engine_is_removed(tmp_path):
    r = StagingRegion("dead-engine", 1, ROW)
    path = r.path
    r.close()  # nobody maps it any more: as after a crash
    live = StagingRegion("live-engine", 1, ROW)
    assert remove_stale(keep=live.path) == [path]
    assert not path.exists() and live.path.exists()
    live.close(unlink=True)


def mapped_kib(path) -> int:
    """Resident KiB of this process's mapping of ``path`` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"{path} is not mapped")


def test_populated_region_maps_every_page_at_open():
    """The scheduler's rows are mapped at open: a file tier's O_DIRECT reads into a fresh
    engine's rows then fault nothing in, page by page, on the I/O threads."""
    lazy = StagingRegion("lazy", 16, ROW)
    eager = StagingRegion("eager", 16, ROW, populate=True)
    assert mapped_kib(lazy.path) == 0
    # the rows, and the page of per-row store marks after them
    assert mapped_kib(eager.path) == (16 * ROW + mmap.PAGESIZE) // 1024
    lazy.close(unlink=True)
    eager.close(unlink=True)


def test_region_smaller_than_a_row_is_a_clear_error():
    with pytest.raises(ValueError, match="holds no row"):
        StagingRegion("e", 0, ROW)


def test_cpu_evictions_leave_arc_ghosts(tmp_path):
    region = StagingRegion("arc-ghosts", 4, ROW)
    c = TierChain(CpuTier(region, "arc", 0))
    fill(c, [key(i) for i in range(4)])
    c.touch([key(0), key(1)])  # reused: ARC's frequent list T2
    fill(c, [key(4)], seed=1)  # evicts one of the once-seen keys 2, 3 from T1
    (victim,) = [k for k in (key(2), key(3)) if k not in c.cpu.key_row]
    assert victim in c.cpu.policy.b1  # ARC remembers it: a return adapts p and goes to T2
    assert c.cpu.key_row.keys() >= {key(0), key(1), key(4)}
    c.close()
    region.close(unlink=True)


def _store_step(c: TierChain, keys: list[bytes], previous: list[bytes]) -> list[bytes]:
    """One scheduler step as vLLM 0.33 drives the store path under asynchronous scheduling:
    the previous step's store jobs end first, then this step prepares one chunk per call
    (each call's rows stay WRITING, pinned, until the next step). Returns the keys stored."""
    if previous:
        c.complete_store(previous)
    stored = []
    for k in keys:
        out = c.prepare_store([k])
        if out is not None:
            stored += out[0]
    return stored


def _starve(c: TierChain, n: int) -> tuple[list[bytes], dict[bytes, bytes], list[bytes]]:
    """``n`` keys on disk only, then a step whose stores take every one of the ``n`` CPU rows:
    the first key's promotion finds no row. Returns the keys, their bytes and the pending
    stores."""
    old = [key(f"old{i}") for i in range(n)]
    data = fill(c, old)
    settle(c)
    pending = _store_step(c, [key(f"s1-{j}") for j in range(n)], [])
    assert len(pending) == n  # every row is being written by the GPU
    assert c.lookup(old[0]) == Lookup.MISS  # no CPU row: the run is recomputed
    c.on_schedule_end()
    return old, data, pending


def test_stores_leave_rows_for_promotions_once_one_found_none(tmp_path, monkeypatch):
    """The H200's disk-backed sweep (docs/results/2026-12-04c/call1): a step stored as much as
    the whole CPU tier holds, and vLLM's store jobs end a step later, so every row was pinned
    when the scans asked; 27 of the 39 runs the advisor decided to load (54 of 71 on the RAM
    disk) found no CPU row and were recomputed. Once a promotion finds no row, stores leave
    rows unpinned for promotions: the next step's promotion gets one and reads the exact bytes;
    the rows go back to stores once no promotion has been asked for a while."""
    c = make_chain(tmp_path, rows=16, disk_slots=64, promotion_reserve=0.125)
    old, data, pending = _starve(c, 16)
    assert c.cpu.promotion_reserve == 2  # an eighth of the rows from the next step on
    for step in range(2, 5):
        pending = _store_step(c, [key(f"s{step}-{j}") for j in range(16)], pending)
        found = c.lookup(old[step])
        assert found == Lookup.PENDING, (step, found, c.cpu.pinned_rows())
        c.on_schedule_end()
        settle(c)
        assert c.lookup(old[step]) == Lookup.HIT
        (row,) = c.prepare_load([old[step]])
        assert c.region.rows[row].tobytes() == data[old[step]]
        c.complete_load([old[step]])
    assert c.cpu.stats["rejections:reserved"] > 0
    assert c.cpu.promotion_reserve == 2  # every promotion found a row: it did not grow
    c.check()
    # no promotion asked since: the reserve ends and stores may take every row again
    monkeypatch.setattr("tiering.promotion_reserve.PROMOTION_RESERVE_IDLE_S", 0.0)
    c.complete_store(pending)
    settle(c)
    c.on_schedule_end()
    assert len(_store_step(c, [key(f"last-{j}") for j in range(16)], [])) == 16
    c.close()


def test_with_no_reserve_configured_stores_keep_taking_every_row(tmp_path):
    """``promotion_reserve`` 0 (the CPU tier's default, PROMOTION_RESERVE_DEFAULT): the
    promotion stays a miss, and stores are never refused for it."""
    c = make_chain(tmp_path, rows=8, disk_slots=32)  # TierChain's default share
    _, _, pending = _starve(c, 8)
    assert c.cpu.promotion_reserve == 0
    c.complete_store(pending)
    settle(c)
    assert len(_store_step(c, [key(f"b{j}") for j in range(8)], [])) == 8
    assert c.cpu.stats["rejections:reserved"] == 0
    c.close()


def test_the_reserve_doubles_while_promotions_still_find_no_row(tmp_path):
    """The advisor decides as many loads as the disk reads in time (on the H200, 14 runs of 8
    chunks in one step, against a reserve of 32 rows): each step whose promotions still found
    no row doubles the rows stores leave, up to under half of them; more promotions then get
    rows."""
    c = make_chain(tmp_path, rows=16, disk_slots=64, promotion_reserve=0.125)
    old, _, pending = _starve(c, 16)
    reserves, served = [c.cpu.promotion_reserve], []
    nxt = 1
    for step in range(2, 6):
        pending = _store_step(c, [key(f"s{step}-{j}") for j in range(16)], pending)
        wanted, nxt = old[nxt:nxt + 6], nxt + 6 if nxt + 6 <= 16 else 1
        got = [k for k in wanted if c.lookup(k) == Lookup.PENDING]
        served.append(len(got))
        c.on_schedule_end()
        settle(c)
        for k in got:
            assert c.lookup(k) == Lookup.HIT
            c.prepare_load([k])
            c.complete_load([k])
        reserves.append(c.cpu.promotion_reserve)
    assert reserves == [2, 4, 7, 7, 7], reserves  # 2, 4, 8 capped at (16 - 1) // 2
    assert served[0] == 2 and served[-1] >= 6, served
    c.check()
    c.complete_store(pending)
    c.close()


def _read_finished(chain: TierChain, timeout: float = 10.0) -> None:
    """Wait until the file tier's read has finished on its I/O thread, without applying it (the
    tier's completion queue holds it; only a poll applies it)."""
    import time

    deadline = time.monotonic() + timeout
    while chain.file_tiers[0]._results.empty():  # noqa: SLF001 - the test must not poll
        assert time.monotonic() < deadline, "the read never finished"
        time.sleep(0.001)


@pytest.mark.parametrize("interval,hit_before_step_end", [(0.0, True), (3600.0, False)])
def test_lookups_apply_finished_reads_at_most_every_interval_and_the_step_end_always(
        tmp_path, monkeypatch, interval, hit_before_step_end):
    """While promotions are read, vLLM re-asks every chunk each step; a lookup applies finished
    reads at most every LOOKUP_POLL_INTERVAL_S (a re-ask 1.56 -> 1.2 us a chunk), so a read
    that finished just after one is a hit a little later, and at the latest after the step's
    end, which always applies what finished."""
    import tiering.chain as chain_module

    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", interval)
    c = make_chain(tmp_path, rows=2)
    a = [key("a0"), key("a1")]
    data = fill(c, a)
    settle(c)
    fill(c, [key("b0"), key("b1")], seed=1)
    settle(c)
    assert c.lookup(a[0]) == Lookup.PENDING
    c.on_schedule_end()  # the read is issued (and this step's end polled before it finished)
    _read_finished(c)
    assert c.lookup(a[0]) == (Lookup.HIT if hit_before_step_end else Lookup.PENDING)
    c.on_schedule_end()
    assert c.lookup(a[0]) == Lookup.HIT
    (row,) = c.prepare_load([a[0]])
    assert c.region.rows[row].tobytes() == data[a[0]]
    c.close()
