"""Hostile tests of the throttled lookup poll, our threads' OS names, per-thread CPU accounting
and gpu-bench's step budget and per-request options.

Attacked:

* ``TierChain.find_cpu``'s throttled poll (``LOOKUP_POLL_INTERVAL_S``, ``_polled_at``): lookups
  of many keys by several requests racing reads that finish on the file tier's I/O threads, with
  the interval 0, the default, huge and NaN; reads that fail (corrupt slots in the slab file),
  promotions gone from the tier before their batch is issued, a reset while reads are in flight;
  the contract checked on a fake clock of the chain (a finished read is a hit once the interval
  has passed since the last poll, never before, and always after a step's end); every request
  becomes all-HIT (or meets its miss) in a bounded number of steps and is served its bytes.
* ``tiering.thread_names``: empty, non-ASCII, surrogate, NUL-holding and very long names, prctl
  missing or raising, many threads naming themselves at once, never the process's own name.
* ``benchmarks/thread_cpu.py`` over a fake ``/proc``: comm with ')', spaces and newlines, stat
  files vanished, empty, truncated or malformed, entries that are not processes, and a thread
  id reused by another thread between two snapshots.
* ``benchmarks/gpu_bench.py``: ``StepBudget`` with starts negative, zero, NaN, huge, longer than
  the step, the first start the quickest; ``parse()`` with odd ``--cprofile-phases`` and
  ``--thread-cpu-phases`` values.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest
from tierutil import facts, key

import tiering.backends.staging as staging
import tiering.chain as chain_module
from tiering.backends.file_tier import FileTier
from tiering.backends.staging import StagingRegion
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier
from tiering.request_scan import RequestScan

ROW = 8192
DEADLINE_S = 10.0


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def make_chain(tmp_path, rows=4, disk_slots=64, engine="e1") -> TierChain:
    region = StagingRegion(engine, rows, ROW)
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": disk_slots * ROW,
                     "io": "posix", "policy": "lru", "store_threshold": 0, "io_threads": 4},
                    facts(ROW))
    return TierChain(CpuTier(region, "lru", 0), file_tiers=[tier], events=True)


def store_all(chain: TierChain, keys: list[bytes], seed: int = 0) -> dict[bytes, bytes]:
    """Store ``keys`` as the GPU would, a CPU tier's worth at a time, each batch written down
    before the next: every key ends on disk, the last ones also in the CPU rows."""
    data: dict[bytes, bytes] = {}
    rng = np.random.default_rng(seed)
    for at in range(0, len(keys), chain.num_rows):
        out = chain.prepare_store(keys[at:at + chain.num_rows])
        assert out is not None
        stored, rows, _ = out
        for k, r in zip(stored, rows, strict=True):
            chain.region.rows[r][:] = rng.integers(0, 256, ROW, dtype=np.uint8)
            data[k] = chain.region.rows[r].tobytes()
        chain.complete_store(stored)
        chain.wait_idle()
    for k in keys:
        assert chain.file_tiers[0].contains(k)
    return data


def push_out(chain: TierChain, keys: list[bytes], seed: int = 99) -> None:
    """Fill every CPU row with other chunks, so that ``keys`` are only on disk."""
    store_all(chain, [key(f"filler-{seed}-{i}") for i in range(chain.num_rows)], seed=seed)
    assert not any(chain.cpu.contains(k) for k in keys)


def on_disk_only(tmp_path, rows: int, ks: list[bytes]
                 ) -> tuple[TierChain, list[bytes], dict[bytes, bytes]]:
    """A chain of ``rows`` CPU rows whose ``ks`` are stored and then pushed out to the disk:
    the chain, the keys and their bytes."""
    c = make_chain(tmp_path, rows=rows)
    data = store_all(c, ks)
    push_out(c, ks)
    return c, ks, data


def damage(chain: TierChain, k: bytes) -> None:
    """Flip bytes in the middle of ``k``'s slot in the slab file (its checksum then fails)."""
    disk = chain.file_tiers[0]
    slot = disk.entry(k).slot
    per_file = disk.slabs.slots_per_file
    path, at = disk.folder / f"slab-{slot // per_file:04d}.dat", (slot % per_file) * ROW
    assert path.exists(), path
    with open(path, "r+b") as fh:
        fh.seek(at + 1000)
        b = fh.read(16)
        fh.seek(at + 1000)
        fh.write(bytes(x ^ 0xFF for x in b))


def drive(chain: TierChain, requests: dict[str, list[bytes]], data: dict[bytes, bytes],
          max_steps: int = 400, reasks: int = 1, nap: float = 0.0) -> dict[str, list[bytes]]:
    """vLLM's scheduler over ``requests``: each step every waiting request's chunks are asked in
    prompt order (``reasks`` times, as vLLM re-asks a waiting request's chunks) up to the first
    MISS; one with no PENDING answer before its first MISS loads its hits (their bytes checked)
    and finishes. Returns each request's loaded hits. Fails past ``max_steps`` steps or the
    deadline: a request stalled."""
    scans = {r: RequestScan(chain, r) for r in requests}
    served: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + DEADLINE_S
    for _step in range(max_steps):
        for r, keys in requests.items():
            if r in served:
                continue
            for _ in range(reasks):
                hits, pending = [], False
                for k in keys:
                    got = scans[r].lookup(k)
                    assert got in (Lookup.HIT, Lookup.PENDING, Lookup.MISS), got
                    if got is Lookup.MISS:
                        break
                    pending = pending or got is Lookup.PENDING
                    if got is Lookup.HIT and not pending:
                        hits.append(k)
            if pending:
                continue
            rows = chain.prepare_load(hits)
            for k, row in zip(hits, rows, strict=True):
                assert chain.region.rows[row].tobytes() == data[k], f"{r}: wrong bytes served"
            chain.complete_load(hits)
            scans[r].load_completed()  # as the manager's complete_load
            scans[r].finished()
            served[r] = hits
        if len(served) == len(requests):
            chain.check()
            return served
        chain.on_schedule_end()
        chain.check()
        assert time.monotonic() < deadline, f"stalled: {sorted(set(requests) - set(served))}"
        if nap:
            time.sleep(nap)
    raise AssertionError(f"stalled after {max_steps} steps: {sorted(set(requests) - set(served))}")


INTERVALS = [0.0, chain_module.LOOKUP_POLL_INTERVAL_S, 3600.0, float("nan")]


@pytest.mark.parametrize("interval", INTERVALS, ids=["zero", "default", "huge", "nan"])
def test_requests_racing_finishing_reads_are_all_hit_with_their_bytes(tmp_path, monkeypatch,
                                                                      interval):
    """Three requests of 5 disk chunks each over 16 CPU rows, re-asking every chunk 3 times a
    step while reads finish on 4 I/O threads: whatever the interval (even NaN: then only the
    step ends apply reads), each becomes all-HIT within a bounded number of steps and loads
    exactly the bytes stored."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", interval)
    c = make_chain(tmp_path, rows=16)
    reqs = {f"r{j}": [key(f"r{j}-{i}") for i in range(5)] for j in range(3)}
    every = [k for ks in reqs.values() for k in ks]
    data = store_all(c, every)
    push_out(c, every)
    try:
        served = drive(c, reqs, data, reasks=3)
        assert served == reqs  # every chunk a hit, none lost to a race
        assert c.tiers[1].stats["promotions"] == len(every)
    finally:
        c.close()


@pytest.mark.parametrize("interval", [0.0, 3600.0], ids=["zero", "huge"])
def test_a_request_as_large_as_the_cpu_tier_is_never_stalled_by_throttled_lookups(
        tmp_path, monkeypatch, interval):
    """A request of exactly as many disk chunks as the CPU tier has rows, asked back to back
    without a pause: its own promoted rows are never evicted for its tail, and once the step
    ends apply the reads (lookups apply none with a huge interval) it is all-HIT."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", interval)
    c, ks, data = on_disk_only(tmp_path, 6, [key(f"big-{i}") for i in range(6)])
    try:
        assert drive(c, {"big": ks}, data, reasks=2) == {"big": ks}
    finally:
        c.close()


@pytest.mark.parametrize("interval", [0.0, chain_module.LOOKUP_POLL_INTERVAL_S, 3600.0],
                         ids=["zero", "default", "huge"])
def test_corrupt_slots_among_racing_reads_are_misses_never_served(tmp_path, monkeypatch,
                                                                  interval):
    """Two of a request's chunks have damaged slots: the first damaged one ends the request's
    hits (a miss: vLLM computes from there), its chunks before it are served their bytes, the
    damaged chunks are never a hit, and another request's chunks are unaffected."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", interval)
    c = make_chain(tmp_path, rows=16)
    a = [key(f"a-{i}") for i in range(6)]
    b = [key(f"b-{i}") for i in range(6)]
    data = store_all(c, a + b)
    push_out(c, a + b)
    damage(c, a[2])
    damage(c, a[4])
    try:
        served = drive(c, {"a": a, "b": b}, data, reasks=2)
        assert served == {"a": a[:2], "b": b}
        assert c.lookup(a[2]) == Lookup.MISS and not c.file_tiers[0].contains(a[2])
        assert c.file_tiers[0].stats["checksum_failures"] >= 1
    finally:
        c.close()


def test_a_promotion_gone_from_the_tier_before_its_batch_is_a_miss_at_once(tmp_path,
                                                                           monkeypatch):
    """A chunk dropped from the file tier between its lookup (PENDING) and the step's end:
    with lookups that never poll, the step's end still turns it into a miss, and the others of
    the batch become hits."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", 3600.0)
    c, ks, data = on_disk_only(tmp_path, 8, [key(f"g-{i}") for i in range(4)])
    try:
        assert [c.lookup(k) for k in ks] == [Lookup.PENDING] * 4
        assert c.file_tiers[0].drop([ks[1]]) == 1
        c.on_schedule_end()
        assert c.lookup(ks[1], count=False) == Lookup.MISS  # "gone": applied at the step end
        deadline = time.monotonic() + DEADLINE_S
        while any(c.lookup(k, count=False) is Lookup.PENDING for k in (ks[0], ks[2], ks[3])):
            c.on_schedule_end()
            assert time.monotonic() < deadline, "the batch's other reads never applied"
            time.sleep(0.001)
        for k in (ks[0], ks[2], ks[3]):
            assert c.lookup(k, count=False) == Lookup.HIT
            (row,) = c.prepare_load([k])
            assert c.region.rows[row].tobytes() == data[k]
            c.complete_load([k])
        c.check()
    finally:
        c.close()


def test_a_reset_while_reads_are_in_flight_serves_only_the_new_reads(tmp_path, monkeypatch):
    """Reads in flight when the CPU tier is reset, the same chunks promoted again at once: the
    first reads' completions (applied late: lookups never poll) never make a chunk a hit in a
    row that is not its own, and the second reads' bytes are exact."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", 3600.0)
    c, ks, data = on_disk_only(tmp_path, 8, [key(f"z-{i}") for i in range(4)])
    try:
        assert [c.lookup(k) for k in ks] == [Lookup.PENDING] * 4
        c.on_schedule_end()  # the first reads are issued
        c.reset()
        assert [c.lookup(k) for k in ks] == [Lookup.PENDING] * 4  # promoted again
        served = drive(c, {"again": ks}, data)
        assert served == {"again": ks}
    finally:
        c.close()


class FakeClock:
    """The chain's view of ``time`` with its own ``perf_counter`` (the I/O threads keep theirs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def _wait_finished(c: TierChain, n: int = 1) -> None:
    """Until the file tier's completion queue holds ``n`` results (none applied)."""
    deadline = time.monotonic() + DEADLINE_S
    while c.file_tiers[0]._results.qsize() < n:  # noqa: SLF001 - the test must not poll
        assert time.monotonic() < deadline, "the reads never finished"
        time.sleep(0.001)


def test_on_a_fake_clock_a_finished_read_is_a_hit_exactly_once_the_interval_passed(
        tmp_path, monkeypatch):
    """The contract on the chain's own clock: a read finished just after a poll stays PENDING
    for lookups until LOOKUP_POLL_INTERVAL_S has passed since that poll and is a HIT at the
    first lookup after it; a lookup that polled restarts the interval; the step's end always
    applies what finished."""
    clock = FakeClock()
    monkeypatch.setattr(chain_module, "time", types.SimpleNamespace(
        perf_counter=clock.perf_counter, sleep=time.sleep, monotonic=time.monotonic))
    step = chain_module.LOOKUP_POLL_INTERVAL_S
    c, ks, data = on_disk_only(tmp_path, 4, [key(f"f-{i}") for i in range(2)])
    try:
        assert c.lookup(ks[0]) == Lookup.PENDING
        c.on_schedule_end()  # issued at 1000.0, and polled then
        assert c._polled_at == clock.now  # noqa: SLF001
        _wait_finished(c)
        clock.now += step / 2
        assert c.lookup(ks[0], count=False) == Lookup.PENDING  # finished, not yet applied
        clock.now += step * 0.49  # still under the interval since the step end's poll
        assert c.lookup(ks[0], count=False) == Lookup.PENDING
        clock.now += step * 0.02  # just past it (not exactly: float sums of the clock)
        assert c.lookup(ks[0], count=False) == Lookup.HIT
        (row,) = c.prepare_load([ks[0]])
        assert c.region.rows[row].tobytes() == data[ks[0]]
        c.complete_load([ks[0]])
        # the second chunk, with a third's read keeping a batch in flight: a lookup that polls
        # (the interval passed) before the read finished restarts the interval
        ks.append(key("f-late"))
        data.update(store_all(c, [ks[2]], seed=5))
        push_out(c, ks, seed=98)
        assert c.lookup(ks[1]) == Lookup.PENDING
        clock.now += 1.0
        c.on_schedule_end()  # polled at this instant
        _wait_finished(c)
        assert c.lookup(ks[1], count=False) == Lookup.PENDING  # same instant as the step's poll
        c.on_schedule_end()  # the step's end applies it at once
        assert c.lookup(ks[1], count=False) == Lookup.HIT
        assert c.lookup(ks[2]) == Lookup.PENDING
        c.on_schedule_end()
        _wait_finished(c)
        clock.now += step * 1.01
        polled = c._polled_at  # noqa: SLF001
        assert c.lookup(ks[2], count=False) == Lookup.HIT  # the lookup polled: applied
        assert c._polled_at > polled  # noqa: SLF001 - and the interval restarts there
        for k in (ks[1], ks[2]):
            (row,) = c.prepare_load([k])
            assert c.region.rows[row].tobytes() == data[k]
            c.complete_load([k])
    finally:
        c.close()


def test_lookups_without_reads_in_flight_never_poll_and_the_first_lookup_after_a_step_may(
        tmp_path, monkeypatch):
    """``_polled_at`` before any poll, lookups with nothing in flight, a poll per lookup at
    interval 0 and none at a huge interval (counted with a spy on ``poll``)."""
    c = make_chain(tmp_path, rows=4)
    ks = [key(f"s-{i}") for i in range(3)]
    store_all(c, ks)
    push_out(c, ks)
    polls = []
    real = c.poll
    monkeypatch.setattr(c, "poll", lambda wait=0.0: (polls.append(wait), real(wait))[1])
    try:
        monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", 0.0)
        fresh = make_chain(tmp_path / "fresh", rows=2, engine="e2")
        try:
            assert fresh._polled_at <= time.perf_counter()  # noqa: SLF001
            assert fresh.lookup(key("none")) == Lookup.MISS  # nothing in flight: no poll needed
        finally:
            fresh.close()
        assert c.lookup(ks[0]) == Lookup.PENDING
        assert polls == []  # promoted, not issued: no batch in flight, nothing to apply
        c.on_schedule_end()
        n, flying = len(polls), 0
        for _ in range(5):
            flying += bool(c._batches)  # noqa: SLF001
            c.lookup(ks[0], count=False)
        assert len(polls) == n + flying  # at interval 0 each lookup polls while reads fly
        monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", 3600.0)
        assert c.lookup(ks[1]) == Lookup.PENDING
        c.on_schedule_end()
        n = len(polls)
        for _ in range(50):
            c.lookup(ks[1], count=False)
        assert len(polls) == n  # a huge interval: only step ends apply reads
        deadline = time.monotonic() + DEADLINE_S
        while c.lookup(ks[1], count=False) is not Lookup.HIT:
            c.on_schedule_end()
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        c.close()


def test_lookups_from_a_tight_loop_see_a_finished_read_without_a_step_end(tmp_path,
                                                                           monkeypatch):
    """At the default interval a read that finished is seen by lookups alone (no step end),
    however tight the loop of lookups: the interval is measured from the last poll, not reset by
    every lookup."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S",
                        chain_module.LOOKUP_POLL_INTERVAL_S)
    c, ks, data = on_disk_only(tmp_path, 4, [key("t-0")])
    try:
        assert c.lookup(ks[0]) == Lookup.PENDING
        c.on_schedule_end()
        deadline = time.monotonic() + DEADLINE_S
        while c.lookup(ks[0], count=False) is not Lookup.HIT:  # no sleep, no step end
            assert time.monotonic() < deadline, "lookups alone never applied the read"
        (row,) = c.prepare_load(ks)
        assert c.region.rows[row].tobytes() == data[ks[0]]
    finally:
        c.close()


def test_close_with_reads_in_flight_and_throttled_lookups_then_lookups_after_close(
        tmp_path, monkeypatch):
    """close() while promotions are in flight and lookups apply nothing: close applies them
    (no read is left pinning a row), and no lookup raises afterwards."""
    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", 3600.0)
    c = make_chain(tmp_path, rows=8)
    ks = [key(f"c-{i}") for i in range(6)]
    store_all(c, ks)
    push_out(c, ks)
    assert [c.lookup(k) for k in ks] == [Lookup.PENDING] * 6
    c.on_schedule_end()
    c.close()
    assert not c._batches and not c._in_flight  # noqa: SLF001
    assert all(c.cpu.lookup(k, count=False) in (Lookup.HIT, Lookup.MISS) for k in ks)


# -- thread names ------------------------------------------------------------------------------

linux = pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="prctl, /proc")


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm", "rb") as fh:
        return fh.read().rstrip(b"\n").decode("utf-8", "replace")


def _in_thread(fn):
    """Run ``fn()`` in a fresh thread; (its result, its native id, its comm while alive)."""
    out: dict[str, object] = {}
    done = threading.Event()
    ready = threading.Event()

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc
        out["tid"] = threading.get_native_id()
        out["comm"] = _comm(threading.get_native_id()) if __import__("sys").platform.startswith(
            "linux") else None
        ready.set()
        done.wait(DEADLINE_S)

    t = threading.Thread(target=body)
    t.start()
    try:
        assert ready.wait(DEADLINE_S)
    finally:
        done.set()
        t.join(DEADLINE_S)
    assert "error" not in out, out.get("error")
    return out["result"], out["tid"], out["comm"]


@linux
@pytest.mark.parametrize("name,kept", [
    ("", ""),
    ("tier-posix-0", "tier-posix-0"),
    ("x" * 15, "x" * 15),
    ("x" * 16, "x" * 15),
    ("tier-名前-テスト", "tier-名前-テ"),  # 5 + 3 * 3 + 1 = 15 bytes, never half a character
    ("🚀" * 5, "🚀" * 3),  # 4-byte characters: 12 bytes, the 4th would make 16
    ("a) b (c", "a) b (c"),
    ("a\nb", "a\nb"),
    ("cut\x00here", "cut"),  # the kernel stops at the NUL
    ("x" * 10_000, "x" * 15),
])
def test_odd_names_are_taken_whole_characters_at_most_15_bytes(name, kept):
    from tiering.thread_names import name_os_thread, os_name

    assert len(os_name(name)) <= 15
    os_name(name).decode("utf-8")  # whole characters only
    ok, _tid, comm = _in_thread(lambda: name_os_thread(name))
    assert ok is True
    assert comm == kept


@linux
@pytest.mark.parametrize("name", ["\udcff-surrogate", None, b"bytes", 42])
def test_names_that_cannot_be_encoded_never_raise(name):
    from tiering.thread_names import name_os_thread

    before = _comm(threading.get_native_id())
    ok, _tid, comm = _in_thread(lambda: name_os_thread(name))  # type: ignore[arg-type]
    assert ok is False
    assert _comm(threading.get_native_id()) == before  # nobody else renamed


def test_without_prctl_or_with_a_failing_one_naming_returns_false(monkeypatch):
    import tiering.thread_names as tn

    monkeypatch.setattr(tn, "_prctl", None)
    assert _in_thread(lambda: tn.name_os_thread("tier-x"))[0] is False

    def raising(*_a):
        raise OSError("no prctl here")

    monkeypatch.setattr(tn, "_prctl", raising)
    assert _in_thread(lambda: tn.name_os_thread("tier-x"))[0] is False
    monkeypatch.setattr(tn, "_prctl", lambda *_a: -1)  # the kernel refused
    assert _in_thread(lambda: tn.name_os_thread("tier-x"))[0] is False

    def interrupting(*_a):
        raise KeyboardInterrupt  # not an Exception: a real interrupt must still get through

    monkeypatch.setattr(tn, "_prctl", interrupting)
    with pytest.raises(KeyboardInterrupt):
        tn.name_os_thread("tier-x")


@linux
def test_many_threads_naming_themselves_at_once_each_get_their_own_name():
    from tiering.thread_names import name_os_thread

    main_before = _comm(threading.get_native_id())
    n = 48
    barrier = threading.Barrier(n)
    hold = threading.Event()
    got: dict[int, tuple[bool, int]] = {}
    lock = threading.Lock()

    def body(i: int) -> None:
        barrier.wait(DEADLINE_S)
        ok = name_os_thread(f"tier-many-{i}")
        with lock:
            got[i] = (ok, threading.get_native_id())
        hold.wait(DEADLINE_S)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < n:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for i, (ok, tid) in got.items():
            assert ok and _comm(tid) == f"tier-many-{i}"[:15]
        assert _comm(threading.get_native_id()) == main_before  # the process keeps its name
    finally:
        hold.set()
        for t in threads:
            t.join(DEADLINE_S)


@linux
def test_our_io_threads_are_named_and_the_process_is_not_renamed(tmp_path):
    """A file tier's slab I/O workers and committer name themselves; the thread that opened
    the tier (the scheduler's) keeps its name."""
    import os

    before = _comm(threading.get_native_id())
    c = make_chain(tmp_path, rows=2)
    try:
        deadline = time.monotonic() + DEADLINE_S
        want = {"tier-posix-0", "tier-posix-1", "tier-posix-2", "tier-posix-3", "tier-committer"}
        while True:
            names = {_comm(int(t)) for t in os.listdir("/proc/self/task")}
            if want <= names:
                break
            assert time.monotonic() < deadline, f"not named: {want - names}"
            time.sleep(0.01)
        assert _comm(threading.get_native_id()) == before
    finally:
        c.close()


# -- per-thread CPU over a fake /proc ----------------------------------------------------------

REST = "S 1 2 3 4 5 6 7 8 9 10 {u} {s} 0 0 20 0 2 0 {start} 0 0"


def _stat_line(pid: int, comm: str, u: int, s: int, start: int = 100) -> bytes:
    return f"{pid} ({comm}) {REST.format(u=u, s=s, start=start)}\n".encode()


def _proc(root, procs: dict[int, tuple[str, dict[int, tuple[str, int, int]]]]) -> str:
    """A fake /proc: pid -> (its comm, tid -> (comm, utime, stime))."""
    for pid, (comm, threads) in procs.items():
        (root / str(pid) / "task").mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "stat").write_bytes(_stat_line(pid, comm, 1, 1))
        for tid, (tcomm, u, s) in threads.items():
            (root / str(pid) / "task" / str(tid)).mkdir(exist_ok=True)
            (root / str(pid) / "task" / str(tid) / "stat").write_bytes(
                _stat_line(tid, tcomm, u, s))
    return str(root)


def test_comm_names_with_parentheses_spaces_newlines_and_bad_utf8_parse(tmp_path):
    from benchmarks import thread_cpu

    root = _proc(tmp_path, {10: ("py) (3", {11: (") S 9 9 9 (", 5, 6), 12: ("a\nb c", 7, 0),
                                             13: ("", 1, 2)})})
    (tmp_path / "10" / "task" / "14").mkdir()
    (tmp_path / "10" / "task" / "14" / "stat").write_bytes(
        b"14 (bad\xff\xfe) " + REST.format(u=3, s=3, start=1).encode())
    snap = thread_cpu.snapshot(root)
    assert {k: (v.process, v.thread, v.ticks) for k, v in snap.items()} == {
        (10, 11): ("py) (3", ") S 9 9 9 (", 11),
        (10, 12): ("py) (3", "a\nb c", 7),
        (10, 13): ("py) (3", "", 3),
        (10, 14): ("py) (3", "bad\ufffd\ufffd", 6),
    }


def test_vanished_empty_truncated_and_malformed_entries_are_skipped(tmp_path):
    from benchmarks import thread_cpu

    _proc(tmp_path, {20: ("ok", {21: ("good", 10, 10)}), 30: ("no-task-dir", {})})
    (tmp_path / "30" / "task").rmdir()  # a process gone between its stat and its task list
    task = tmp_path / "20" / "task"
    for tid, content in {22: b"", 23: b"23 (x", 24: b"24 (x) S 1 2", 25: b"25 x) S",
                         26: b"26 (x) S 1 2 3 4 5 6 7 8 9 10 u s 0 0"}.items():
        (task / str(tid)).mkdir()
        (task / str(tid) / "stat").write_bytes(content)
    (task / "27").mkdir()  # a thread gone between the listing and the read: no stat
    (task / "28").mkdir()
    (task / "28" / "stat").mkdir()  # unreadable as a file
    (task / "self").mkdir()  # not a thread id
    (tmp_path / "40").write_text("a file, not a process")
    (tmp_path / "net").mkdir()
    (tmp_path / "50").mkdir()  # a process whose stat vanished
    snap = thread_cpu.snapshot(str(tmp_path))
    assert set(snap) == {(20, 21)} and snap[(20, 21)].ticks == 20
    assert thread_cpu.snapshot(str(tmp_path / "missing")) == {}


def test_directory_names_that_are_digits_but_not_ascii_are_not_processes(tmp_path):
    """``str.isdigit`` is true for '²' and '٣': ``int('²')`` raises, ``int('٣')`` is 3. A
    snapshot never raises and never takes such a name for a process or thread id."""
    from benchmarks import thread_cpu

    root = _proc(tmp_path, {60: ("ok", {61: ("good", 4, 4)})})
    for odd in ("²", "٣", "³4"):
        (tmp_path / odd).mkdir()
        (tmp_path / odd / "stat").write_bytes(_stat_line(3, "fake", 99, 99))
        (tmp_path / odd / "task").mkdir()
        (tmp_path / "60" / "task" / odd).mkdir()
        (tmp_path / "60" / "task" / odd / "stat").write_bytes(_stat_line(3, "fake", 99, 99))
    snap = thread_cpu.snapshot(root)
    assert set(snap) == {(60, 61)}


def test_a_thread_id_reused_between_snapshots_counts_from_zero(tmp_path):
    """A thread that ended and another born with its id between the two snapshots: the new
    thread's CPU counts from zero (its start time differs), not as the difference with the dead
    one's ticks (negative: the new thread vanished from the table)."""
    from benchmarks import thread_cpu

    root = tmp_path / "before"
    _proc(root, {70: ("py", {71: ("old-worker", 400, 100)})})
    before = thread_cpu.snapshot(str(root))
    after_root = tmp_path / "after"
    _proc(after_root, {70: ("py", {})})
    (after_root / "70" / "task" / "71").mkdir()
    (after_root / "70" / "task" / "71" / "stat").write_bytes(
        _stat_line(71, "tier-new", 2 * thread_cpu.TICKS_PER_S, 0, start=5000))
    rows = thread_cpu.busiest(before, thread_cpu.snapshot(str(after_root)))
    assert rows == [{"pid": 70, "tid": 71, "process": "py", "thread": "tier-new", "cpu_s": 2.0}]
    # the same thread (same start) is a difference, as before
    same = tmp_path / "same"
    _proc(same, {70: ("py", {71: ("old-worker", 400 + thread_cpu.TICKS_PER_S, 100)})})
    rows = thread_cpu.busiest(before, thread_cpu.snapshot(str(same)))
    assert rows == [{"pid": 70, "tid": 71, "process": "py", "thread": "old-worker",
                     "cpu_s": 1.0}]


@linux
def test_a_real_thread_of_this_process_with_an_odd_name_is_found_busy():
    import os

    from benchmarks import thread_cpu
    from tiering.thread_names import name_os_thread

    stop = threading.Event()
    named = threading.Event()
    tid: list[int] = []

    def spin() -> None:
        name_os_thread("a) b (c\nd")
        tid.append(threading.get_native_id())
        named.set()
        x = 0
        while not stop.is_set():
            x += sum(range(200))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        assert named.wait(DEADLINE_S)
        before = thread_cpu.snapshot()
        deadline = time.monotonic() + DEADLINE_S
        while True:
            time.sleep(0.2)
            rows = thread_cpu.busiest(before, thread_cpu.snapshot(), top=10_000)
            mine = [r for r in rows if r["pid"] == os.getpid() and r["tid"] == tid[0]]
            if mine:
                break
            assert time.monotonic() < deadline, "the spinning thread never showed CPU time"
        assert mine[0]["thread"] == "a) b (c\nd"
        assert all(float(a["cpu_s"]) >= float(b["cpu_s"]) for a, b in zip(rows, rows[1:],
                                                                           strict=False))
    finally:
        stop.set()
        t.join(DEADLINE_S)


def test_busiest_with_top_zero_or_negative_and_no_change(tmp_path):
    from benchmarks import thread_cpu

    a = {(1, 1): thread_cpu.ThreadCpu(1, 1, "p", "t", 10)}
    b = {(1, 1): thread_cpu.ThreadCpu(1, 1, "p", "t", 10 + thread_cpu.TICKS_PER_S),
         (1, 2): thread_cpu.ThreadCpu(1, 2, "p", "u", 2 * thread_cpu.TICKS_PER_S)}
    assert thread_cpu.busiest(a, a) == []
    assert thread_cpu.busiest(a, b, top=0) == []
    assert [r["tid"] for r in thread_cpu.busiest(a, b, top=1)] == [2]
    assert [r["tid"] for r in thread_cpu.busiest({}, b)] == [2, 1]  # born meanwhile: from zero


# -- gpu-bench: the step budget and the new options ----------------------------------------------

def _budget(budget_s: float = 1000.0, now: float = 0.0):
    from benchmarks import gpu_bench

    clock = [now]
    return gpu_bench.StepBudget(budget_s, 0.0, clock=lambda: clock[0]), clock


def test_the_first_start_is_never_what_a_start_costs_even_when_it_was_the_quickest():
    from benchmarks import gpu_bench

    b, _ = _budget()
    guess = gpu_bench.StepBudget.START_GUESS_S
    b.took("phases", "none", 40.0, (5.0,))  # the run's first start, quicker than any later
    assert b.start_s() == guess  # not seen after the first yet: the guess
    assert b.estimate("phases", "none") == 35.0 + guess
    b.took("phases", "ours", 100.0, (20.0, 12.0))
    assert b.start_s() == 12.0  # the quickest after the first, not the first's 5 s
    assert b.estimate("phases", "vtier-fs") == 68.0 + 2 * 12.0
    assert b.estimate("phases", "cpu") == 35.0 + 12.0
    b.took("throughput", "cpu", 30.0, (11.0,))
    assert b.start_s() == 11.0 and b.estimate("throughput", "ours") == 19.0 + 11.0


def test_starts_longer_than_the_step_zero_starts_and_no_starts():
    from benchmarks import gpu_bench

    b, _ = _budget()
    guess = gpu_bench.StepBudget.START_GUESS_S
    b.took("phases", "none", 10.0, (50.0,))  # a clock oddity: the start outlasted the step
    assert b.longest[("phases", False)] == 0.0  # no negative work
    assert b.estimate("phases", "none") == guess
    b.took("phases", "none", 20.0, ())  # none given: all of it is work, no start counted
    assert b.starts_seen == 1 and b.estimate("phases", "none") == 20.0 + guess
    b.took("phases", "ours", 30.0, (0.0, 0.0))  # instant starts (a mocked engine)
    assert b.start_s() == 0.0 and b.estimate("phases", "ours") == 30.0
    assert b.estimate("throughput", "ours") == 0.0  # nothing of its kind or the other: starts


def test_a_huge_first_start_does_not_keep_later_steps_out():
    b, clock = _budget(budget_s=400.0)
    b.took("phases", "none", 1e6 + 60.0, (1e6,))  # a first engine that took forever to start
    clock[0] = 100.0
    b.took("phases", "ours", 130.0, (9.0, 8.0))
    clock[0] = 230.0
    assert b.estimate("phases", "vtier-fs") == 113.0 + 2 * 8.0
    assert b.fits("phases", "vtier-fs")  # 230 + 129 <= 400
    assert b.fits("phases", "none")  # 60 s of work and a start of 8 s


def test_no_budget_always_fits_whatever_was_seen():
    b, clock = _budget(budget_s=0.0, now=1e12)
    b.took("phases", "ours", 1e9, (1e8, 1e8))
    assert b.fits("phases", "ours") and b.fits("throughput", "cpu")


@pytest.mark.parametrize("phase", ["throughput", "prefill-sweep"])
@pytest.mark.parametrize("opt", ["--cprofile-phases", "--thread-cpu-phases"])
def test_an_option_for_a_phase_whose_requests_it_never_sees_is_refused(monkeypatch, capsys,
                                                                      opt, phase):
    """Only the phases recorded request by request (cold, gpu, cpu, recompute, disk, restart)
    are profiled or have their threads' CPU read; the throughput run and the prefill sweep never
    are. Naming one of them is refused like a typo, not a run without what it was for."""
    import sys

    from benchmarks import gpu_bench

    # the sweep runs alone (its own --profile profiles it)
    phases, asked = ((phase, phase) if phase == "prefill-sweep"
                     else (f"cold,disk,{phase}", f"disk,{phase}"))
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", phases, opt, asked])
    with pytest.raises(SystemExit):
        gpu_bench.parse()
    err = capsys.readouterr().err
    assert opt in err and phase in err


@pytest.mark.parametrize("value,want", [
    ("", []), (",", []), ("disk,,disk", ["disk", "disk"]), ("restart", ["restart"])])
def test_empty_and_repeated_phase_lists_parse(monkeypatch, value, want):
    import sys

    from benchmarks import gpu_bench

    for opt, attr in (("--cprofile-phases", "cprofile_phases"),
                      ("--thread-cpu-phases", "thread_cpu_phases")):
        monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "cold,disk,restart", opt,
                                          value])
        assert getattr(gpu_bench.parse(), attr) == want


@pytest.mark.parametrize("value", [" disk", "DISK", "disk ", "cold;disk"])
def test_odd_spellings_of_a_phase_are_refused(monkeypatch, capsys, value):
    import sys

    from benchmarks import gpu_bench

    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "cold,disk",
                                      "--thread-cpu-phases", value])
    with pytest.raises(SystemExit):
        gpu_bench.parse()
    assert "--thread-cpu-phases" in capsys.readouterr().err


@pytest.mark.parametrize("interval", [0.0, 3600.0], ids=["zero", "huge"])
def test_with_the_advisor_calibration_reads_racing_lookups_stall_no_request(tmp_path,
                                                                            monkeypatch,
                                                                            interval):
    """The promotion advisor on (an engine so slow that every disk run pays to load; each run
    surveyed one scan, then loaded): lookups apply finished reads or not; every request still
    becomes all-HIT and is served its bytes."""
    from tiering.advisor import PromotionAdvisor

    monkeypatch.setattr(chain_module, "LOOKUP_POLL_INTERVAL_S", interval)
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)
    adv.observe_read_batch(1, 1 << 30, 1.0)  # measured: 1 GB/s, so every run pays to load
    region = StagingRegion("adv", 16, ROW)
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": 64 * ROW, "io": "posix",
                     "policy": "lru", "store_threshold": 0, "io_threads": 4}, facts(ROW))
    c = TierChain(CpuTier(region, "lru", 0), [tier], advisor=adv)
    reqs = {f"q{j}": [key(f"q{j}-{i}") for i in range(4)] for j in range(3)}
    every = [k for ks in reqs.values() for k in ks]
    data = store_all(c, every)
    push_out(c, every)
    try:
        # one after another: while a load is measured the advisor recomputes the others' runs
        # (load_unmeasured), which is its design, not a stall
        for r, ks in reqs.items():
            assert drive(c, {r: ks}, data, reasks=2) == {r: ks}
        assert tier.stats["promotions"] == len(every)
    finally:
        c.close()
