"""Hostile tests of CopyFeeder's direct mode (backends/copy_feeder.py, ``direct=True``).

With ``direct``, ``put`` enqueues a job on the caller's thread when no job is pending, no thread
holds the enqueue turn (``_enqueuing``) and the queue has room; otherwise the feeder thread does.
A direct enqueue that raises is handed to the feeder thread, which drains the stream and lists it.

The stand-in copy engine here is stricter than the ones of tests/test_copy_feeder.py and
tests/test_feeder_growth_hostile.py: it keeps every piece of work put on the load stream as an
``Op`` (a job's copies, or the part of them enqueued before a copy call failed), completed in
order by the test, a pump thread, or the stream's ``synchronize``. So the limit rule ("at most
``limit`` bytes unfinished on the engine; a job larger than that alone") is checked against what
the engine really holds, failed jobs' copies included, not against the feeder's own count.
Failures can be injected in ``stream.wait_event``, the start and end events' ``record``, the copy
call (before any copy, after half of them, a plain RuntimeError), an end event's ``query`` or
``synchronize``, and the copier's ``started`` callback. The stream ops of one enqueue must not be
interleaved with another's (the turn), and ``started`` is never entered twice at once. Every wait
is bounded: a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import types

import numpy as np
import pytest

# the stand-in engine's base and the waiting helpers of the feeder's other hostile tests
from test_feeder_growth_hostile import InOrderEngine, bounded, nondecreasing, until

from tiering.backends.block_copy import CopyFailed
from tiering.backends.copy_feeder import CopyFeeder, FeedJob

WAIT_S = 5.0
FEED = "tier-feed-"  # the feeder thread's name prefix

# where an injected failure strikes a job's enqueue; the first four put nothing on the engine
NO_BYTES_KINDS = ["copy_failed", "copy_runtime", "wait_event", "start_record"]
BYTES_KINDS = ["copy_partial", "end_record"]  # part or all of the job's copies are on the engine
ALL_KINDS = NO_BYTES_KINDS + BYTES_KINDS


class Op:
    """Work on the stand-in copy engine: one job's copies, or the part of them enqueued."""

    def __init__(self, job_id: int, nbytes: int) -> None:
        self.job_id, self.nbytes = job_id, nbytes
        self.done = threading.Event()
        # the load stream it was put on and its wave there (tests/test_feeder_lanes_hostile.py)
        self.lane = self.wave = 0


class Engine(InOrderEngine):
    """An in-order copy engine: ops complete only when the test, a pump, or a stream sync says."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.instant = False  # an op completes as it is enqueued (a feeder always late)
        self.stream_broken = False
        self.syncs = 0  # Stream.synchronize calls
        self.query_raises: set[int] = set()  # job ids whose end event's query raises
        self.sync_raises: set[int] = set()  # job ids whose end event's synchronize raises
        self.log: list[tuple] = []  # ("copy", id) / ("sync", unfinished B) / ("started", id)
        self.feeders: list[CopyFeeder] = []
        self.gates: list[threading.Event] = []

    def work(self) -> list:
        return self.ops

    def add(self, op: Op) -> None:
        with self.lock:
            self.ops.append(op)
            if self.instant:
                op.done.set()

    def note(self, entry: tuple) -> None:
        with self.lock:
            self.log.append(entry)

    def unfinished_bytes(self) -> int:
        with self.lock:
            return sum(o.nbytes for o in self.ops if not o.done.is_set())

    def job_drained(self, job_id: int) -> bool:
        with self.lock:
            return all(o.done.is_set() for o in self.ops if o.job_id == job_id)



class After:
    """The event a job waits for on the compute stream (FeedJob.after)."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id


class Event:
    def __init__(self, h: Harness, enable_timing: bool = False, blocking: bool = False) -> None:
        self.h, self.blocking = h, blocking  # blocking: a job's end event, else its start
        self.op: Op | None = None  # the last op on the stream when recorded
        self.job_id: int | None = None  # set when the job is handed over (started)

    def record(self, stream: object = None) -> None:
        h = self.h
        job = h.check_turn("end.record" if self.blocking else "start.record")
        kind = h.plan.get(job)
        if self.blocking and kind == "end_record":
            raise RuntimeError(f"CUDA error: injected in job {job}'s end event record")
        if not self.blocking and kind == "start_record":
            raise RuntimeError(f"CUDA error: injected in job {job}'s start event record")
        self.op = h.last_op(stream)

    def query(self) -> bool:
        if self.job_id is not None and self.job_id in self.h.engine.query_raises:
            raise RuntimeError(f"CUDA error: injected in query of job {self.job_id}'s end")
        return self.op is None or self.op.done.is_set()

    def synchronize(self) -> None:
        if self.job_id is not None and self.job_id in self.h.engine.sync_raises:
            raise RuntimeError(f"CUDA error: injected in synchronize of job {self.job_id}'s end")
        if self.op is not None and not self.op.done.wait(WAIT_S):
            raise AssertionError(f"job {self.job_id}'s end event never completed")

    def elapsed_time(self, other: Event) -> float:
        return 1.0


class Stream:
    def __init__(self, h: Harness, lane: int = 0) -> None:
        self.h, self.lane = h, lane
        self.cuda_stream = 0x99 + lane  # a handle per load stream: the copy call tells them apart

    def wait_event(self, ev: After) -> None:
        self.h.begin(ev.job_id)  # the first stream call of every enqueue
        if self.h.plan.get(ev.job_id) == "wait_event":
            raise RuntimeError(f"CUDA error: injected in job {ev.job_id}'s wait_event")

    def synchronize(self) -> None:
        eng = self.h.engine
        eng.note(("sync", eng.unfinished_bytes()))
        with eng.lock:
            eng.syncs += 1
        if eng.stream_broken:
            raise RuntimeError("CUDA error: the load stream is broken")
        eng.finish_all()


class Harness:
    """A direct feeder over ``engine``, recording what the stream, copy and started saw
    (``lanes`` > 1: waves over that many load streams, ``wave_streams``)."""

    stream_cls = Stream

    def __init__(self, engine: Engine, limit: int, grow_to: int = 0, direct: bool = True,
                 plan: dict[int, str] | None = None, started_raises: set[int] | None = None,
                 jitter: bool = False, waves: bool = False, lanes: int = 1) -> None:
        self.engine = engine
        self.waves = waves
        self._wave = 0  # with waves: bytes put on the engine since it last held nothing
        self.plan = dict(plan or {})
        self.started_raises = set(started_raises or ())
        self.jitter = jitter  # short sleeps in the callbacks: wider windows for races
        self.sizes: dict[int, int] = {}
        self.started: list[tuple[int, int, str]] = []  # (job id, bytes, thread name)
        self.copy_threads: dict[int, str] = {}
        self.begins: dict[int, int] = {}  # job id: enqueues of it begun (wait_event calls)
        self.limits: list[int] = []  # feeder.limit at each successful copy
        self.violations: list[str] = []  # copies that broke "limit, or alone" on the engine
        self.overlaps: list[str] = []  # stream ops of two enqueues interleaved; started re-entered
        self.gates: dict[int, threading.Event] = {}  # job id: its copy call waits on it
        self.entered: dict[int, threading.Event] = {}  # job id: set as its copy call begins
        self._local = threading.local()
        self._active: tuple[int, int] | None = None  # (thread ident, job id) holding the turn
        self._cb_lock = threading.Lock()
        self._in_started = 0
        self._in_copy = 0
        torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Event=lambda enable_timing=False, blocking=False: Event(self, enable_timing,
                                                                    blocking),
            set_device=lambda d: None))
        self.streams = [self.stream_cls(self, k) for k in range(lanes)]
        self.feeder = CopyFeeder(torch, "cuda:0", self.streams[0], limit, self._copy,
                                 self._on_started, grow_to=grow_to, direct=direct, waves=waves,
                                 wave_streams=self.streams if lanes > 1 else ())
        engine.feeders.append(self.feeder)

    def job(self, i: int, nbytes: int) -> FeedJob:
        self.sizes[i] = nbytes
        a = np.arange(4, dtype=np.uint64)
        return FeedJob(i, a, a, np.full(4, max(nbytes // 4, 1), dtype=np.uint64), nbytes,
                       After(i))

    def gate(self, job_id: int) -> threading.Event:
        """Hold job_id's copy call until the returned event is set."""
        g = threading.Event()
        self.gates[job_id] = g
        self.entered[job_id] = threading.Event()
        self.engine.gates.append(g)
        return g

    # -- the turn: one enqueue's stream ops are never interleaved with another's ------------------
    def begin(self, job_id: int) -> None:
        self.begins[job_id] = self.begins.get(job_id, 0) + 1
        self._local.job = job_id
        self._active = (threading.get_ident(), job_id)

    def check_turn(self, what: str) -> int:
        job = getattr(self._local, "job", None)
        if self._active != (threading.get_ident(), job):
            self.overlaps.append(f"{what} of job {job} on {threading.current_thread().name}: "
                                 f"another enqueue ({self._active}) came in between")
        return job  # type: ignore[return-value]

    # -- the callbacks ------------------------------------------------------------------------
    def hold_at_gate(self, job_id: int) -> None:
        """A copy call's start: signal ``entered``, then wait while the test holds its gate."""
        ev = self.entered.get(job_id)
        if ev is not None:
            ev.set()
        g = self.gates.get(job_id)
        if g is not None and not g.wait(WAIT_S):
            raise AssertionError(f"the test never opened job {job_id}'s gate")

    def _copy(self, job_id, src, dst, size, stream) -> None:
        self.hold_at_gate(job_id)
        self.check_turn("copy")
        with self._cb_lock:
            self._in_copy += 1
            if self._in_copy > 1:
                self.overlaps.append(f"two copy calls at once (job {job_id})")
        try:
            self.copy_threads[job_id] = threading.current_thread().name
            if self.jitter and job_id % 3 == 0:
                time.sleep(0.00005)
            kind = self.plan.get(job_id)
            if kind == "copy_failed":
                raise CopyFailed(f"job {job_id}: injected before any copy")
            if kind == "copy_runtime":
                raise RuntimeError(f"CUDA error: injected in job {job_id}'s copy")
            nbytes = self.sizes[job_id]
            if kind == "copy_partial":  # half its copies enqueued, then the API call failed
                self.put_op(Op(job_id, max(nbytes // 2, 1)), stream)
                raise CopyFailed(f"job {job_id}: injected after half of its copies")
            self.admit(job_id, nbytes, stream)
            self.put_op(Op(job_id, nbytes), stream)
            self.engine.note(("copy", job_id))
        finally:
            with self._cb_lock:
                self._in_copy -= 1

    # -- the engine's view (one load stream here; several in test_feeder_lanes_hostile.py) -------
    def admit(self, job_id: int, nbytes: int, stream: int) -> None:
        """Check a job's copies against what the engine holds as they go on it: the limit, or
        alone; with waves, the bytes put on it since it last held nothing."""
        ahead, limit = self.engine.unfinished_bytes(), self.feeder.limit
        if ahead and ahead + nbytes > limit:
            self.violations.append(f"job {job_id} ({nbytes} B) enqueued behind {ahead} B "
                                   f"unfinished on the engine, limit {limit}")
        if not ahead:
            self._wave = 0
        elif self.waves and self._wave + nbytes > limit:
            self.violations.append(f"job {job_id} ({nbytes} B) joined a wave of {self._wave} "
                                   f"B with {ahead} B unfinished on the engine, limit {limit}")
        self._wave += nbytes
        self.limits.append(limit)

    def put_op(self, op: Op, stream: int) -> None:
        self.engine.add(op)

    def last_op(self, stream: object) -> Op | None:
        """The work an event recorded now on ``stream`` completes after."""
        with self.engine.lock:
            return self.engine.ops[-1] if self.engine.ops else None

    def _on_started(self, job_id, nbytes, start, end) -> None:
        with self._cb_lock:
            self._in_started += 1
            if self._in_started > 1:
                self.overlaps.append(f"started entered twice at once (job {job_id})")
        try:
            end.job_id = job_id
            self.started.append((job_id, nbytes, threading.current_thread().name))
            self.engine.note(("started", job_id))
            if self.jitter and job_id % 4 == 1:
                time.sleep(0.00005)
            if job_id in self.started_raises:
                raise RuntimeError(f"the copier's started callback failed for job {job_id}")
        finally:
            with self._cb_lock:
                self._in_started -= 1

    # -- views --------------------------------------------------------------------------------
    def ids(self) -> list[int]:
        return [s[0] for s in self.started]

    def direct_ids(self) -> list[int]:
        return [s[0] for s in self.started if not s[2].startswith(FEED)]

    def stream_order(self, failed: set[int]) -> list[int]:
        """Job ids in the order their (complete) copies went on the engine, failed ones out."""
        with self.engine.lock:
            return [o.job_id for o in self.engine.ops if o.job_id not in failed]

    def log_index(self, entry: tuple) -> int:
        with self.engine.lock:
            return self.engine.log.index(entry)


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = fn(*args)
        except BaseException as exc:
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def join(t: threading.Thread, what: str, timeout: float = WAIT_S) -> None:
    t.join(timeout)
    assert not t.is_alive(), f"{what} did not return in {timeout} s"


def put_ok(h: Harness, j: FeedJob) -> None:
    """put must never raise for a failure of a job's CUDA calls: it is listed instead."""
    try:
        h.feeder.put(j)
    except Exception as exc:
        pytest.fail(f"put({j.job_id}) raised {exc!r}: a CUDA error of the enqueue must be a "
                    "failed job listed by take_failed, not an exception out of put")


def release(eng: Engine) -> None:
    """A test's end: its pumps stopped, gates opened, injected faults cleared, the engine's work
    finished and every feeder closed (bounded: a hang leaves a daemon thread, not a stuck run)."""
    eng.stop_pumps()
    for g in eng.gates:
        g.set()
    eng.stream_broken = False
    eng.sync_raises.clear()
    eng.query_raises.clear()
    eng.finish_all()
    for f in eng.feeders:
        t = threading.Thread(target=f.close, daemon=True)
        t.start()
        t.join(WAIT_S)


@pytest.fixture
def engine():
    eng = Engine()
    yield eng
    release(eng)


def close(h: Harness) -> None:
    bounded(h.feeder.close)


ME = threading.current_thread  # the test's own thread name: ME().name


# -- direct failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_failed_direct_enqueue_with_a_job_in_flight_is_listed_once_after_the_drain(
        engine, kind):
    """Job 1 is enqueued directly and still copying; job 2's direct enqueue fails (``kind``).
    put returns normally, job 2 is never handed over, it is listed exactly once, and only after
    the stream was synchronized (job 1's and job 2's copies done when it is seen listed; nothing
    pumps the engine here but that sync). The feeder is not stuck: job 3 is enqueued directly
    afterwards, and ``enqueued_direct`` counts exactly jobs 1 and 3."""
    h = Harness(engine, 100, plan={2: kind})
    put_ok(h, h.job(1, 30))
    assert h.ids() == [1] and h.copy_threads[1] == ME().name
    put_ok(h, h.job(2, 30))
    bounded(h.feeder.wait_fed, {2})
    failed = h.feeder.take_failed()
    assert failed == [2], f"{kind}: listed {failed}"
    assert engine.job_drained(1) and engine.job_drained(2), (
        f"{kind}: job 2 listed while copies were still on the engine")
    assert engine.syncs == 1, f"{kind}: the stream was synchronized {engine.syncs} times"
    assert h.ids() == [1], f"{kind}: the failed job was handed over ({h.ids()})"
    assert h.begins[2] == 1, f"{kind}: job 2's enqueue was tried {h.begins[2]} times"
    assert h.feeder.take_failed() == []
    put_ok(h, h.job(3, 30))  # nothing waits, the queue is empty: direct
    assert h.ids() == [1, 3] and h.copy_threads[3] == ME().name
    assert h.feeder.enqueued_direct == 2
    assert h.violations == [] and h.overlaps == []
    close(h)
    assert h.feeder.take_failed() == [] and h.ids() == [1, 3]


@pytest.mark.parametrize("kind", BYTES_KINDS)
def test_a_failed_direct_enqueue_is_drained_before_jobs_put_while_it_held_the_turn(
        engine, kind):
    """Job 1 (90 B, limit 100) is enqueued directly; its copy call is held, so jobs 2 and 3
    (90 B each), put meanwhile from the test's thread, wait as pending (the turn is held). Then
    job 1's enqueue fails after its copies went on the engine (``end_record``: all 90 B;
    ``copy_partial``: half). Its copies are in flight, uncounted by the feeder. The feeder must
    drain the stream for job 1 before it enqueues job 2 behind them, as it does when a job of
    its own thread fails; otherwise job 2 is enqueued behind job 1's unfinished bytes, past the
    limit, and job 1 is listed only after later jobs were handed over."""
    h = Harness(engine, 100, plan={1: kind})
    g = h.gate(1)
    t, box = in_thread(h.feeder.put, h.job(1, 90))
    assert h.entered[1].wait(WAIT_S), "job 1 never reached its copy call"
    put_ok(h, h.job(2, 90))
    put_ok(h, h.job(3, 90))
    assert h.feeder.pending() == 2 and h.ids() == []
    g.set()
    join(t, "job 1's direct put")
    assert "e" not in box, f"put(1) raised {box.get('e')!r}"
    until(lambda: 2 in h.ids(), "job 2 is handed over (nothing needs the engine's work)")
    listed_by_then = h.feeder.take_failed()
    engine.pump(lambda eng: eng.finish(1), period=0.001)
    bounded(h.feeder.wait_fed, {1, 2, 3})
    listed = listed_by_then + h.feeder.take_failed()
    assert listed == [1] and h.ids() == [2, 3] and h.overlaps == []
    syncs = [i for i, e in enumerate(engine.log) if e[0] == "sync"]
    copy2 = h.log_index(("copy", 2))
    assert syncs and syncs[0] < copy2, (
        f"{kind}: job 2 was enqueued (log {copy2}) before the stream was drained of failed "
        f"job 1's copies (syncs at {syncs}); log {engine.log}")
    assert h.violations == [], f"{kind}: {h.violations}"
    assert listed_by_then == [1], (
        f"{kind}: when job 2 was handed over, failed job 1 (put before it) was not yet listed")
    close(h)


def test_wait_fed_on_a_direct_failed_job_returns_only_once_it_is_listed(engine):
    """Job 1 (70 B) copies; job 2's direct enqueue is held, then fails; job 3 (50 B, no room
    beside job 1) is put meanwhile and waits for job 1's end. wait_fed({2}) may return only once
    job 2 is listed (its failure in take_failed right after), whatever else waits."""
    h = Harness(engine, 100, plan={2: "copy_failed"})
    put_ok(h, h.job(1, 70))
    g = h.gate(2)
    t, box = in_thread(h.feeder.put, h.job(2, 10))  # 70 + 10 fits: direct
    assert h.entered[2].wait(WAIT_S)
    put_ok(h, h.job(3, 50))
    g.set()
    join(t, "job 2's direct put")
    assert "e" not in box
    w, wbox = in_thread(h.feeder.wait_fed, {2})
    time.sleep(0.05)
    if not w.is_alive():
        assert h.feeder.take_failed() == [2], "wait_fed({2}) returned before job 2 was listed"
        engine.finish_all()
    else:
        engine.pump(lambda eng: eng.finish(1), period=0.002)
        join(w, "wait_fed({2})")
        assert h.feeder.take_failed() == [2], "wait_fed({2}) returned before job 2 was listed"
    bounded(h.feeder.wait_fed, {1, 2, 3})
    assert h.ids() == [1, 3] and h.violations == [] and h.overlaps == []
    close(h)


@pytest.mark.parametrize("direct", [False, True])
def test_an_event_query_error_in_the_room_check_is_a_listed_failure_never_raised_by_put(
        engine, direct):
    """Job 1 is enqueued and copying; its end event's ``query`` then raises (a CUDA error).
    The next job needs that query to know the room. On the feeder thread the error is caught:
    the job is a failed job, listed after the drain (direct=False passes). With ``direct``,
    ``put`` runs the same room check on the caller's thread: the error must still make job 2
    a listed failure, not an exception out of put that loses the job (neither pending, nor
    handed over, nor listed), as it did before ccbd883."""
    h = Harness(engine, 100, direct=direct)
    put_ok(h, h.job(1, 10))
    until(lambda: h.ids() == [1], "job 1 handed over")
    engine.query_raises.add(1)
    put_ok(h, h.job(2, 10))
    bounded(h.feeder.wait_fed, {2})
    assert h.feeder.take_failed() == [2]
    assert engine.job_drained(1)
    engine.query_raises.clear()
    put_ok(h, h.job(3, 10))
    bounded(h.feeder.wait_fed, {3})
    until(lambda: 3 in h.ids(), "job 3 handed over")
    assert h.ids() == [1, 3] and h.violations == []
    close(h)


# -- the copier's started callback ---------------------------------------------------------------


def test_started_raising_in_a_direct_put_releases_the_turn_and_counts_the_bytes(engine, caplog):
    """started raises for job 1, enqueued directly: put does not raise it into vLLM's worker
    (one log line names the job), and job 1's copies are on the engine and counted: job 2
    (60 B, limit 100) waits for job 1's end; the turn is released (the feeder thread feeds
    job 2), and a later job fits directly again."""
    h = Harness(engine, 100, started_raises={1})
    with caplog.at_level(logging.ERROR, logger="tiering.backends.copy_feeder"):
        h.feeder.put(h.job(1, 60))
    assert [r.getMessage() for r in caplog.records] == [
        "copy feeder: handing job 1 over to the copier failed"]
    assert h.copy_threads[1] == ME().name and h.ids() == [1]
    put_ok(h, h.job(2, 60))
    time.sleep(0.03)
    assert h.ids() == [1] and h.feeder.pending() == 1, "job 2 enqueued beside job 1's 60 B"
    engine.finish(1)
    bounded(h.feeder.wait_fed, {2})
    until(lambda: 2 in h.ids(), "job 2 handed over")
    assert h.copy_threads[2].startswith(FEED)
    put_ok(h, h.job(3, 10))  # 60 + 10 fits, nothing waits: direct
    assert h.copy_threads[3] == ME().name
    assert h.feeder.enqueued_direct == 2  # jobs 1 and 3 were enqueued by put's caller
    assert h.violations == [] and h.overlaps == [] and h.feeder.take_failed() == []
    close(h)


@pytest.mark.parametrize("direct", [True, False])
def test_started_raising_on_the_feeder_thread_does_not_stop_later_jobs(engine, direct):
    """started raises for job 2, which the feeder thread enqueues (no room for it when put).
    The direct path was made safe against this (a direct put releases the turn whatever started
    does); the thread's path must be too: a later job is still handed over, wait_fed returns,
    close drains. (Before ccbd883 ``_started`` on the thread was outside any handler: the
    thread died holding ``_enqueuing`` with job 2 still pending, so every later put, direct or
    not, stayed pending forever, wait_fed never returned and close returned without draining.)"""
    h = Harness(engine, 100, direct=direct, started_raises={2})
    put_ok(h, h.job(1, 60))
    until(lambda: h.ids() == [1], "job 1 handed over")
    put_ok(h, h.job(2, 60))
    engine.finish_all()  # room for job 2: the feeder thread enqueues it, started raises
    until(lambda: 2 in h.ids(), "job 2 handed over")
    engine.finish_all()
    put_ok(h, h.job(3, 10))
    bounded(h.feeder.wait_fed, {3}, timeout=3.0)
    until(lambda: 3 in h.ids(), "job 3 handed over after started failed for job 2")
    close(h)
    assert h.feeder.pending() == 0 and h.ids() == [1, 2, 3]


# -- order and the turn ---------------------------------------------------------------------------


def test_jobs_that_fit_never_overtake_one_waiting_for_room(engine):
    """Job 1 (90 B) copies; job 2 (50 B) waits for room on the feeder thread. Four threads then
    put 1-byte jobs at once: each would fit beside job 1, but job 2 is pending before them, so
    none may be enqueued directly; after job 1 ends, job 2 goes first, then every putter's jobs
    in that putter's order, each once."""
    h = Harness(engine, 100)
    put_ok(h, h.job(1, 90))
    put_ok(h, h.job(2, 50))
    until(lambda: h.feeder.waits >= 1, "the feeder thread waits for room for job 2")
    go = threading.Barrier(4)
    per: dict[int, list[int]] = {}

    def putter(t: int) -> None:
        go.wait(WAIT_S)
        per[t] = [100 * (t + 1) + k for k in range(25)]
        for i in per[t]:
            h.feeder.put(h.job(i, 1))

    ts = [in_thread(putter, t) for t in range(4)]
    for t, box in ts:
        join(t, "a putter")
        assert "e" not in box, box.get("e")
    assert h.ids() == [1] and h.feeder.pending() == 101
    engine.pump(lambda eng: eng.finish(1), period=0.0005)
    bounded(h.feeder.wait_fed, {i for v in per.values() for i in v} | {2})
    ids = h.ids()
    assert ids[:2] == [1, 2] and len(ids) == len(set(ids)) == 102
    for v in per.values():
        assert [i for i in ids if i in set(v)] == v
    assert h.direct_ids() == [1] and h.feeder.enqueued_direct == 1
    assert h.violations == [] and h.overlaps == []
    close(h)


def test_limit_boundaries_of_the_direct_path(engine):
    """Exactly at the limit is room (60 + 40 = 100), a 0-byte job fits a full queue, one byte
    more waits; a job over the limit waits for an empty queue, then goes alone, and one put
    when the queue is empty is enqueued directly at once, alone."""
    h = Harness(engine, 100)
    me = ME().name
    put_ok(h, h.job(1, 60))
    put_ok(h, h.job(2, 40))
    put_ok(h, h.job(3, 0))
    assert h.ids() == [1, 2, 3] and all(h.copy_threads[i] == me for i in (1, 2, 3))
    put_ok(h, h.job(4, 1))
    put_ok(h, h.job(5, 0))  # fits, but job 4 waits before it
    put_ok(h, h.job(6, 500))
    time.sleep(0.03)
    assert h.ids() == [1, 2, 3] and h.feeder.pending() == 3
    engine.finish(1)
    until(lambda: h.ids() == [1, 2, 3, 4, 5], "4 and 5 after job 1's end")
    time.sleep(0.03)
    assert h.ids() == [1, 2, 3, 4, 5], "the 500-byte job went beside unfinished ones"
    engine.finish_all()
    until(lambda: h.ids()[-1] == 6, "the large job, alone")
    put_ok(h, h.job(7, 10))  # behind the large one still copying: waits
    time.sleep(0.03)
    assert h.ids()[-1] == 6 and h.feeder.pending() == 1
    engine.finish_all()
    bounded(h.feeder.wait_fed, {7})
    until(lambda: h.ids()[-1] == 7, "job 7")
    engine.finish_all()
    put_ok(h, h.job(8, 1 << 40))  # the queue empty: at once, by the caller, alone
    assert h.ids()[-1] == 8 and h.copy_threads[8] == me
    put_ok(h, h.job(9, 1))
    time.sleep(0.03)
    assert h.ids()[-1] == 8 and h.feeder.pending() == 1
    engine.finish_all()
    bounded(h.feeder.wait_fed, {9})
    until(lambda: h.ids()[-1] == 9, "job 9")
    assert h.ids() == list(range(1, 10))
    assert [i for i in range(1, 10) if h.copy_threads[i] == me] == [1, 2, 3, 8]
    assert h.feeder.enqueued_direct == 4
    assert h.violations == [] and h.overlaps == [] and h.feeder.take_failed() == []
    close(h)


# -- the growing limit with direct jobs ------------------------------------------------------


def test_direct_jobs_never_count_as_a_run_dry(engine):
    """An engine always ahead (instant), jobs put one at a time: every one is enqueued
    directly; none waited behind another, so none is a queue run dry and the limit stays."""
    engine.instant = True
    h = Harness(engine, 100, grow_to=400)
    for i in range(1, 41):
        put_ok(h, h.job(i, 90))
    assert h.ids() == list(range(1, 41)) and h.direct_ids() == h.ids()
    assert h.feeder.enqueued_direct == 40
    assert h.feeder.ran_dry == 0 and h.feeder.limit == 100 and h.feeder.waits == 0
    close(h)


def burst_behind_a_held_direct_put(h: Harness, n: int, nbytes: int) -> None:
    """Job 1 put directly and held in its copy call while jobs 2..n are put (they wait for the
    feeder thread); then released, and every job fed and handed over."""
    g = h.gate(1)
    t, box = in_thread(h.feeder.put, h.job(1, nbytes))
    assert h.entered[1].wait(WAIT_S)
    for i in range(2, n + 1):
        put_ok(h, h.job(i, nbytes))
    g.set()
    join(t, "job 1's put")
    assert "e" not in box
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    until(lambda: len(h.ids()) == n, "all handed over")


def burst_from_a_thread_behind_a_gate(h: Harness, n: int, nbytes: int, direct: bool) -> None:
    """Jobs 1..n put from one thread while job 1's copy is held (with ``direct`` the thread's
    own put holds it, else the feeder thread's); then released, every job fed and handed over
    in order."""
    g = h.gate(1)
    t, box = in_thread(lambda: [h.feeder.put(h.job(i, nbytes)) for i in range(1, n + 1)])
    if direct:
        assert h.entered[1].wait(WAIT_S)
    g.set()
    join(t, "the puts")
    assert "e" not in box
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    until(lambda: len(h.ids()) == n, "all handed over")
    assert h.ids() == list(range(1, n + 1))


def test_a_burst_behind_a_direct_job_grows_and_direct_puts_use_the_grown_limit(engine):
    """Job 1's direct enqueue is held while jobs 2..8 are put (pending); the engine is always
    ahead (instant): the thread finds the queue dry behind each of its own enqueues, and the
    limit doubles to its ceiling (400), exactly by the count. Afterwards direct puts get the
    grown room: four 100-byte jobs go directly, the fifth waits."""
    engine.instant = True
    h = Harness(engine, 100, grow_to=400)
    burst_behind_a_held_direct_put(h, 8, 50)
    assert h.ids() == list(range(1, 9)) and h.direct_ids() == [1]
    assert 5 <= h.feeder.ran_dry <= 7, h.feeder.ran_dry
    assert h.feeder.limit == 400 == min(400, 100 << h.feeder.ran_dry)
    assert nondecreasing(h.limits) and max(h.limits) == 400
    engine.instant = False
    for i in range(10, 14):
        put_ok(h, h.job(i, 100))
    assert [h.copy_threads[i] for i in range(10, 14)] == [ME().name] * 4
    put_ok(h, h.job(14, 100))
    time.sleep(0.03)
    assert 14 not in h.ids() and h.feeder.pending() == 1
    engine.finish(1)
    bounded(h.feeder.wait_fed, {14})
    until(lambda: h.ids()[-1] == 14, "job 14")
    assert h.copy_threads[14].startswith(FEED)
    assert h.feeder.enqueued_direct == 5 and h.violations == [] and h.overlaps == []
    close(h)


# -- close ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fails", [False, True])
def test_close_during_a_direct_enqueue_lists_or_hands_it_over(engine, fails):
    """close while job 1's direct enqueue is in the caller's hands (held in its copy call); a
    put racing close is either accepted (and then fed) or refused. When job 1's enqueue then
    fails, it is still listed, after a drain; when it succeeds, it is handed over. close
    returns, nothing stays pending, the feeder thread has stopped."""
    h = Harness(engine, 100, plan={1: "end_record"} if fails else {})
    g = h.gate(1)
    t, box = in_thread(h.feeder.put, h.job(1, 40))
    assert h.entered[1].wait(WAIT_S)
    c, cbox = in_thread(h.feeder.close)
    until(lambda: h.feeder._stop, "close began")
    with pytest.raises(RuntimeError, match="closed"):
        h.feeder.put(h.job(2, 1))
    g.set()
    join(t, "job 1's put")
    join(c, "close")
    assert "e" not in box and "e" not in cbox
    assert h.feeder.pending() == 0 and not h.feeder._thread.is_alive()
    if fails:
        assert h.feeder.take_failed() == [1] and h.ids() == []
        assert engine.job_drained(1) and engine.syncs == 1
    else:
        assert h.feeder.take_failed() == [] and h.ids() == [1]
        assert h.feeder.enqueued_direct == 1
    bounded(h.feeder.wait_fed, {1, 2})
    assert h.overlaps == []


# -- randomized: several putters, failures, waiters, a pumping engine -----------------------------


class Run:
    """Putters over one direct feeder; collects failures as they are listed, checking each one
    was drained when seen."""

    def __init__(self, engine: Engine, seed: int, putters: int, per: int, kinds: list[str],
                 fail_rate: float, limit: int = 64, grow_to: int = 4096,
                 waves: bool = False) -> None:
        self.engine, self.limit0, self.grow_to = engine, limit, grow_to
        rng = random.Random(seed)
        self.specs: dict[int, int] = {}
        plan: dict[int, str] = {}
        self.per_putter: dict[int, list[int]] = {}
        for t in range(putters):
            self.per_putter[t] = []
            for k in range(per):
                i = (t + 1) * 100_000 + k
                self.per_putter[t].append(i)
                self.specs[i] = rng.choice([0, 1, 8, 16, 16, 30, 32, 33, 63, 64, 65, 200, 5000])
                if kinds and rng.random() < fail_rate:
                    plan[i] = rng.choice(kinds)
        self.plan = plan
        self.h = Harness(engine, limit, grow_to=grow_to, plan=plan, jitter=True, waves=waves)
        self.jobs = {i: self.h.job(i, s) for i, s in self.specs.items()}
        self.collected: list[int] = []
        self.undrained: list[int] = []
        self.collect_lock = threading.Lock()
        pump_rng = random.Random(seed * 7 + 1)

        def step(eng: Engine) -> None:
            r = pump_rng.random()
            if r < 0.3:
                eng.finish_all()
            elif r < 0.8:
                eng.finish(1)

        engine.pump(step, period=0.0002)
        self._stop_poll = engine.pump(lambda eng: self.collect(), period=0.001)

    def collect(self) -> None:
        with self.collect_lock:
            got = self.h.feeder.take_failed()
            for i in got:
                if not self.engine.job_drained(i):
                    self.undrained.append(i)
            self.collected += got

    def is_out(self, i: int) -> bool:
        """Whether job i was handed over or listed (failures are taken under collect_lock)."""
        with self.collect_lock:
            self.collected += self.h.feeder.take_failed()
            return i in self.collected or i in set(self.h.ids())

    def check(self, accepted: list[int], serialized_order: list[int] | None) -> None:
        h, fail = self.h, set(self.plan)
        self._stop_poll.set()
        self.collect()
        failed = self.collected
        ids = h.ids()
        assert len(ids) == len(set(ids)), "a job was handed over twice"
        assert len(failed) == len(set(failed)), "a failure was listed twice"
        assert set(failed) == set(accepted) & fail, "failures listed differ from those injected"
        assert set(ids) == set(accepted) - fail, "handed over differs from accepted non-failed"
        assert self.undrained == [], f"listed before drained: {self.undrained}"
        assert ids == h.stream_order(fail), "started order differs from the engine's order"
        for v in self.per_putter.values():
            mine = set(v)
            assert [i for i in ids if i in mine] == [i for i in v if i in set(ids)], (
                "a putter's jobs handed over out of its order")
            assert [i for i in failed if i in mine] == [i for i in v if i in set(failed)], (
                "a putter's failures listed out of its order")
        if serialized_order is not None:
            assert ids == [i for i in serialized_order if i not in fail]
            assert failed == [i for i in serialized_order if i in fail]
        assert h.violations == [], h.violations[:5]
        assert h.overlaps == [], h.overlaps[:5]
        assert self.engine.syncs == len(failed), "not one drain per failure"
        tried = {i: n for i, n in h.begins.items() if n != 1}
        assert tried == {} and set(h.begins) == set(accepted), (
            f"enqueues not tried exactly once per accepted job: {dict(list(tried.items())[:5])}")
        direct = h.direct_ids()
        assert h.feeder.enqueued_direct == len(direct), (
            f"enqueued_direct {h.feeder.enqueued_direct}, direct hand-overs {len(direct)}")
        assert all(h.copy_threads[i] == name for i, _, name in h.started), (
            "a job's copies and its hand-over on different threads")
        assert nondecreasing(h.limits), "the limit shrank"
        assert h.feeder.limit <= self.grow_to and max(h.limits, default=0) <= self.grow_to
        assert h.feeder.limit == min(self.grow_to, self.limit0 << h.feeder.ran_dry)
        assert h.feeder.ran_dry <= len(ids) - len(direct), "a direct enqueue counted as dry"


def _seeds(first: int, default: int) -> list[int]:
    """The seeds of a randomized test: ``default`` of them, or ``TIERING_FAULT_TRIALS`` (the
    fault suite's count, tests/conftest.py) for a long run."""
    return list(range(first, first + int(os.environ.get("TIERING_FAULT_TRIALS") or default)))


def _putters(run: Run, serialize: bool, wait_every: int, pause: float = 0.5) -> list[int]:
    h = run.h
    put_lock = threading.Lock()
    order: list[int] = []
    errors: list[BaseException] = []
    go = threading.Barrier(len(run.per_putter))

    def putter(t: int) -> None:
        pace = random.Random(t)  # pauses that let the feeder thread catch up: direct puts
        try:
            go.wait(WAIT_S)
            for k, i in enumerate(run.per_putter[t]):
                if serialize:
                    with put_lock:
                        h.feeder.put(run.jobs[i])
                        order.append(i)
                else:
                    h.feeder.put(run.jobs[i])
                    with put_lock:
                        order.append(i)
                if pace.random() < pause:  # bursts, then a pause the thread catches up in
                    time.sleep(pace.uniform(0.0005, 0.003))
                if k % wait_every == wait_every - 1:
                    bounded(h.feeder.wait_fed, {i}, timeout=WAIT_S)
                    assert run.is_out(i), f"wait_fed({{{i}}}) returned, job neither out nor listed"
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=putter, args=(t,), daemon=True) for t in run.per_putter]
    for t in ts:
        t.start()
    for t in ts:
        join(t, "a putter", timeout=30)
    assert errors == [], errors[:3]
    return order


def putters_checked(run: Run, serialize: bool, wait_every: int) -> None:
    """Every putter's jobs put, all fed, the feeder closed, then ``Run.check`` (the global
    order too where the puts were serialized)."""
    order = _putters(run, serialize=serialize, wait_every=wait_every)
    bounded(run.h.feeder.wait_fed, set(run.specs))
    close(run.h)
    run.check(order, serialized_order=order if serialize else None)


def _random_putters(run: Run, serialize: bool, wait_every: int) -> None:
    """``putters_checked``, and both paths taken."""
    putters_checked(run, serialize, wait_every)
    assert 0 < run.h.feeder.enqueued_direct < len(run.h.ids()), "one path never taken"


@pytest.mark.parametrize("seed", _seeds(1, 6))
def test_random_serialized_putters_with_every_failure_kind(engine, seed):
    """Puts made one at a time (under a lock) by three threads, every failure kind including
    those that leave copies on the engine: the global order holds (stream = started = puts,
    failures in put order), the engine never holds more than the limit, each failure is listed
    once after its drain, the count of direct enqueues is exact, the limit only grows by the
    rule."""
    _random_putters(Run(engine, seed, putters=3, per=300, kinds=ALL_KINDS, fail_rate=0.12),
                    serialize=True, wait_every=17)


@pytest.mark.parametrize("seed", _seeds(1001, 6))
def test_random_racing_putters_with_every_failure_kind(engine, seed):
    """Four threads put at will (no lock), so putters race for the turn and for the room while
    the feeder thread waits for room; failures of every kind, those that leave copies on the
    engine included (racy before ccbd883: a job put meanwhile could go behind them). Every job is
    handed over or listed exactly once, each putter's order holds for both, stream order equals
    started order, the limit holds on the engine, the turn is never shared."""
    _random_putters(Run(engine, seed, putters=4, per=300, kinds=ALL_KINDS, fail_rate=0.1),
                    serialize=False, wait_every=23)


@pytest.mark.parametrize("seed", _seeds(3001, 4))
@pytest.mark.parametrize("serialize", [True, False])
def test_random_putters_in_waves_with_every_failure_kind(engine, seed, serialize):
    """As the two tests above, with ``waves``: besides all they check, no job joins the
    engine's work once the bytes put on it since it last held nothing would pass the limit
    (a wave holds at most the limit, a job over it goes alone), failures included."""
    _random_putters(Run(engine, seed, putters=3, per=300, kinds=ALL_KINDS, fail_rate=0.1,
                        waves=True), serialize=serialize, wait_every=19)


def close_racing_putters(run: Run, seed: int, settle_s: float) -> tuple[list[int], list[int]]:
    """Every putter puts at will (bursts and pauses) while ``close`` runs after up to
    ``settle_s``; then the checks every such run shares: no put raised but "closed", the thread
    stopped, a refused job neither handed over nor listed, ``Run.check`` on the accepted ones.
    Returns (accepted, refused)."""
    h = run.h
    accepted: list[int] = []
    refused: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Event()

    def putter(t: int) -> None:
        pace = random.Random(seed * 10 + t)
        go.wait(WAIT_S)
        for i in run.per_putter[t]:
            if pace.random() < 0.5:  # bursts and pauses: both paths, and races for the turn
                time.sleep(pace.uniform(0.0005, 0.003))
            try:
                h.feeder.put(run.jobs[i])
            except RuntimeError as exc:
                if "closed" not in str(exc):
                    errors.append(exc)
                with lock:
                    refused.append(i)
                return
            with lock:
                accepted.append(i)

    ts = [threading.Thread(target=putter, args=(t,), daemon=True) for t in run.per_putter]
    for t in ts:
        t.start()
    go.set()
    time.sleep(random.Random(seed).uniform(0.005, settle_s))
    close(h)
    for t in ts:
        join(t, "a putter")
    assert errors == [], errors[:3]
    assert h.feeder.pending() == 0 and not h.feeder._thread.is_alive()
    assert len(refused) <= len(run.per_putter)
    assert not set(refused) & (set(h.ids()) | set(run.collected) | set(h.feeder._failed))
    run.check(accepted, serialized_order=None)
    return accepted, refused


@pytest.mark.parametrize("seed", _seeds(2001, 8))
def test_random_close_racing_direct_puts_and_failures(engine, seed):
    """Putters put at will while close runs; failures of every kind. Every put
    that returned is handed over or listed exactly once (close drains, direct enqueues in
    progress included); a put that raised "closed" is neither; the thread stops."""
    run = Run(engine, seed, putters=3, per=400, kinds=ALL_KINDS, fail_rate=0.1)
    h = run.h
    close_racing_putters(run, seed, 0.15)
    with pytest.raises(RuntimeError, match="closed"):
        h.feeder.put(h.job(1, 1))
