"""Hostile tests of CopyFeeder's growing limit (backends/copy_feeder.py, ``grow_to``/``ran_dry``).

A stand-in copy engine of its own (modelled on tests/test_copy_feeder.py, but one engine per
test, no module global): an in-order engine whose end events complete when the test, a pump
thread, or the feeder's own wait (``finish_on_sync``: a feeder that is never late) says so, or at
once (``instant``: a feeder always behind the engine). Failures can be injected in the copy call,
the stream wait, an end event's query or synchronize, and the stream's synchronize. Every wait on
the feeder is bounded: a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import types

import numpy as np
import pytest

from tiering.backends.block_copy import CopyFailed
from tiering.backends.copy_feeder import CopyFeeder, FeedJob

WAIT_S = 5.0


class InOrderEngine:
    """What every stand-in copy engine of the feeder's tests shares: work items (each with a
    ``done`` threading.Event) completed in order, by the test or by pump threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._pumps: list[threading.Event] = []

    def work(self) -> list:
        """The engine's work items in enqueue order (under ``lock``)."""
        raise NotImplementedError

    def finish(self, n: int) -> None:
        """Complete the first n items not yet complete."""
        with self.lock:
            for item in [w for w in self.work() if not w.done.is_set()][:n]:
                item.done.set()

    def finish_all(self) -> None:
        self.finish(1 << 30)

    def pump(self, step, period: float = 0.0005) -> threading.Event:
        """Run ``step(self)`` every ``period`` seconds in a thread until the returned event."""
        stop = threading.Event()
        self._pumps.append(stop)

        def loop() -> None:
            while not stop.wait(period):
                step(self)

        threading.Thread(target=loop, daemon=True).start()
        return stop

    def stop_pumps(self) -> None:
        for s in self._pumps:
            s.set()


class Engine(InOrderEngine):
    def __init__(self) -> None:
        super().__init__()
        self.ends: list[Event] = []  # end events in record (= engine) order
        self.enqueued: list[int] = []  # job ids whose copies were enqueued, in order
        self.instant = False  # an end event completes as it is recorded
        self.finish_on_sync = False  # the engine finishes a load the moment the feeder waits
        self.late_after: set[int] = set()  # after these jobs, the engine drains everything
        self.query_raises: set[int] = set()  # job ids whose end event's query raises
        self.sync_raises: set[int] = set()  # job ids whose end event's synchronize raises
        self.stream_broken = False  # Stream.synchronize raises
        self.gate = threading.Event()  # the copy call waits on it (a burst put in one piece)
        self.gate.set()
        self.feeders: list[CopyFeeder] = []

    def work(self) -> list:
        return self.ends

    def unfinished(self) -> list[Event]:
        with self.lock:
            return [e for e in self.ends if not e.done.is_set()]

    def finish_through(self, ev: Event) -> None:
        with self.lock:  # in order: an end event completes after every one before it
            for e in self.ends:
                e.done.set()
                if e is ev:
                    break


class Event:
    def __init__(self, engine: Engine, enable_timing: bool = False, blocking: bool = False,
                 fail_wait: bool = False) -> None:
        self.engine, self.blocking, self.fail_wait = engine, blocking, fail_wait
        self.done = threading.Event()
        self.job_id: int | None = None  # set when the feeder hands the job over

    def record(self, stream: object = None) -> None:
        if self.blocking and isinstance(stream, Stream):
            with self.engine.lock:
                self.engine.ends.append(self)
                if self.engine.instant:
                    self.done.set()
        else:
            self.done.set()

    def query(self) -> bool:
        if self.job_id is not None and self.job_id in self.engine.query_raises:
            raise RuntimeError(f"CUDA error: injected in query of job {self.job_id}'s end")
        return self.done.is_set()

    def synchronize(self) -> None:
        if self.job_id is not None and self.job_id in self.engine.sync_raises:
            raise RuntimeError(f"CUDA error: injected in synchronize of job {self.job_id}'s end")
        if self.engine.finish_on_sync:
            self.engine.finish_through(self)
        if not self.done.wait(WAIT_S):
            raise AssertionError(f"job {self.job_id}'s end event never completed")

    def elapsed_time(self, other: Event) -> float:
        return 1.0


class Stream:
    cuda_stream = 0x99

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def wait_event(self, ev: object) -> None:
        if getattr(ev, "fail_wait", False):
            raise RuntimeError("CUDA error: injected in wait_event")

    def synchronize(self) -> None:
        if self.engine.stream_broken:
            raise RuntimeError("CUDA error: the load stream is broken")
        self.engine.finish_all()


class Harness:
    """A feeder over ``engine``, recording what the copy and started callbacks saw."""

    def __init__(self, engine: Engine, limit: int, grow_to: int = 0,
                 fail: dict[int, Exception] | None = None, direct: bool = False) -> None:
        self.engine = engine
        self.fail = dict(fail or {})
        self.sizes: dict[int, int] = {}
        self.started: list[tuple[int, int, Event]] = []
        self.limits: list[int] = []  # feeder.limit when each job's copies were enqueued
        self.violations: list[str] = []  # enqueues that broke "limit, or alone"
        self.copy_calls: list[int] = []
        self.copy_threads: dict[int, str] = {}  # job id: the thread that made its copy call
        torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Event=lambda enable_timing=False, blocking=False: Event(engine, enable_timing,
                                                                    blocking),
            set_device=lambda d: None))
        self.feeder = CopyFeeder(torch, "cuda:0", Stream(engine), limit, self._copy,
                                 self._on_started, grow_to=grow_to, direct=direct)
        engine.feeders.append(self.feeder)

    def job(self, i: int, nbytes: int, fail_wait: bool = False) -> FeedJob:
        self.sizes[i] = nbytes
        a = np.arange(4, dtype=np.uint64)
        return FeedJob(i, a, a, np.full(4, max(nbytes // 4, 1), dtype=np.uint64), nbytes,
                       Event(self.engine, fail_wait=fail_wait))

    def _unfinished_bytes(self) -> int:
        return sum(n for _, n, end in self.started if not end.done.is_set())

    def _copy(self, job_id, src, dst, size, stream) -> None:
        if not self.engine.gate.wait(WAIT_S):
            raise AssertionError("the test never opened the gate")
        self.copy_calls.append(job_id)
        self.copy_threads[job_id] = threading.current_thread().name
        exc = self.fail.get(job_id)
        if exc is not None:
            raise exc
        ahead, nbytes, limit = self._unfinished_bytes(), self.sizes[job_id], self.feeder.limit
        if ahead and ahead + nbytes > limit:
            self.violations.append(f"job {job_id} ({nbytes} B) enqueued behind {ahead} B "
                                   f"unfinished, limit {limit}")
        self.limits.append(limit)
        self.engine.enqueued.append(job_id)

    def _on_started(self, job_id, nbytes, start, end) -> None:
        end.job_id = job_id
        self.started.append((job_id, nbytes, end))
        if job_id in self.engine.late_after:  # the feeder came back after the engine drained
            self.engine.finish_all()

    def ids(self) -> list[int]:
        return [s[0] for s in self.started]

    def burst(self, jobs: list[FeedJob]) -> None:
        """Put every job while the feeder is held in the first one's copy call: all of them wait
        here together, as a burst of loads does."""
        self.engine.gate.clear()
        try:
            for j in jobs:
                self.feeder.put(j)
        finally:
            self.engine.gate.set()


def bounded(fn, *args, timeout: float = 10.0):
    """Run fn in a thread; fail (never hang) if it has not returned within ``timeout``."""
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = fn(*args)
        except BaseException as exc:  # re-raised below, on the test's thread
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return in {timeout} s"
    if "e" in box:
        raise box["e"]
    return box.get("r")


def until(cond, what: str, timeout: float = WAIT_S) -> None:
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, what
        time.sleep(0.001)


def nondecreasing(xs: list[int]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(xs))


def expected_limits(limit: int, grow_to: int, n: int) -> list[int]:
    """The limit at each of n enqueues when every enqueue after the first follows a run dry."""
    out = [limit]
    for _ in range(n - 1):
        if limit < grow_to:
            limit = min(grow_to, limit * 2)
        out.append(limit)
    return out


@pytest.fixture
def engine():
    eng = Engine()
    yield eng
    eng.stop_pumps()
    eng.gate.set()
    eng.stream_broken = False
    eng.sync_raises.clear()
    eng.query_raises.clear()
    eng.finish_all()
    for f in eng.feeders:
        t = threading.Thread(target=f.close, daemon=True)
        t.start()
        t.join(WAIT_S)


def close(h: Harness) -> None:
    bounded(h.feeder.close)


# -- the ceiling: exact, never passed, never shrinking ----------------------------------------


@pytest.mark.parametrize("limit,grow_to,n", [
    (100, 400, 6),         # powers of two: 100 -> 200 -> 400
    (100, 350, 6),         # 200 doubled past 350: clamped to exactly 350
    (3, 10, 6),            # odd limit, odd ceiling: 3 -> 6 -> 10
    (7, 8, 4),             # one step, clamped to 8, not 14
    (100, 101, 4),         # a ceiling one byte above the limit
    (100, 100, 4),         # equal: fixed
    (100, 50, 4),          # smaller than the limit: fixed, never lowered to the ceiling
    (100, 0, 4),           # 0: fixed
    (100, -1, 4),          # negative: fixed
    (1, 1 << 62, 70),      # huge: 62 doublings, then exactly 1 << 62
    (5, (1 << 40) + 3, 50),  # huge and odd: clamped to exactly it
])
def test_each_run_dry_doubles_and_the_ceiling_is_exact(engine, limit, grow_to, n):
    """An engine always ahead of the feeder (instant) while a whole burst waits: every enqueue
    after the first follows a queue that ran dry. The limit seen at each enqueue is exactly the
    doubling sequence clamped to grow_to; it never passes grow_to (unless it started above it,
    then it stays put) and never shrinks."""
    engine.instant = True
    h = Harness(engine, limit, grow_to=grow_to)
    h.burst([h.job(i, 1) for i in range(1, n + 1)])
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    assert h.ids() == list(range(1, n + 1)) == engine.enqueued
    assert h.limits == expected_limits(limit, grow_to, n)
    assert nondecreasing(h.limits), "the limit shrank"
    assert max(h.limits) <= max(limit, grow_to)
    assert h.feeder.limit == h.limits[-1] and isinstance(h.feeder.limit, int)
    assert h.feeder.ran_dry == n - 1
    close(h)
    assert h.feeder.limit == h.limits[-1]


def test_a_grown_limit_is_used_for_room(engine):
    """After growing to 400, four 100-byte jobs are enqueued together and a fifth waits: the
    grown limit binds exactly as a configured one."""
    engine.instant = True
    h = Harness(engine, 100, grow_to=400)
    h.burst([h.job(i, 1) for i in range(1, 4)])  # 100 -> 200 -> 400
    bounded(h.feeder.wait_fed, {1, 2, 3})
    assert h.feeder.limit == 400
    engine.instant = False
    h.burst([h.job(i, 100) for i in range(10, 16)])
    until(lambda: engine.enqueued[-1] == 13, "four 100-byte jobs under the grown 400")
    time.sleep(0.03)
    assert engine.enqueued[3:] == [10, 11, 12, 13] and h.feeder.pending() == 2
    engine.finish(1)
    until(lambda: engine.enqueued[-1] == 14, "the fifth follows the first's end")
    engine.finish_all()
    bounded(h.feeder.wait_fed, set(range(10, 16)))
    engine.finish_all()
    assert h.violations == [] and h.feeder.limit == 400
    close(h)


# -- no growth where the feeder was never late -------------------------------------------------


def test_a_queue_kept_busy_never_grows(engine):
    """The engine finishes the oldest load only while another is still queued behind it: the
    copy engine never idles, so nothing may count as running dry, however long the burst."""
    h = Harness(engine, 100, grow_to=1 << 20)

    def step(eng: Engine) -> None:
        if len(eng.unfinished()) >= 2:
            eng.finish(1)

    engine.pump(step)
    n = 60
    h.burst([h.job(i, 25) for i in range(1, n + 1)])
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    engine.stop_pumps()
    engine.finish_all()
    assert h.ids() == list(range(1, n + 1))
    assert h.feeder.ran_dry == 0 and h.feeder.limit == 100
    assert h.violations == []
    close(h)


def test_a_punctual_feeder_with_half_limit_jobs_never_grows(engine):
    """Jobs over half the limit fit one at a time. The engine finishes each exactly when the
    feeder starts waiting for room (finish_on_sync): the feeder is never late, it is the one
    waiting. ``_ran_dry`` says a run dry means "the copy engine idled for as long as this
    thread was late"; here it never was, so the limit must stay."""
    engine.finish_on_sync = True
    h = Harness(engine, 100, grow_to=400)
    n = 8
    h.burst([h.job(i, 60) for i in range(1, n + 1)])
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    engine.finish_all()
    assert h.ids() == list(range(1, n + 1))
    assert h.feeder.ran_dry == 0, (
        f"ran_dry {h.feeder.ran_dry}: the feeder's own wait for room counted as a queue run dry")
    assert h.feeder.limit == 100, f"the limit grew to {h.feeder.limit} with no late feeder"
    close(h)


def test_a_job_over_the_limit_waiting_for_room_is_not_a_run_dry(engine):
    """A job larger than the limit goes alone: the feeder waits until everything before it is
    done, by design. That drain is the feeder's own doing (the engine finished as the feeder
    waited), not a late feeder: no run dry, no growth."""
    engine.finish_on_sync = True
    h = Harness(engine, 100, grow_to=400)
    h.burst([h.job(1, 40), h.job(2, 1000), h.job(3, 40)])
    bounded(h.feeder.wait_fed, {1, 2, 3})
    engine.finish_all()
    assert h.ids() == [1, 2, 3] and h.violations == []
    assert h.feeder.ran_dry == 0, (
        f"ran_dry {h.feeder.ran_dry}: waiting for room for a job over the limit counted as a "
        "queue run dry")
    assert h.feeder.limit == 100, f"the limit grew to {h.feeder.limit}"
    close(h)


def test_late_feeder_growth_counts_exactly_the_late_returns(engine):
    """A punctual engine (finish_on_sync, 25-byte jobs under 100: never dry on its own), but
    after some jobs the feeder comes back only once the engine drained everything (late_after):
    exactly those returns count, each doubling, clamped at 350."""
    engine.finish_on_sync = True
    late = {3, 10, 11, 20, 29}
    engine.late_after = set(late)
    h = Harness(engine, 100, grow_to=350)
    n = 30
    h.burst([h.job(i, 25) for i in range(1, n + 1)])
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    engine.finish_all()
    assert h.ids() == list(range(1, n + 1)) and h.violations == []
    assert h.feeder.ran_dry == len(late)
    want, lim = [], 100
    for i in range(1, n + 1):
        if i - 1 in late:
            lim = min(350, lim * 2)
        want.append(lim)
    assert h.limits == want
    close(h)


def test_a_burst_that_ended_does_not_count_when_the_next_begins(engine):
    """The engine drains the last load of a burst (late_after the last job): the feeder was
    idle, not late; many bursts of that kind never grow the limit."""
    engine.finish_on_sync = True
    h = Harness(engine, 100, grow_to=400)
    k = 0
    for _ in range(10):
        ids = list(range(k + 1, k + 4))
        engine.late_after.add(ids[-1])
        h.burst([h.job(i, 25) for i in ids])
        bounded(h.feeder.wait_fed, set(ids))
        until(lambda ids=ids: h.ids()[-1] == ids[-1], "the burst handed over")
        time.sleep(0.005)  # the feeder goes idle
        k += 3
    assert h.ids() == list(range(1, k + 1))
    assert h.feeder.ran_dry == 0 and h.feeder.limit == 100
    close(h)


# -- failures -----------------------------------------------------------------------------------


FAIL_KINDS = ["copy_failed", "cuda_error_in_copy", "wait_event", "sync_in_room_wait",
              "query_in_room_wait", "broken_stream"]


@pytest.mark.parametrize("kind", FAIL_KINDS)
def test_a_failure_is_never_a_run_dry_and_never_stalls(engine, kind):
    """Five 50-byte jobs under 100, a punctual engine (never dry on its own); job 3 fails in
    one of the ways the feeder handles. The failure drains the stream (or finds it broken):
    the next job finds nothing in flight, which must not count as a run dry. Job 3 is listed
    once, the rest are handed over in order, wait_fed and close return."""
    engine.finish_on_sync = True
    fail: dict[int, Exception] = {}
    if kind == "copy_failed":
        fail[3] = CopyFailed("job 3: injected")
    elif kind == "cuda_error_in_copy":
        fail[3] = RuntimeError("CUDA error: injected in the copy")
    elif kind == "sync_in_room_wait":
        engine.sync_raises.add(1)  # job 3 waits for job 1's end to make room
    elif kind == "query_in_room_wait":
        engine.query_raises.add(2)  # ... then looks at job 2's
    elif kind == "broken_stream":
        fail[3] = RuntimeError("CUDA error: injected in the copy")
        engine.stream_broken = True
    h = Harness(engine, 100, grow_to=400, fail=fail)
    jobs = [h.job(i, 50, fail_wait=(kind == "wait_event" and i == 3)) for i in range(1, 6)]
    h.burst(jobs)
    bounded(h.feeder.wait_fed, {1, 2, 3, 4, 5})
    assert h.feeder.take_failed() == [3] and h.feeder.take_failed() == []
    assert h.ids() == [1, 2, 4, 5] == engine.enqueued
    assert h.feeder.ran_dry == 0, f"{kind}: the drained stream counted as a run dry"
    assert h.feeder.limit == 100
    engine.stream_broken = False
    engine.sync_raises.clear()
    engine.query_raises.clear()
    h.feeder.put(h.job(6, 50))  # the feeder still works after the failure
    bounded(h.feeder.wait_fed, {6})
    assert h.ids()[-1] == 6
    close(h)


def test_every_job_failing_never_grows_and_never_stalls(engine):
    engine.instant = True
    n = 40
    h = Harness(engine, 64, grow_to=1 << 20,
                fail={i: CopyFailed(f"job {i}") for i in range(1, n + 1)})
    h.burst([h.job(i, 16) for i in range(1, n + 1)])
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    assert h.feeder.take_failed() == list(range(1, n + 1))
    assert h.started == [] and h.feeder.ran_dry == 0 and h.feeder.limit == 64
    close(h)


def test_a_failure_after_growth_does_not_shrink_the_limit(engine):
    engine.instant = True
    h = Harness(engine, 100, grow_to=800, fail={5: RuntimeError("CUDA error: injected")})
    h.burst([h.job(i, 10) for i in range(1, 9)])
    bounded(h.feeder.wait_fed, set(range(1, 9)))
    assert h.feeder.take_failed() == [5]
    assert nondecreasing(h.limits), "the limit shrank"
    assert h.feeder.limit == 800 and max(h.limits) <= 800
    close(h)


# -- jobs over the limit: alone, no deadlock ----------------------------------------------------


def test_jobs_over_the_limit_and_over_the_ceiling_go_alone_without_deadlock(engine):
    """Sizes far over the limit and over grow_to, between small ones, with the engine finishing
    one load at a time in real time: each big job is enqueued with nothing unfinished ahead of
    it, nothing is enqueued past the limit behind it, and everything is handed over in order."""
    h = Harness(engine, 100, grow_to=400)
    engine.pump(lambda eng: eng.finish(1), period=0.001)
    sizes = [40, 10_000, 40, 30, 5000, 401, 400, 399, 40, 1 << 40, 1]
    h.burst([h.job(i, s) for i, s in enumerate(sizes, 1)])
    bounded(h.feeder.wait_fed, set(range(1, len(sizes) + 1)))
    assert h.ids() == list(range(1, len(sizes) + 1)) == engine.enqueued
    assert h.violations == []
    assert h.feeder.limit <= 400 and h.feeder.take_failed() == []
    close(h)


def test_a_single_job_over_the_limit_with_nothing_in_flight_is_fed_at_once(engine):
    h = Harness(engine, 10, grow_to=20)
    h.feeder.put(h.job(1, 1 << 50))
    bounded(h.feeder.wait_fed, {1})
    assert h.ids() == [1] and h.feeder.limit == 10 and h.feeder.ran_dry == 0
    engine.finish_all()
    close(h)


# -- wait_fed / close ---------------------------------------------------------------------------


def test_wait_fed_returns_for_unknown_empty_and_failed_ids_and_close_is_idempotent(engine):
    engine.instant = True
    h = Harness(engine, 100, grow_to=200, fail={2: CopyFailed("job 2")})
    bounded(h.feeder.wait_fed, set())
    bounded(h.feeder.wait_fed, {12345})
    h.burst([h.job(1, 10), h.job(2, 10), h.job(3, 10)])
    bounded(h.feeder.wait_fed, {2})
    bounded(h.feeder.wait_fed, {1, 2, 3, 999})
    assert h.feeder.take_failed() == [2]
    close(h)
    close(h)  # a second close returns too
    with pytest.raises(RuntimeError):
        h.feeder.put(h.job(4, 1))
    assert h.ids() == [1, 3]


def test_close_drains_a_growing_queue_and_returns(engine):
    """close with many jobs still waiting and the limit mid-growth: every one is enqueued (in
    order, once) before the thread stops."""
    engine.pump(lambda eng: eng.finish_all(), period=0.0005)  # an engine well ahead of us
    h = Harness(engine, 8, grow_to=1000)
    n = 300
    h.burst([h.job(i, 8) for i in range(1, n + 1)])
    close(h)
    assert h.ids() == list(range(1, n + 1)) and h.feeder.pending() == 0
    assert 8 <= h.feeder.limit <= 1000
    assert h.feeder.limit == min(1000, 8 << h.feeder.ran_dry)


# -- concurrency: several putters while the limit grows ------------------------------------------


def _concurrent_run(engine: Engine, fail_every: int, direct: bool = False) -> None:
    rng = random.Random(1234 + fail_every)
    limit, grow_to = 64, 5000  # 64 << 6 = 4096, then clamped to 5000
    threads, per = 4, 150
    fail = {}
    specs: dict[int, int] = {}
    for t in range(threads):
        for k in range(per):
            i = t * 1000 + k
            specs[i] = rng.choice([1, 4, 8, 8, 16, 16, 30, 50, 65, 200, 9000])
            if fail_every and rng.randrange(fail_every) == 0:
                fail[i] = (CopyFailed(f"job {i}") if rng.random() < 0.5
                           else RuntimeError(f"CUDA error: job {i}"))
    # after these the feeder comes back only once the engine drained everything (it was late)
    engine.late_after = {i for i in specs if rng.random() < 0.1}
    h = Harness(engine, limit, grow_to=grow_to, fail=fail, direct=direct)
    jobs = {i: h.job(i, s) for i, s in specs.items()}

    def step(eng: Engine) -> None:  # sometimes one at a time, sometimes everything (a late feeder)
        r = rng.random()
        if r < 0.1:
            eng.finish_all()
        elif r < 0.8:
            eng.finish(1)

    engine.pump(step, period=0.0002)
    put_order: list[int] = []
    put_lock = threading.Lock()
    go = threading.Barrier(threads)
    errors: list[BaseException] = []

    def putter(t: int) -> None:
        try:
            go.wait(WAIT_S)
            for k in range(per):
                i = t * 1000 + k
                with put_lock:  # the order puts were made in, as the feeder saw them
                    h.feeder.put(jobs[i])
                    put_order.append(i)
                if k % 7 == 0:
                    time.sleep(0.0002)
                if k % 50 == 49:  # a waiter among the putters
                    bounded(h.feeder.wait_fed, {i})
                    assert i in h.ids() or i in fail
        except BaseException as exc:  # reported on the test's thread
            errors.append(exc)

    ts = [threading.Thread(target=putter, args=(t,), daemon=True) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
        assert not t.is_alive(), "a putter hung"
    assert errors == [], errors
    bounded(h.feeder.wait_fed, set(specs))
    engine.stop_pumps()
    engine.finish_all()
    close(h)
    ok = [i for i in put_order if i not in fail]
    assert sorted(put_order) == sorted(specs)
    assert h.ids() == ok == engine.enqueued, "enqueue order differs from put order"
    assert len(set(h.ids())) == len(h.ids()), "a job was handed over twice"
    failed = h.feeder.take_failed()
    assert failed == [i for i in put_order if i in fail], "failures listed out of order or twice"
    assert h.copy_calls == put_order, "a job's copy was attempted twice or out of order"
    assert h.violations == []
    assert nondecreasing(h.limits), "the limit shrank"
    assert max(h.limits) <= grow_to and h.feeder.limit <= grow_to
    assert h.feeder.limit == min(grow_to, limit << h.feeder.ran_dry)
    assert h.feeder.ran_dry > 0 and h.feeder.waits > 0  # it grew, and the limit bound
    by_putters = {i for i, name in h.copy_threads.items() if not name.startswith("tier-feed")}
    if direct:  # both paths were taken, and the count of the direct one is exact
        assert by_putters and len(by_putters) < len(specs)
        assert h.feeder.enqueued_direct == len(by_putters - set(fail))
    else:
        assert not by_putters and h.feeder.enqueued_direct == 0


@pytest.mark.parametrize("direct", [False, True])
def test_concurrent_putters_while_the_limit_grows_keep_every_job_once_in_order(engine, direct):
    _concurrent_run(engine, fail_every=0, direct=direct)


@pytest.mark.parametrize("direct", [False, True])
def test_concurrent_putters_with_failures_keep_every_job_once_in_order(engine, direct):
    _concurrent_run(engine, fail_every=9, direct=direct)


@pytest.mark.parametrize("direct", [False, True])
def test_put_racing_close_hands_over_exactly_what_was_accepted(engine, direct):
    """Putters keep putting while close runs: every put that returned is handed over exactly
    once (close drains), every put that raised is not."""
    engine.instant = True
    h = Harness(engine, 16, grow_to=4096, direct=direct)
    accepted: list[int] = []
    refused: list[int] = []
    lock = threading.Lock()
    go = threading.Event()

    def putter(t: int) -> None:
        go.wait(WAIT_S)
        for k in range(2000):
            if k % 100 == 99:
                time.sleep(0.0005)
            i = t * 10_000 + k
            j = h.job(i, 4)
            try:
                with lock:
                    h.feeder.put(j)
                    accepted.append(i)
            except RuntimeError:
                with lock:
                    refused.append(i)
                return

    ts = [threading.Thread(target=putter, args=(t,), daemon=True) for t in range(3)]
    for t in ts:
        t.start()
    go.set()
    time.sleep(0.02)
    close(h)
    for t in ts:
        t.join(WAIT_S)
        assert not t.is_alive()
    assert h.ids() == accepted
    assert not set(refused) & set(h.ids())
    assert h.feeder.limit <= 4096 and h.feeder.limit == min(4096, 16 << h.feeder.ran_dry)
