"""CopyFeeder (backends/copy_feeder.py) over a stand-in copy engine: at most ``limit`` bytes of
loads enqueued at once, in submission order, a job over the limit alone, failures listed (never
raised), ``wait_fed`` and ``close`` that return; and the vLLM worker turning a copier's late
failure (``Finished.ok`` False) into load errors or failed-store marks."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from tiering.backends.block_copy import CopyFailed, Finished
from tiering.backends.copy_feeder import CopyFeeder, FeedJob


class Engine:
    """A copy engine the test drives: an end event completes when the test says so, or at once
    where ``instant`` (an engine always ahead of the feeder: a feeder starved of the GIL)."""

    def __init__(self) -> None:
        self.ends: list[Event] = []
        self.enqueued: list[int] = []  # job ids, in the order their copies were enqueued
        self.lanes: dict[int, int] = {}  # job id: the load stream (its lane number) it went on
        self.lock = threading.Lock()
        self.instant = False

    def finish(self, n: int, lane: int | None = None) -> None:
        """Complete the first n end events not yet complete (of one lane's stream: the others
        keep theirs, as two streams' copies do)."""
        with self.lock:
            for ev in [e for e in self.ends if not e.done.is_set()
                       and (lane is None or e.lane == lane)][:n]:
                ev.done.set()

    def busy(self, lane: int) -> int:
        """Jobs on that lane's stream not yet done."""
        with self.lock:
            return sum(1 for e in self.ends if e.lane == lane and not e.done.is_set())


ENGINE: Engine


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.done = threading.Event()
        self.blocking = blocking  # the feeder's end events (a job's start completes at once)
        self.lane = -1

    def record(self, stream: object = None) -> None:
        if self.blocking and getattr(stream, "is_load_stream", False):
            self.lane = stream.lane  # type: ignore[attr-defined]
            with ENGINE.lock:
                ENGINE.ends.append(self)
                if ENGINE.instant:
                    self.done.set()
        else:
            self.done.set()  # an event on the compute stream: nothing ahead of it here

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(10), "an end event never completed"

    def elapsed_time(self, other: Event) -> float:
        return 1.0


class Stream:
    is_load_stream = True

    def __init__(self, lane: int = 0) -> None:
        self.lane = lane
        self.cuda_stream = 0x99 + lane  # the copy call's handle: tells the lanes apart

    def wait_event(self, ev: Event) -> None:
        pass

    def synchronize(self) -> None:
        ENGINE.finish(len(ENGINE.ends), self.lane)


def fake_torch() -> types.SimpleNamespace:
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event,
                                                            set_device=lambda d: None))


@pytest.fixture
def engine():
    global ENGINE
    ENGINE = Engine()
    yield ENGINE
    ENGINE.finish(10_000)


def make(limit: int, fail: set[int] = frozenset(), grow_to: int = 0,
         gate: threading.Event | None = None, direct: bool = False,
         threads: dict | None = None, waves: bool = False,
         lanes: int = 1) -> tuple[CopyFeeder, list, dict]:
    """``gate``: the first copy waits for it (the test puts its jobs meanwhile, so that every
    job but the first was queued before the feeder took the one ahead of it). ``lanes`` > 1:
    waves over that many load streams (``wave_streams``)."""
    started: list = []
    copied: dict[int, bytes] = {}

    def copy(job_id, src, dst, size, stream):
        if gate is not None:
            assert gate.wait(10), "the test never opened the gate"
        if threads is not None:
            threads[job_id] = threading.current_thread().name
        if job_id in fail:
            raise CopyFailed(f"job {job_id}: injected")
        ENGINE.enqueued.append(job_id)
        ENGINE.lanes[job_id] = stream - 0x99
        copied[job_id] = bytes(src.astype(np.uint8))

    def on_started(job_id, nbytes, start, end):
        started.append((job_id, nbytes, end))

    streams = [Stream(k) for k in range(lanes)]
    return (CopyFeeder(fake_torch(), "cuda:0", streams[0], limit, copy, on_started,
                       grow_to=grow_to, direct=direct, waves=waves,
                       wave_streams=streams if lanes > 1 else ()), started, copied)


def job(i: int, nbytes: int) -> FeedJob:
    a = np.arange(i, i + 4, dtype=np.uint64)
    return FeedJob(i, a, a, np.full(4, nbytes // 4, dtype=np.uint64), nbytes, Event())


def until(cond, what: str, timeout: float = 5.0) -> None:
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, what
        time.sleep(0.002)


def test_no_more_than_the_limit_is_enqueued_and_order_is_kept(engine):
    """Five 40-byte jobs under a 100-byte limit: two are enqueued, the third only once the
    first has finished, and so on; every job in submission order, each handed over once."""
    feeder, started, copied = make(100)
    for i in range(1, 6):
        feeder.put(job(i, 40))
    until(lambda: engine.enqueued == [1, 2], "the first two are enqueued")
    time.sleep(0.05)
    assert engine.enqueued == [1, 2] and feeder.pending() == 3  # no room for a third
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2, 3], "the third follows the first's end")
    time.sleep(0.03)
    assert engine.enqueued == [1, 2, 3]
    engine.finish(3)
    until(lambda: engine.enqueued == [1, 2, 3, 4, 5], "the rest follow")
    assert [s[0] for s in started] == [1, 2, 3, 4, 5] and sorted(copied) == [1, 2, 3, 4, 5]
    assert feeder.waits >= 2
    feeder.close()


@pytest.mark.parametrize("waves", [False, True])
def test_a_job_over_the_limit_goes_alone(engine, waves):
    """In waves too, where it is a wave of its own (three waves)."""
    feeder, started, _ = make(100, waves=waves)
    feeder.put(job(1, 40))
    feeder.put(job(2, 400))
    feeder.put(job(3, 40))
    until(lambda: engine.enqueued == [1], "the first")
    time.sleep(0.03)
    assert engine.enqueued == [1]  # the large job waits for room, not for nothing
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2], "the large one, alone")
    time.sleep(0.03)
    assert engine.enqueued == [1, 2]
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2, 3], "then the last")
    assert feeder.waves_started == (3 if waves else 0)
    feeder.close()


def test_a_failed_job_is_listed_once_and_the_next_is_fed(engine):
    feeder, started, _ = make(100, fail={2})
    for i in (1, 2, 3):
        feeder.put(job(i, 10))
    feeder.wait_fed({1, 2, 3})
    assert engine.enqueued == [1, 3] and [s[0] for s in started] == [1, 3]
    assert feeder.take_failed() == [2] and feeder.take_failed() == []
    feeder.close()


def _bounded(fn, *args) -> None:
    """Run fn in a thread; fail (never hang) if it has not returned within 10 s."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{fn.__name__} did not return"


def test_wait_fed_returns_once_the_job_left_the_queue_and_close_drains(engine):
    feeder, started, _ = make(50)
    for i in range(1, 4):
        feeder.put(job(i, 50))
    until(lambda: engine.enqueued == [1], "the first")
    stop = threading.Event()

    def pump() -> None:  # the copy engine finishing whatever is enqueued, every 5 ms
        while not stop.wait(0.005):
            engine.finish(1)

    threading.Thread(target=pump, daemon=True).start()
    _bounded(feeder.wait_fed, {3})  # needs both earlier jobs' ends
    assert engine.enqueued == [1, 2, 3]
    feeder.put(job(4, 50))
    _bounded(feeder.close)
    stop.set()
    assert engine.enqueued == [1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        feeder.put(job(5, 1))


def test_a_queue_that_ran_dry_while_loads_waited_doubles_up_to_its_ceiling(engine):
    """Each time the feeder finds every enqueued load done while loads waited behind the last
    one (the copy engine idled: on the H100 the feeder waited up to 34 ms for the GIL), the
    limit doubles, up to ``grow_to``; the order and the handing over stay as they were."""
    engine.instant = True
    gate = threading.Event()
    feeder, started, _ = make(100, grow_to=400, gate=gate)
    for i in range(1, 9):
        feeder.put(job(i, 50))
    gate.set()
    feeder.wait_fed(set(range(1, 9)))
    assert engine.enqueued == list(range(1, 9)) and [s[0] for s in started] == engine.enqueued
    assert feeder.limit == 400 and feeder.ran_dry == 7
    feeder.close()


def test_without_a_ceiling_or_with_loads_in_flight_the_limit_stays(engine):
    engine.instant = True
    gate = threading.Event()
    feeder, _, _ = make(100, gate=gate)  # grow_to 0: a fixed limit
    for i in range(1, 6):
        feeder.put(job(i, 50))
    gate.set()
    feeder.wait_fed(set(range(1, 6)))
    assert feeder.limit == 100 and feeder.ran_dry == 4
    feeder.close()
    engine.instant = False
    feeder, _, _ = make(100, grow_to=400)  # the engine works only as the test says
    for i in range(1, 6):
        feeder.put(job(i, 50))
    until(lambda: engine.enqueued[-2:] == [1, 2], "the first two")
    for n in range(3, 6):  # one end at a time: the queue never runs dry
        engine.finish(1)
        until(lambda n=n: engine.enqueued[-1] == n, f"job {n} follows")
    assert feeder.limit == 100 and feeder.ran_dry == 0
    feeder.close()


def test_a_new_burst_after_an_idle_feeder_is_not_a_queue_run_dry(engine):
    """Loads that finish while no other load waits (the burst ended) leave the feeder idle, not
    late: the next burst does not grow the limit."""
    engine.instant = True
    feeder, _, _ = make(100, grow_to=400)
    feeder.put(job(1, 50))
    feeder.wait_fed({1})
    time.sleep(0.02)
    feeder.put(job(2, 50))
    feeder.wait_fed({2})
    assert feeder.limit == 100 and feeder.ran_dry == 0
    feeder.close()


# -- waves: room only from an empty queue -------------------------------------------------------


def test_waves_nothing_more_is_enqueued_until_the_whole_wave_is_done(engine):
    """With ``waves``, five 40-byte jobs under a 100-byte limit: the first two make a wave; the
    third does not fit and closes it, so the first job's end lets nothing in (a sliding queue
    would take the third then: the copy engine would never be free of loads); once both are
    done the next wave takes the third and fourth. Order and handing over as without waves."""
    feeder, started, copied = make(100, waves=True)
    for i in range(1, 6):
        feeder.put(job(i, 40))
    until(lambda: engine.enqueued == [1, 2], "the first wave")
    engine.finish(1)
    time.sleep(0.05)
    assert engine.enqueued == [1, 2] and feeder.pending() == 3, "the wave is closed"
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2, 3, 4], "the second wave, once the queue is empty")
    time.sleep(0.03)
    assert engine.enqueued == [1, 2, 3, 4]
    engine.finish(2)
    until(lambda: engine.enqueued == [1, 2, 3, 4, 5], "the third")
    engine.finish(1)
    feeder.wait_fed({5})
    assert [s[0] for s in started] == [1, 2, 3, 4, 5] and sorted(copied) == [1, 2, 3, 4, 5]
    assert feeder.waves_started == 3 and feeder.ran_dry == 0 and feeder.limit == 100
    feeder.close()


def test_waves_count_the_bytes_enqueued_since_the_queue_was_empty_not_those_in_flight(engine):
    """A wave holds at most ``limit`` bytes in all: jobs that trickle in one by one while it
    runs join it only while it has room, even where the bytes still in flight would leave
    room (40 in flight of a 100-byte limit, but 80 enqueued in the wave: a third 40 waits)."""
    feeder, _, _ = make(100, direct=True, waves=True)
    feeder.put(job(1, 40))
    feeder.put(job(2, 40))
    assert engine.enqueued == [1, 2]
    engine.finish(1)  # 40 bytes in flight, 80 enqueued in this wave
    feeder.put(job(3, 40))
    time.sleep(0.05)
    assert engine.enqueued == [1, 2] and feeder.pending() == 1
    feeder.put(job(4, 10))  # would fit the wave, but a job waits before it: it keeps its place
    time.sleep(0.03)
    assert engine.enqueued == [1, 2]
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2, 3, 4], "the next wave, in order")
    assert feeder.waves_started == 2
    engine.finish(2)
    feeder.close()


def test_waves_a_wave_drained_while_the_feeder_waited_is_not_a_late_feeder(engine):
    """The feeder waits for a wave's last job on purpose: a queue emptied that way does not
    grow the limit. Coming back to a wave already done while loads waited does (the copy engine
    idled for as long as the feeder was late), up to ``grow_to``, as without waves."""
    feeder, _, _ = make(100, grow_to=400, waves=True)
    for i in range(1, 7):
        feeder.put(job(i, 50))
    for k in range(3):
        until(lambda k=k: len(engine.enqueued) == 2 * (k + 1), f"wave {k + 1}")
        time.sleep(0.02)  # the feeder is in its wait for the wave's end
        engine.finish(2)
    feeder.wait_fed(set(range(1, 7)))
    assert feeder.limit == 100 and feeder.ran_dry == 0 and feeder.waves_started == 3
    feeder.close()
    engine.instant = True  # every job done before the feeder comes back: late each time
    gate = threading.Event()
    feeder, started, _ = make(100, grow_to=400, gate=gate, waves=True)
    for i in range(11, 19):
        feeder.put(job(i, 50))
    gate.set()
    feeder.wait_fed(set(range(11, 19)))
    assert [s[0] for s in started] == list(range(11, 19))
    assert feeder.limit == 400 and feeder.ran_dry == 7
    feeder.close()


def test_waves_a_failed_job_starts_the_next_wave_from_an_empty_queue(engine):
    """A job whose copies failed drains the stream: the job after it opens a new wave."""
    feeder, _, _ = make(100, fail={2}, waves=True)
    for i in range(1, 5):
        feeder.put(job(i, 40))
    failed: list[int] = []
    until(lambda: failed.extend(feeder.take_failed()) or failed == [2], "job 2 is listed")
    until(lambda: engine.enqueued == [1, 3, 4], "the rest go on")
    engine.finish(10)
    feeder.wait_fed({1, 2, 3, 4})
    assert engine.enqueued == [1, 3, 4] and feeder.waves_started == 2
    feeder.close()


# -- waves over two load streams (lanes): one wave a lane, a new one only on an empty lane -------


def lanes_of(engine: Engine, ids: list[int]) -> list[int]:
    return [engine.lanes[i] for i in ids]


@pytest.mark.parametrize("direct", [False, True])
def test_lanes_waves_alternate_and_a_new_wave_begins_only_on_an_empty_lane(engine, direct):
    """Two lanes, a 100-byte limit, on both paths (put's caller or the feeder thread). Job 1
    (60 B) opens a wave on lane 0; job 2 (60 B) does not fit it: a new wave on lane 1, which
    is empty (lane 0's wave closes); job 3 (30 B) joins lane 1's open wave. Job 4 (30 B) would
    fit lane 0's closed wave by its bytes (90) but never joins it, nor the full open one: no lane
    is empty, so it waits, and job 5 behind it. Lane 0 empties: jobs 4 and 5 open a wave there;
    job 6 (70 B) then waits for lane 1, never a third wave in flight; job 7 (250 B, over the
    limit) and job 8 (0 B) each get a wave of their own, lanes in turn."""
    threads: dict[int, str] = {}
    feeder, started, _ = make(100, direct=direct, waves=True, lanes=2, threads=threads)
    for i, n in ((1, 60), (2, 60), (3, 30), (4, 30), (5, 10)):
        feeder.put(job(i, n))
    until(lambda: engine.enqueued == [1, 2, 3], "the first two waves")
    time.sleep(0.05)
    assert engine.enqueued == [1, 2, 3] and feeder.pending() == 2, "job 4 joined a closed wave"
    assert lanes_of(engine, [1, 2, 3]) == [0, 1, 1] and feeder.waves_started == 2
    if direct:
        assert [threads[i] for i in (1, 2, 3)] == [threading.current_thread().name] * 3
    engine.finish(1, lane=0)
    until(lambda: engine.enqueued == [1, 2, 3, 4, 5], "a new wave on the emptied lane 0")
    assert lanes_of(engine, [4, 5]) == [0, 0] and feeder.waves_started == 3
    feeder.put(job(6, 70))  # fits neither open wave (40 + 70): both lanes busy
    time.sleep(0.05)
    assert engine.enqueued[-1] == 5 and feeder.pending() == 1, "a third wave in flight"
    engine.finish(2, lane=1)
    until(lambda: engine.enqueued[-1] == 6, "job 6 once lane 1 is empty")
    assert engine.lanes[6] == 1 and feeder.waves_started == 4
    feeder.put(job(7, 250))
    feeder.put(job(8, 0))
    time.sleep(0.05)
    assert engine.enqueued[-1] == 6
    engine.finish(2, lane=0)
    until(lambda: engine.enqueued[-1] == 7, "the large job, alone on lane 0")
    time.sleep(0.05)
    assert engine.enqueued[-1] == 7, "a 0-byte job joined a wave over the limit"
    engine.finish(1, lane=1)
    until(lambda: engine.enqueued[-1] == 8, "the 0-byte job on lane 1")
    assert lanes_of(engine, [7, 8]) == [0, 1] and feeder.waves_started == 6
    assert [s[0] for s in started] == list(range(1, 9)) and feeder.ran_dry == 0
    engine.finish(10)
    feeder.close()


@pytest.mark.parametrize("broken", [False, True])
def test_lanes_a_failed_job_drains_both_lanes_and_the_next_begins_a_fresh_wave(engine, broken):
    """Job 1 (60 B) on lane 0, job 2 (60 B) on lane 1, job 3's copy (joining lane 1) fails: both
    streams are synchronized before it is listed (each had a job still copying); ``broken``: both
    synchronizes raise, and nothing is counted in flight on either stream all the same. Job 4
    (30 B) opens a fresh wave, counting 30 B only: job 5 (70 B) joins it; job 6 (60 B) begins a
    wave on the other lane at once."""
    drained: dict[int, int] = {}

    class Watched(Stream):
        def synchronize(self) -> None:
            drained[self.lane] = engine.busy(self.lane)
            if broken:
                raise RuntimeError("CUDA error: injected, the stream is broken")
            super().synchronize()

    streams = [Watched(0), Watched(1)]
    started: list[int] = []

    def copy(job_id, src, dst, size, stream):
        if job_id == 3:
            raise CopyFailed("job 3: injected")
        engine.enqueued.append(job_id)
        engine.lanes[job_id] = stream - 0x99

    feeder = CopyFeeder(fake_torch(), "cuda:0", streams[0], 100, copy,
                        lambda j, n, s, e: started.append(j), waves=True, wave_streams=streams)
    for i, n in ((1, 60), (2, 60), (3, 30)):
        feeder.put(job(i, n))
    feeder.wait_fed({3})
    assert feeder.take_failed() == [3] and drained == {0: 1, 1: 1}
    assert engine.busy(0) == engine.busy(1) == (1 if broken else 0)
    for i, n in ((4, 30), (5, 70), (6, 60)):
        feeder.put(job(i, n))
    until(lambda: engine.enqueued == [1, 2, 4, 5, 6], "a fresh wave, then one on the other lane")
    assert lanes_of(engine, [4, 5, 6]) == [0, 0, 1] and feeder.waves_started == 4
    engine.finish(10)
    feeder.close()


def test_lanes_growth_counts_a_return_to_every_lane_empty_while_loads_waited(engine):
    """Waiting for lane 0's (closed) wave while lane 1's open wave copies: back to lane 1 still
    copying, the engine did not idle: no growth. Back to both lanes done, the open wave ended
    too while the feeder was away: the limit doubles, at the new wave's start."""
    feeder, _, _ = make(100, grow_to=400, waves=True, lanes=2)
    for i in (1, 2, 3):
        feeder.put(job(i, 60))
    until(lambda: engine.enqueued == [1, 2] and feeder.waits == 1, "the feeder waits for lane 0")
    engine.finish(1, lane=0)
    until(lambda: engine.enqueued == [1, 2, 3], "job 3 on lane 0")
    assert engine.lanes[3] == 0 and feeder.ran_dry == 0 and feeder.limit == 100
    feeder.put(job(4, 60))  # fits neither wave: waits for lane 1 (the oldest)
    until(lambda: feeder.waits == 2, "the feeder waits for lane 1")
    engine.finish(2)  # lane 1's job 2, then lane 0's job 3, at once: the feeder is late
    until(lambda: engine.enqueued[-1] == 4, "job 4")
    assert feeder.ran_dry == 1 and feeder.limit == 200
    feeder.put(job(5, 60))  # the grown limit: 120 B in job 4's wave
    until(lambda: engine.enqueued[-1] == 5, "job 5 joins job 4's wave")
    assert engine.lanes[5] == engine.lanes[4] and feeder.waves_started == 4
    engine.finish(10)
    feeder.close()
    engine.instant = True  # every job done before the feeder comes back: late each time
    gate = threading.Event()
    feeder, started, _ = make(100, grow_to=400, gate=gate, waves=True, lanes=2)
    for i in range(11, 19):
        feeder.put(job(i, 50))
    gate.set()
    feeder.wait_fed(set(range(11, 19)))
    assert [s[0] for s in started] == list(range(11, 19))
    assert lanes_of(engine, list(range(11, 19))) == [0, 1] * 4, "waves alternate lanes"
    assert feeder.limit == 400 and feeder.ran_dry == 7
    feeder.close()


def test_lanes_need_waves_and_one_lane_is_the_plain_feeder():
    with pytest.raises(ValueError, match="wave_streams"):
        CopyFeeder(fake_torch(), "cuda:0", Stream(), 100, lambda *a: None, lambda *a: None,
                   wave_streams=[Stream(0), Stream(1)])


@pytest.mark.parametrize("direct", [False, True])
def test_lanes_of_one_stream_given_as_wave_streams_are_the_plain_waves(engine, direct):
    """``wave_streams`` of one stream: the rule of ``waves`` (the wave of job 1 and 2 closed
    until both are done)."""
    s = Stream(0)
    started: list[int] = []

    def copy(job_id, src, dst, size, stream):
        engine.enqueued.append(job_id)

    feeder = CopyFeeder(fake_torch(), "cuda:0", None, 100, copy,
                        lambda j, n, st, e: started.append(j), waves=True, direct=direct,
                        wave_streams=[s])
    assert feeder.stream is s
    for i in range(1, 4):
        feeder.put(job(i, 40))
    until(lambda: engine.enqueued == [1, 2], "the first wave")
    engine.finish(1)
    time.sleep(0.03)
    assert engine.enqueued == [1, 2]
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2, 3], "the next wave once the lane is empty")
    engine.finish(1)
    feeder.close()


# -- direct: a job with room and none waiting is enqueued by put's caller ----------------------


def test_direct_a_job_with_room_is_enqueued_by_the_caller_before_put_returns(engine):
    """With ``direct``, a job that finds the queue with room and no job waiting is enqueued on
    the caller's thread and handed to the copier before ``put`` returns (no hop to the feeder
    thread: on a GPU each take of the GIL there waited for vLLM's busy engine loop); the
    others wait for the thread, in submission order, and the limit still holds."""
    threads: dict[int, str] = {}
    feeder, started, _ = make(100, direct=True, threads=threads)
    me = threading.current_thread().name
    feeder.put(job(1, 40))
    assert engine.enqueued == [1] and [s[0] for s in started] == [1] and threads[1] == me
    feeder.put(job(2, 40))
    assert engine.enqueued == [1, 2] and threads[2] == me
    feeder.put(job(3, 40))  # no room: the feeder thread takes it once the first job ends
    feeder.put(job(4, 10))  # room, but a job waits before it: it keeps its place
    time.sleep(0.03)
    assert engine.enqueued == [1, 2] and feeder.pending() == 2
    engine.finish(1)
    until(lambda: engine.enqueued == [1, 2, 3, 4], "3 and 4 follow, in order")
    assert threads[3] == threads[4] == "tier-feed-load"
    assert [s[0] for s in started] == [1, 2, 3, 4] and feeder.enqueued_direct == 2
    engine.finish(3)
    feeder.put(job(5, 400))  # over the limit, the queue empty: alone, and at once
    assert engine.enqueued[-1] == 5 and threads[5] == me and feeder.enqueued_direct == 3
    feeder.put(job(6, 10))  # behind the large one still copying: the thread's, after it ends
    time.sleep(0.03)
    assert engine.enqueued[-1] == 5
    engine.finish(1)
    until(lambda: engine.enqueued[-1] == 6, "the small job after the large one")
    feeder.close()


def test_direct_a_failed_enqueue_is_listed_after_the_stream_drained_and_never_raises(engine):
    """A direct job whose copy call fails: ``put`` returns as usual; the feeder thread waits
    until nothing of it is in flight (the load stream drained) and lists it once; the next
    job goes on."""
    drained: list[int] = []

    class Watched(Stream):
        def synchronize(self) -> None:
            drained.append(len([e for e in ENGINE.ends if not e.done.is_set()]))
            super().synchronize()

    feeder, started, _ = make(100, fail={2}, direct=True)
    feeder.stream = Watched()
    feeder.put(job(1, 10))
    feeder.put(job(2, 10))  # raises inside the caller's enqueue: not out of put
    feeder.wait_fed({2})
    assert feeder.take_failed() == [2] and feeder.take_failed() == []
    assert drained == [1]  # job 1 was still copying: the stream was waited for first
    feeder.put(job(3, 10))
    assert engine.enqueued == [1, 3] and [s[0] for s in started] == [1, 3]
    feeder.close()


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit"):
        CopyFeeder(fake_torch(), "cuda:0", Stream(), 0, lambda *a: None, lambda *a: None)


# -- the worker: a late failure from the copier ------------------------------------------------


class _LateFailingCopier:
    """Accepts every job; reports the ones in ``fail`` as not enqueued (``ok`` False), as the
    CUDA copier's feeder does."""

    def __init__(self, fail: set[int]) -> None:
        self.fail, self.jobs = fail, []

    def submit_job(self, job_id, *args, **kwargs) -> None:
        self.jobs.append(job_id)

    def get_finished(self):
        done = [Finished(j, 0 if j in self.fail else 8, 0.0, ok=j not in self.fail)
                for j in self.jobs]
        self.jobs = []
        return done

    def wait(self, job_ids) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_the_worker_turns_a_late_failure_into_load_errors_or_failed_store_marks(
        tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import tiering.backends.staging as staging
    from tiering.backends.staging import StagingRegion
    from tiering.vllm.compat import GPULoadStoreSpec
    from tiering.vllm.worker import RowsSpec, TieredWorker

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")
    region = StagingRegion("late", 8, 4096)
    w = TieredWorker(None, _LateFailingCopier({2, 3}), region,  # type: ignore[arg-type]
                     load_errors_reported=True)
    assert w.submit_store(1, GPULoadStoreSpec([5], [1], [0]), RowsSpec([0]))
    assert w.submit_load(2, RowsSpec([1, 2]), GPULoadStoreSpec([20, 21], [2], [0]))
    assert w.submit_store(3, GPULoadStoreSpec([6], [1], [0]), RowsSpec([4]))
    done = w.get_finished()
    assert sorted(r.job_id for r in done) == [1, 2, 3] and all(r.success for r in done)
    assert w.take_load_error_blocks() == {20, 21} and w.failed_loads == 1
    assert w.failed_stores == 1 and region.take_store_failed(4)
    assert not region.take_store_failed(0)
    plain = TieredWorker(None, _LateFailingCopier({7}), region)  # type: ignore[arg-type]
    assert plain.submit_load(7, RowsSpec([1]), GPULoadStoreSpec([9], [1], [0]))
    with pytest.raises(CopyFailed):
        plain.get_finished()
    region.close()
