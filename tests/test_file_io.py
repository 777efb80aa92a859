"""The file tier's data path: overlapped group commits, run planning, unaligned memory."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from tierutil import ROW, key, open_tier, row_for, store

from tiering.backends.file_io import (
    Committer,
    Job,
    PendingMeta,
    WriteItem,
    WritesDone,
)
from tiering.backends.index import Index, pack_record
from tiering.backends.slab import SlabSet, adjacent_runs, run_rows
from tiering.backends.slab_io import PosixSlabIo


def test_overlapped_batches_never_bring_back_a_key_the_next_batch_drops(tmp_path):
    """Batch A carries an old access-stats record of K; batch B drops K. The committer starts
    B (its reserve deletes K) before it publishes A: A's record must not resurrect K."""
    index = Index(tmp_path, map_size=64 << 20)
    slabs = SlabSet(tmp_path, ROW, 4, 4 * ROW)
    slabs.create_or_resize(preallocate=True)
    io = PosixSlabIo(2)
    slabs.open(io)
    gone = key("dropped")
    now = time.time()
    index.publish([(gone, pack_record(0, ROW, 0, 0, now, now, 0))], [])
    out: queue.SimpleQueue = queue.SimpleQueue()
    committer = Committer(index, slabs, io, out, None, max_batch=1, pending=PendingMeta())
    stale = pack_record(0, ROW, 0, 0, now, now + 1, 1)  # a touch of K taken before the drop
    committer.jobs.put(Job(writes=[WriteItem(key("new"), 1, row_for(key("new")), now)],
                           records=[(gone, stale)]))
    committer.jobs.put(Job(drop_keys=[gone], freed_slots=[0]))
    committer.jobs.put(None)
    committer.start()  # both jobs are queued: the two batches overlap
    committer.join(timeout=30)
    try:
        assert index.get(gone) is None
        assert index.get(key("new")) is not None
        results = _drain(out)
        assert [(r.key, r.ok) for r in results] == [(key("new"), True)]
    finally:
        io.shutdown()
        slabs.close(io)
        index.close()


def _drain(out: queue.SimpleQueue) -> list:
    results = []
    while True:
        try:
            m = out.get_nowait()
        except queue.Empty:
            return results
        if isinstance(m, WritesDone):
            results += m.results


def test_many_writes_and_reads_through_overlapping_batches_round_trip(tmp_path):
    with open_tier(tmp_path, slots=64, max_batch=4) as t:
        keys = [key(i) for i in range(64)]
        for lo in range(0, 64, 4):  # sixteen jobs queued faster than they commit
            assert t.put(keys[lo:lo + 4], [row_for(k) for k in keys[lo:lo + 4]]).admitted
        assert all(d.ok for d in t.wait_idle())
        outs = [bytearray(ROW + 1) for _ in keys]  # unaligned: O_DIRECT needs the bounce path
        views = [memoryview(b)[1:] for b in outs]
        assert all(t.get([(k, v, i) for i, (k, v) in enumerate(zip(keys, views, strict=True))]))
        done = t.wait_idle()
        assert sorted(r.token for r in done) == list(range(64)) and all(r.ok for r in done)
        for k, v in zip(keys, views, strict=True):
            assert bytes(v) == bytes(row_for(k))
    with open_tier(tmp_path, slots=64) as t:  # and they were all published
        assert all(t.contains(k) for k in keys)


def test_flush_after_a_lone_write_does_not_wait_for_another_job(tmp_path):
    with open_tier(tmp_path) as t:
        store(t, [key(1)])
        t0 = time.monotonic()
        t.put([key(2)], [row_for(key(2))])
        t.flush()
        assert time.monotonic() - t0 < 0.9  # not held back until the committer's idle tick
        assert t.contains(key(2))


@pytest.mark.parametrize("n, threads, row, want", [
    (16, 16, 256 << 10, 4),  # no run under 1 MiB: four 1 MiB runs, not sixteen rows
    (64, 4, 256 << 10, 16),  # even split over the threads
    (8, 16, 2 << 20, 1),  # a 2 MiB row is a run on its own
    (1000, 4, 256 << 10, 16),  # reads are capped at 4 MiB per call
])
def test_run_rows_splits_evenly_with_a_floor_and_a_cap(n, threads, row, want):
    assert run_rows(n, threads, row, 4 << 20) == want


def test_adjacent_runs_cover_every_item_once_and_stay_in_one_file(tmp_path):
    slabs = SlabSet(tmp_path, ROW, 40, 8 * ROW)  # 8 slots per file
    slots = [3, 4, 5, 6, 7, 8, 9, 20, 22, 23, 1, 0]
    runs = adjacent_runs(slots, slabs, 3, lambda s: s)
    assert sorted(s for r in runs for s in r) == sorted(slots)
    for r in runs:
        assert len(r) <= 3
        assert r == list(range(r[0], r[0] + len(r)))  # consecutive
        assert len({s // 8 for s in r}) == 1  # one slab file


def test_slab_io_runs_an_urgent_task_before_every_plain_one_queued_ahead_of_it():
    """A read some request waits for (urgent) jumps the writer's queued runs (plain); plain
    tasks keep their order, and every task runs once."""
    io = PosixSlabIo(1)
    order: list[str] = []
    gate = threading.Event()
    try:
        io.post(gate.wait, 5.0)  # the one worker is busy while the rest queue up
        for i in range(4):
            io.post(order.append, f"write{i}")
        io.post(order.append, "read0", urgent=True)
        fut = io.submit(order.append, "write4")
        io.post(order.append, "read1", urgent=True)
        gate.set()
        fut.result(timeout=5)
        assert order == ["read0", "read1", "write0", "write1", "write2", "write3", "write4"]
    finally:
        gate.set()
        io.shutdown()


def test_slab_io_tasks_report_results_and_errors():
    io = PosixSlabIo(3)
    try:
        assert io.submit(lambda a, b: a + b, 2, 3).result(timeout=5) == 5
        fut = io.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fut.result(timeout=5)
        got: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(20):
            io.post(got.put, i)
        assert sorted(got.get(timeout=5) for _ in range(20)) == list(range(20))
    finally:
        io.shutdown()
