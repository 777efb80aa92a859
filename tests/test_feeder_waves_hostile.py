"""Hostile tests of CopyFeeder's waves (backends/copy_feeder.py, ``waves=True``).

With ``waves`` a job may be enqueued only when the queue (jobs enqueued and not yet finished) is
empty, or while the wave in flight is open and the bytes enqueued since the queue was last empty
plus the job's stay within ``limit``; once a job does not fit the wave closes and nothing is
enqueued until every job in flight is done; a job over the limit is a wave of its own. That holds
for ``put``'s direct path and the feeder thread alike. The limit grows only when the feeder came
back to a queue already empty while loads waited, never when it waited for a wave on purpose.

The stand-in engine is the strict one of tests/test_feeder_direct_hostile.py (every piece of work
on the load stream an ``Op``, completed in order by the test, a pump, or a stream sync), with a
recorder of what the engine held at each copy call, a punctual mode (an end event's synchronize
finishes the engine's work through it: a feeder never late) and a late one (the engine drains
everything while a given job is handed over: the feeder comes back to an empty queue). Every wait
is bounded: a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import random
import time

import pytest
from test_feeder_direct_hostile import (
    ALL_KINDS,
    BYTES_KINDS,
    FEED,
    ME,
    WAIT_S,
    Engine,
    Event,
    Harness,
    Run,
    _seeds,
    bounded,
    burst_behind_a_held_direct_put,
    burst_from_a_thread_behind_a_gate,
    close,
    close_racing_putters,
    in_thread,
    join,
    nondecreasing,
    put_ok,
    putters_checked,
    release,
    until,
)

QUIET_S = 0.03  # how long a test watches for something that must not happen


class WEngine(Engine):
    def __init__(self) -> None:
        super().__init__()
        self.punctual = False  # an end event's synchronize finishes the work through it
        self.late_after: set[int] = set()  # once one of these is handed over, drain everything


class WEvent(Event):
    def synchronize(self) -> None:
        eng = self.h.engine
        if getattr(eng, "punctual", False) and self.op is not None:
            with eng.lock:
                for o in eng.ops:
                    o.done.set()
                    if o is self.op:
                        break
        super().synchronize()


class WHarness(Harness):
    """A waves feeder (direct by default) recording, at each successful copy call, how many
    jobs' copies were unfinished on the engine ahead of it and the limit then."""

    def __init__(self, engine: Engine, limit: int, **kw) -> None:
        kw.setdefault("waves", True)
        # (job id, unfinished jobs ahead on the engine, limit)
        self.copies: list[tuple[int, int, int]] = []
        super().__init__(engine, limit, **kw)
        self.feeder.torch.cuda.Event = (
            lambda enable_timing=False, blocking=False: WEvent(self, enable_timing, blocking))

    def _copy(self, job_id, src, dst, size, stream) -> None:
        self.hold_at_gate(job_id)
        with self.engine.lock:  # jobs, 0-byte ones included, whose copies are unfinished
            ahead = sum(1 for o in self.engine.ops if not o.done.is_set())
        limit = self.feeder.limit
        super()._copy(job_id, src, dst, size, stream)
        self.copies.append((job_id, ahead, limit))

    def _on_started(self, job_id, nbytes, start, end) -> None:
        super()._on_started(job_id, nbytes, start, end)
        if job_id in getattr(self.engine, "late_after", ()):
            self.engine.finish_all()

    def engine_waves(self) -> list[list[int]]:
        """The jobs' copies grouped by waves as the engine saw them: a wave begins at a copy
        with nothing unfinished ahead of it."""
        out: list[list[int]] = []
        for job_id, ahead, _ in self.copies:
            if job_id in self.plan:  # its enqueue failed: drained, in no wave
                continue
            if ahead == 0 or not out:
                out.append([])
            out[-1].append(job_id)
        return out

    def check(self) -> None:
        assert self.violations == [], self.violations[:5]
        assert self.overlaps == [], self.overlaps[:5]
        prev = None
        for job_id, ahead, limit in self.copies:
            if job_id in self.plan:
                continue
            if ahead and prev is not None:
                assert limit == prev, (
                    f"job {job_id} joined a wave in flight under limit {limit}, the wave began "
                    f"under {prev}: the limit changed mid-wave")
            prev = limit
        sizes, limits = self.sizes, {c[0]: c[2] for c in self.copies}
        for w in self.engine_waves():
            total = sum(sizes[i] for i in w)
            assert total <= limits[w[0]] or len(w) == 1, (
                f"the engine saw a wave {w[:8]} of {total} B, limit {limits[w[0]]}")
        assert self.feeder.waves_started <= len(self.engine_waves()), (
            f"waves_started {self.feeder.waves_started}, but the engine saw only "
            f"{len(self.engine_waves())} waves begin")


@pytest.fixture
def engine():
    eng = WEngine()
    yield eng
    eng.punctual = True  # every wait for the engine's work ends
    release(eng)


def idle(h: Harness) -> None:
    """Wait until nothing is pending and no thread holds the turn (the feeder thread releases
    it just after a hand-over), so that the next put may be direct."""
    def free() -> bool:
        with h.feeder._cond:
            return not h.feeder._pending and not h.feeder._enqueuing
    until(free, "the feeder idle")


def quiet(h: Harness, ids: list[int], pending: int) -> None:
    """Nothing more is handed over for a while: the wave stays closed."""
    time.sleep(QUIET_S)
    assert h.ids() == ids, f"handed over {h.ids()}, expected still {ids}"
    assert h.feeder.pending() == pending


# -- the direct path and the wave --------------------------------------------------------------


def test_a_direct_put_that_does_not_fit_closes_the_wave_for_everyone(engine):
    """Jobs 1 and 2 (40 B each, limit 100) go directly into one wave; job 3 (30 B) does not fit
    (110): it waits, and so does job 4 (10 B, it would fit, but job 3 is before it). When job 1
    ends, 40 B are in flight and the wave is closed: nothing goes in. When job 2 ends the
    feeder opens a new wave with jobs 3 and 4 (40 B); job 5 (60 B) then fits that wave exactly
    and goes directly; job 6 (1 B) closes it."""
    h = WHarness(engine, 100)
    for i, n in ((1, 40), (2, 40), (3, 30), (4, 10)):
        put_ok(h, h.job(i, n))
    assert h.ids() == [1, 2] and h.direct_ids() == [1, 2]
    quiet(h, [1, 2], 2)
    engine.finish(1)
    quiet(h, [1, 2], 2)
    engine.finish(1)
    bounded(h.feeder.wait_fed, {3, 4})
    assert h.ids() == [1, 2, 3, 4]
    idle(h)
    assert [h.copy_threads[i].startswith(FEED) for i in (3, 4)] == [True, True]
    put_ok(h, h.job(5, 60))
    assert h.ids()[-1] == 5 and h.copy_threads[5] == ME().name, "40 + 60 fits the open wave"
    put_ok(h, h.job(6, 1))
    quiet(h, [1, 2, 3, 4, 5], 1)
    engine.finish(2)  # jobs 3 and 4 done, 60 B in flight: still closed
    quiet(h, [1, 2, 3, 4, 5], 1)
    engine.finish(1)
    bounded(h.feeder.wait_fed, {6})
    until(lambda: h.ids()[-1] == 6, "job 6 in a wave of its own")
    assert h.engine_waves() == [[1, 2], [3, 4, 5], [6]]
    assert h.feeder.waves_started == 3 and h.feeder.enqueued_direct == 3
    assert h.feeder.take_failed() == [] and h.feeder.ran_dry == 0
    h.check()
    close(h)


def test_a_wave_refilled_by_a_direct_put_after_its_jobs_finished_is_a_new_wave(engine):
    """A wave of 90 B (jobs 1, 2) is done, nothing was put since: the queue is empty, so the
    next direct job (90 B) starts a new wave, where the bytes of the old one do not count."""
    h = WHarness(engine, 100)
    put_ok(h, h.job(1, 45))
    put_ok(h, h.job(2, 45))
    engine.finish_all()
    put_ok(h, h.job(3, 90))
    put_ok(h, h.job(4, 10))
    assert h.ids() == [1, 2, 3, 4] and h.direct_ids() == [1, 2, 3, 4]
    put_ok(h, h.job(5, 0))  # 100 B in the wave: 0 more fits
    assert h.ids()[-1] == 5
    put_ok(h, h.job(6, 1))
    quiet(h, [1, 2, 3, 4, 5], 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {6})
    assert h.feeder.waves_started == 3 and h.engine_waves() == [[1, 2], [3, 4, 5], [6]]
    h.check()
    close(h)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_failed_direct_enqueue_mid_wave_leaves_a_fresh_wave(engine, kind):
    """Job 1 (40 B) is in flight, job 2's direct enqueue (30 B, fits) fails (``kind``), job 3
    (20 B) is put behind it. Job 2 is listed once, after the stream was drained; job 3 starts a
    new wave (nothing of job 1 or 2 left on the engine); its wave counts 20 B only, so job 4
    (80 B) joins it directly, and job 5 (1 B) waits for that wave to end."""
    h = WHarness(engine, 100, plan={2: kind})
    put_ok(h, h.job(1, 40))
    put_ok(h, h.job(2, 30))
    put_ok(h, h.job(3, 20))
    bounded(h.feeder.wait_fed, {2, 3})
    assert h.feeder.take_failed() == [2] and engine.syncs == 1
    until(lambda: h.ids() == [1, 3], "job 3 after the drain (by either path)")
    idle(h)
    put_ok(h, h.job(4, 80))
    assert h.ids() == [1, 3, 4] and h.copy_threads[4] == ME().name, (
        f"{kind}: job 4 fits job 3's fresh wave (20 + 80) but was not enqueued directly")
    put_ok(h, h.job(5, 1))
    quiet(h, [1, 3, 4], 1)
    engine.finish(1)
    quiet(h, [1, 3, 4], 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {5})
    until(lambda: h.ids()[-1] == 5, "job 5")
    assert h.engine_waves() == [[1], [3, 4], [5]] and h.feeder.waves_started == 3
    assert h.feeder.take_failed() == [] and h.begins == {i: 1 for i in range(1, 6)}
    h.check()
    close(h)


@pytest.mark.parametrize("kind", BYTES_KINDS)
def test_a_failed_direct_enqueue_that_opened_a_wave_is_drained_before_the_next(engine, kind):
    """Job 1 (60 B) opens a wave directly, its copy call is held while jobs 2 (30 B) and 3 (30 B)
    are put (pending: the turn is held); then job 1's enqueue fails with its copies on the engine.
    The feeder drains them before job 2: jobs 2 and 3 make a fresh wave; nothing is enqueued
    behind job 1's bytes."""
    h = WHarness(engine, 100, plan={1: kind})
    g = h.gate(1)
    t, box = in_thread(h.feeder.put, h.job(1, 60))
    assert h.entered[1].wait(WAIT_S)
    put_ok(h, h.job(2, 30))
    put_ok(h, h.job(3, 30))
    g.set()
    join(t, "job 1's put")
    assert "e" not in box, box.get("e")
    bounded(h.feeder.wait_fed, {1, 2, 3})
    assert h.feeder.take_failed() == [1] and h.ids() == [2, 3]
    assert h.engine_waves() == [[2, 3]] and h.feeder.waves_started == 1
    h.check()
    close(h)


def test_an_event_query_error_in_a_direct_room_check_mid_wave(engine):
    """Job 1 is in flight; its end event's query then raises. Job 2 (a direct put that needs
    that query) is not raised out of put: it is listed after a drain. The wave state does not
    survive the drain: job 3 (95 B) goes directly into a new wave, job 4 (10 B) waits."""
    h = WHarness(engine, 100)
    put_ok(h, h.job(1, 50))
    until(lambda: h.ids() == [1], "job 1")
    engine.query_raises.add(1)
    put_ok(h, h.job(2, 10))
    bounded(h.feeder.wait_fed, {2})
    assert h.feeder.take_failed() == [2] and engine.job_drained(1)
    engine.query_raises.clear()
    idle(h)
    put_ok(h, h.job(3, 95))
    assert h.ids() == [1, 3] and h.copy_threads[3] == ME().name
    put_ok(h, h.job(4, 10))
    quiet(h, [1, 3], 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {4})
    until(lambda: h.ids() == [1, 3, 4], "job 4")
    assert h.feeder.waves_started == 3
    h.check()
    close(h)


@pytest.mark.parametrize("where", ["sync", "query"])
def test_an_error_while_waiting_for_a_wave_fails_one_job_and_the_next_wave_opens(engine, where):
    """Jobs 1 and 2 (40 B) make a wave; job 3 (40 B) does not fit, job 4 (40 B) is behind it.
    Waiting for the wave meets a CUDA error (job 2's end event's ``synchronize``, or job 1's
    ``query``): job 3 is listed after the drain, job 4 then opens a new wave by itself; a
    direct job 5 (60 B) fits job 4's wave, job 6 (1 B) does not."""
    h = WHarness(engine, 100)
    put_ok(h, h.job(1, 40))
    put_ok(h, h.job(2, 40))
    assert h.ids() == [1, 2]
    if where == "sync":
        engine.sync_raises.add(2)
    else:
        engine.query_raises.add(1)
    put_ok(h, h.job(3, 40))
    put_ok(h, h.job(4, 40))
    bounded(h.feeder.wait_fed, {3, 4})
    assert h.feeder.take_failed() == [3] and engine.syncs == 1
    assert engine.job_drained(1) and engine.job_drained(2)
    engine.sync_raises.clear()
    engine.query_raises.clear()
    until(lambda: h.ids() == [1, 2, 4], "job 4")
    idle(h)
    put_ok(h, h.job(5, 60))
    assert h.ids()[-1] == 5 and h.copy_threads[5] == ME().name
    put_ok(h, h.job(6, 1))
    quiet(h, [1, 2, 4, 5], 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {6})
    until(lambda: h.ids()[-1] == 6, "job 6")
    assert h.engine_waves() == [[1, 2], [4, 5], [6]] and h.feeder.waves_started == 3
    assert h.feeder.take_failed() == [] and h.feeder.ran_dry == 0
    h.check()
    close(h)


# -- jobs over the limit ------------------------------------------------------------------------


def test_jobs_over_the_limit_are_waves_of_their_own_on_both_paths(engine):
    """A job over the limit put on an empty queue goes directly, alone; a 0-byte job behind it
    waits (a wave over the limit is closed); one put while a wave is in flight waits for that
    wave to end, then goes alone."""
    h = WHarness(engine, 100)
    put_ok(h, h.job(1, 250))
    assert h.ids() == [1] and h.copy_threads[1] == ME().name
    put_ok(h, h.job(2, 0))
    quiet(h, [1], 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {2})
    until(lambda: h.ids() == [1, 2], "job 2")
    idle(h)
    put_ok(h, h.job(3, 50))  # joins job 2's (0 B) wave: 50 B
    assert h.ids() == [1, 2, 3] and h.copy_threads[3] == ME().name
    put_ok(h, h.job(4, 101))
    put_ok(h, h.job(5, 1))
    quiet(h, [1, 2, 3], 2)
    engine.finish_all()
    until(lambda: h.ids() == [1, 2, 3, 4], "job 4, alone")
    quiet(h, [1, 2, 3, 4], 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {5})
    until(lambda: h.ids() == [1, 2, 3, 4, 5], "job 5")
    assert h.engine_waves() == [[1], [2, 3], [4], [5]] and h.feeder.waves_started == 4
    h.check()
    close(h)


def test_a_wave_filled_exactly_takes_zero_byte_jobs_only(engine):
    h = WHarness(engine, 100, direct=False)
    g = h.gate(1)
    for i, n in ((1, 60), (2, 40), (3, 0), (4, 0), (5, 1), (6, 0)):
        put_ok(h, h.job(i, n))
    g.set()
    until(lambda: h.ids() == [1, 2, 3, 4], "the first wave, full")
    quiet(h, [1, 2, 3, 4], 2)
    engine.finish(3)
    quiet(h, [1, 2, 3, 4], 2)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {5, 6})
    assert h.engine_waves() == [[1, 2, 3, 4], [5, 6]]
    h.check()
    close(h)


# -- close and wait_fed during a wave -----------------------------------------------------------


@pytest.mark.parametrize("direct", [False, True])
def test_close_during_a_closed_wave_feeds_the_rest_in_waves_and_returns(engine, direct):
    """close while jobs wait for a wave to end: close does not skip the wave rule (nothing is
    enqueued beside the wave in flight), it returns once the rest are fed, and put is refused."""
    h = WHarness(engine, 100, direct=direct)
    for i in range(1, 6):
        put_ok(h, h.job(i, 40))
    until(lambda: h.ids() == [1, 2], "the first wave")
    c, cbox = in_thread(h.feeder.close)
    until(lambda: h.feeder._stop, "close began")
    with pytest.raises(RuntimeError, match="closed"):
        h.feeder.put(h.job(9, 1))
    engine.finish(1)
    quiet(h, [1, 2], 3)
    assert c.is_alive()
    engine.finish(1)
    until(lambda: h.ids() == [1, 2, 3, 4], "the second wave")
    quiet(h, [1, 2, 3, 4], 1)
    engine.finish_all()
    join(c, "close")
    assert "e" not in cbox
    assert h.ids() == [1, 2, 3, 4, 5] and h.feeder.pending() == 0
    assert h.engine_waves() == [[1, 2], [3, 4], [5]]
    h.check()


def test_wait_fed_on_a_job_held_by_a_closed_wave_returns_once_it_is_handed_over(engine):
    h = WHarness(engine, 100)
    for i in range(1, 4):
        put_ok(h, h.job(i, 40))
    w, wbox = in_thread(h.feeder.wait_fed, {3})
    time.sleep(QUIET_S)
    assert w.is_alive(), "wait_fed({3}) returned while job 3 waited for the wave"
    engine.finish(1)
    time.sleep(QUIET_S)
    assert w.is_alive(), "wait_fed({3}) returned while job 3 waited for the wave"
    engine.finish(1)
    join(w, "wait_fed({3})")
    assert "e" not in wbox and 3 in h.ids()
    engine.finish_all()
    h.check()
    close(h)


# -- growth in waves ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [False, True])
def test_a_punctual_feeder_never_grows_in_waves(engine, direct):
    """The engine finishes a wave exactly when the feeder waits for it (punctual): the queue is
    emptied on purpose each time, never found dry. Many waves, no growth."""
    engine.punctual = True
    h = WHarness(engine, 100, grow_to=800, direct=direct)
    burst_from_a_thread_behind_a_gate(h, 40, 30, direct)
    assert h.feeder.ran_dry == 0 and h.feeder.limit == 100, (
        f"ran_dry {h.feeder.ran_dry}, limit {h.feeder.limit}: a wave drained on purpose grew it")
    assert all(len(w) <= 3 for w in h.engine_waves())
    h.check()
    close(h)


def test_a_late_feeder_in_waves_grows_by_exactly_the_late_returns(engine):
    """Punctual engine, but after jobs 2 and 9 are handed over the engine drains everything
    (the feeder comes back late, to an empty queue, while jobs wait): exactly those two count,
    the limit doubles at the next wave's start and never mid-wave; waves then hold more."""
    engine.punctual = True
    engine.late_after = {2, 9}
    h = WHarness(engine, 100, grow_to=400, direct=False)
    g = h.gate(1)
    n = 30
    for i in range(1, n + 1):
        put_ok(h, h.job(i, 30))
    g.set()
    bounded(h.feeder.wait_fed, set(range(1, n + 1)))
    until(lambda: len(h.ids()) == n, "all handed over")
    assert h.ids() == list(range(1, n + 1))
    assert h.feeder.ran_dry == 2 and h.feeder.limit == 400
    waves = h.engine_waves()
    assert waves[0] == [1, 2] and waves[1][0] == 3, waves
    assert [c[2] for c in h.copies if c[0] == 3] == [200]
    assert nondecreasing([c[2] for c in h.copies])
    assert h.feeder.waves_started == len(waves)
    h.check()
    close(h)


def test_growth_while_a_direct_wave_is_in_flight_does_not_change_its_limit(engine):
    """An instant engine (the feeder is always late) grows the limit on the feeder thread; a
    direct wave after that is bounded by the grown limit, consistently for all its jobs."""
    engine.instant = True
    h = WHarness(engine, 100, grow_to=400)
    burst_behind_a_held_direct_put(h, 8, 50)
    assert h.feeder.limit == 400
    idle(h)
    engine.instant = False
    for i in range(10, 18):
        put_ok(h, h.job(i, 50))
    assert [i for i in range(10, 18) if h.copy_threads.get(i) == ME().name] == list(
        range(10, 18)), "eight 50-byte jobs fit a 400-byte wave"
    put_ok(h, h.job(18, 1))
    quiet(h, h.ids(), 1)
    engine.finish_all()
    bounded(h.feeder.wait_fed, {18})
    engine.finish_all()
    h.check()
    close(h)


# -- randomized ---------------------------------------------------------------------------------


def _wave_run(engine: WEngine, seed: int, **kw) -> Run:
    """A ``Run`` (tests/test_feeder_direct_hostile.py) over a recording waves harness."""
    run = Run(engine, seed, waves=True, **kw)
    # swap in the recording harness before anything is put (Run built its own; drop it)
    old = run.h
    bounded(old.feeder.close)
    engine.feeders.remove(old.feeder)
    run.h = WHarness(engine, run.limit0, grow_to=run.grow_to, plan=run.plan, jitter=True)
    run.jobs = {i: run.h.job(i, s) for i, s in run.specs.items()}
    return run


@pytest.mark.parametrize("seed", _seeds(7001, 4))
@pytest.mark.parametrize("serialize", [True, False])
def test_random_waves_limit_never_changes_mid_wave_and_waves_are_counted(engine, seed, serialize):
    """Random putters in waves, every failure kind, a pumping engine: besides ``Run.check``
    (order, once each, the wave rule on the engine), the limit is the same for every job of a
    wave the engine saw, ``waves_started`` never exceeds the waves the engine saw begin, and a
    queue run dry is only ever counted on the feeder thread."""
    run = _wave_run(engine, seed, putters=3, per=250, kinds=ALL_KINDS, fail_rate=0.08,
                    limit=64, grow_to=1024)
    putters_checked(run, serialize, 13)
    h = run.h
    h.check()
    feeder_starts = sum(1 for (i, ahead, _) in h.copies
                        if ahead == 0 and h.copy_threads[i].startswith(FEED))
    assert h.feeder.ran_dry <= feeder_starts + len(run.collected)


@pytest.mark.parametrize("seed", _seeds(8001, 4))
def test_random_waves_in_a_deterministic_engine_count_every_wave(engine, seed):
    """One putter; the feeder's waits finish the wave they wait for (punctual), and the test
    finishes the engine's work at random points between puts, only while no enqueue is in
    progress (under the feeder's lock, no turn held), so every wave boundary is known to both.
    waves_started equals the waves the engine saw, each wave holds at most the limit (or one
    job, or ends in 0-byte jobs), the order holds and nothing fails."""
    engine.punctual = True
    rng = random.Random(seed)
    h = WHarness(engine, 100, direct=rng.random() < 0.7)
    ids = list(range(1, 301))
    sizes = {i: rng.choice([0, 1, 10, 30, 50, 99, 100, 101, 250]) for i in ids}

    def finish(n: int) -> None:
        with h.feeder._cond:
            if not h.feeder._enqueuing:
                engine.finish(n)

    for i in ids:
        put_ok(h, h.job(i, sizes[i]))
        r = rng.random()
        if r < 0.2:
            finish(1 << 30)
        elif r < 0.6:
            finish(rng.randint(1, 3))
        if rng.random() < 0.3:
            time.sleep(0.0005)
    bounded(h.feeder.wait_fed, set(ids))
    until(lambda: len(h.ids()) == len(ids), "all handed over")
    assert h.ids() == ids and h.feeder.take_failed() == []
    waves = h.engine_waves()
    for w in waves:
        total = sum(sizes[i] for i in w)
        assert total <= 100 or len(w) == 1, f"wave {w} of {total} B"
    assert h.feeder.waves_started == len(waves), (
        f"waves_started {h.feeder.waves_started}, the engine saw {len(waves)}")
    h.check()
    close(h)


@pytest.mark.parametrize("seed", _seeds(9001, 4))
def test_random_close_racing_puts_in_waves(engine, seed):
    """Putters put at will while close runs, in waves, failures of every kind: every put that
    returned is handed over or listed exactly once, a refused put is neither, the wave rule
    holds on the engine through the close, the thread stops."""
    run = _wave_run(engine, seed, putters=3, per=300, kinds=ALL_KINDS, fail_rate=0.1)
    close_racing_putters(run, seed, 0.1)
    run.h.check()
