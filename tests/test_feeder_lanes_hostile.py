"""Hostile tests of CopyFeeder's waves over two load streams (backends/copy_feeder.py,
``waves=True``, ``wave_streams``: lanes).

The rule: a job joins the open wave (the newest, on its lane) while that wave's bytes and its own
stay within ``limit``; otherwise it begins a new wave on a lane with nothing in flight (the open
wave closes; a job over the limit is a wave of its own). So at most two waves are in flight, a
job never joins a closed wave, and the limit never changes inside a wave. That holds for put's
direct path and the feeder thread alike, through failures of every kind (each drains both lanes
before the job is listed).

The stand-in engine is the strict one of tests/test_feeder_direct_hostile.py (every piece of
work an ``Op``, the turn and ``started`` checked there), with an op per lane: an end event
completes after the last op of its own stream, a stream's ``synchronize`` finishes only its own
ops, and the pump finishes the work of one lane at a time, either one, so the two streams end in
any order. The harness judges every copy by what the engine holds as it goes on: a job on the
lane of the job before it, that lane still busy, joins that wave; any other job begins a wave,
and its lane must be empty. Every wait is bounded: a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import random
import time

import pytest
from test_feeder_direct_hostile import (
    ALL_KINDS,
    WAIT_S,
    Engine,
    Event,
    Harness,
    Op,
    Run,
    Stream,
    _seeds,
    bounded,
    burst_from_a_thread_behind_a_gate,
    close,
    close_racing_putters,
    put_ok,
    putters_checked,
    release,
    until,
)

LANES = 2


class LaneEngine(Engine):
    """Ops on two streams: each stream's complete in order, the two in any order."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.lane_syncs = [0] * LANES  # synchronize calls per stream
        self.punctual = False  # an end event's synchronize finishes its stream through it
        self.late_waits: set[int] = set()  # punctual, but these waits (1, 2, ...) end everything
        self.waits = 0

    def finish(self, n: int) -> None:
        """Complete the first n unfinished ops of one stream, picked at random among the busy
        ones (``finish_all`` completes both)."""
        everything = n >= 1 << 30
        with self.lock:
            busy = sorted({o.lane for o in self.ops if not o.done.is_set()})
            lane = self.rng.choice(busy) if busy and not everything else None
            for o in [o for o in self.ops if not o.done.is_set()
                      and (everything or o.lane == lane)][:n]:
                o.done.set()

    def finish_lane(self, lane: int, through: Op | None = None) -> None:
        with self.lock:
            for o in self.ops:
                if o.lane == lane:
                    o.done.set()
                    if o is through:
                        break


class LaneStream(Stream):
    def synchronize(self) -> None:
        eng = self.h.engine
        assert isinstance(eng, LaneEngine)
        with eng.lock:
            # drains are counted once per failure (Run.check): lane 0's here, each lane's apart
            eng.syncs += self.lane == 0
            eng.lane_syncs[self.lane] += 1
        if eng.stream_broken:
            raise RuntimeError("CUDA error: the load stream is broken")
        eng.finish_lane(self.lane)


class LaneEvent(Event):
    def synchronize(self) -> None:
        eng = self.h.engine
        if getattr(eng, "punctual", False) and self.op is not None:
            eng.waits += 1
            if eng.waits in eng.late_waits:  # the feeder comes back after both lanes ended
                eng.finish_all()
            else:  # the stream's work ends as it is waited for, the other one's goes on
                eng.finish_lane(self.op.lane, self.op)
        super().synchronize()


class LHarness(Harness):
    """A waves feeder over two lanes, judging each copy against the engine's two streams."""

    stream_cls = LaneStream

    def __init__(self, engine: LaneEngine, limit: int, **kw) -> None:
        kw.setdefault("waves", True)
        kw.setdefault("lanes", LANES)
        self._last_lane = -1  # the lane of the last job's copies: the open wave's
        self._wave_bytes = 0  # bytes of the open wave
        self._wave_limit = 0  # the limit when it began
        self.waves_seen = 0
        self.wave_lanes: list[int] = []  # the lane each wave began on
        self.max_in_flight = 0  # waves with copies unfinished on the engine, at most
        super().__init__(engine, limit, **kw)
        self.feeder.torch.cuda.Event = (
            lambda enable_timing=False, blocking=False: LaneEvent(self, enable_timing, blocking))

    def admit(self, job_id: int, nbytes: int, stream: int) -> None:
        lane, limit = stream - 0x99, self.feeder.limit
        with self.engine.lock:
            live = [o for o in self.engine.ops if not o.done.is_set()]
        busy = any(o.lane == lane for o in live)
        if lane == self._last_lane and busy:  # on the open wave's lane, still copying: joins
            if self._wave_bytes + nbytes > limit:
                self.violations.append(f"job {job_id} ({nbytes} B) joined a wave of "
                                       f"{self._wave_bytes} B, limit {limit}")
            if limit != self._wave_limit:
                self.violations.append(f"job {job_id} joined a wave begun under limit "
                                       f"{self._wave_limit}, now {limit}")
            self._wave_bytes += nbytes
        else:  # a new wave: only on a lane with nothing in flight
            if busy:
                self.violations.append(f"job {job_id} began a wave on lane {lane}, which still "
                                       f"had copies in flight (open wave on lane "
                                       f"{self._last_lane})")
            self.waves_seen += 1
            self.wave_lanes.append(lane)
            self._wave_bytes, self._wave_limit = nbytes, limit
        waves = {o.wave for o in live} | {self.waves_seen}
        self.max_in_flight = max(self.max_in_flight, len(waves))
        if len(waves) > LANES:
            self.violations.append(f"job {job_id}: {len(waves)} waves in flight")
        self._last_lane = lane
        self.limits.append(limit)

    def put_op(self, op: Op, stream: int) -> None:
        op.lane = stream - 0x99
        op.wave = self.waves_seen
        self.engine.add(op)

    def last_op(self, stream: object) -> Op | None:
        lane = getattr(stream, "lane", 0)
        with self.engine.lock:
            mine = [o for o in self.engine.ops if o.lane == lane]
        return mine[-1] if mine else None


@pytest.fixture
def engine():
    eng = LaneEngine()
    yield eng
    eng.punctual = True
    release(eng)


def _lane_run(engine: LaneEngine, seed: int, **kw) -> Run:
    """A ``Run`` (tests/test_feeder_direct_hostile.py) over the two-lane harness."""
    engine.rng.seed(seed)
    run = Run(engine, seed, waves=True, **kw)
    old = run.h  # Run built a one-stream harness: drop it before anything is put
    bounded(old.feeder.close)
    engine.feeders.remove(old.feeder)
    run.h = LHarness(engine, run.limit0, grow_to=run.grow_to, plan=run.plan, jitter=True)
    run.jobs = {i: run.h.job(i, s) for i, s in run.specs.items()}
    return run


def check(run: Run, eng: LaneEngine) -> None:
    h = run.h
    assert isinstance(h, LHarness)
    assert h.violations == [], h.violations[:5]
    assert eng.lane_syncs == [len(run.collected)] * LANES, (
        f"drains per lane {eng.lane_syncs}, failures {len(run.collected)}: not both lanes")
    assert h.feeder.waves_started <= h.waves_seen


@pytest.mark.parametrize("direct", [False, True])
def test_a_punctual_feeder_on_two_lanes_alternates_and_grows_only_when_both_lanes_ended(
        engine, direct):
    """The engine ends a lane's work exactly when the feeder waits for it (punctual): the open
    wave on the other lane still copies each time, so the limit never grows there; the feeder
    waits for the oldest wave, so waves take the lanes in turn, two in flight. At waits 3 and 7
    the engine ends both lanes' work (the open wave ended too while the feeder was away): exactly
    those two grow the limit (100, 200, 400), each at a wave's start."""
    engine.punctual = True
    engine.late_waits = {3, 7}
    h = LHarness(engine, 100, grow_to=800, direct=direct)
    burst_from_a_thread_behind_a_gate(h, 60, 30, direct)
    assert h.violations == [], h.violations[:5]
    assert h.feeder.ran_dry == 2 and h.feeder.limit == 400, (
        f"ran_dry {h.feeder.ran_dry}, limit {h.feeder.limit}: grown by other waits than 3, 7")
    assert h.wave_lanes == [k % 2 for k in range(len(h.wave_lanes))], (
        f"waves' lanes {h.wave_lanes}: not in turn (a wait for other than the oldest wave)")
    assert h.feeder.waves_started == h.waves_seen and h.max_in_flight == LANES
    close(h)


@pytest.mark.parametrize("seed", _seeds(11001, 3))
@pytest.mark.parametrize("serialize", [True, False])
def test_random_two_lane_waves_with_every_failure_kind(engine, seed, serialize):
    """Three putters, failures of every kind, a pump ending one stream's work at a time: besides
    ``Run.check`` (order, once each, each failure listed after its drain, the limit's growth),
    no job joins a closed wave or a wave past the limit, a wave begins only on an empty lane, at
    most two are in flight (and two were), and each failure drained both lanes."""
    run = _lane_run(engine, seed, putters=3, per=250, kinds=ALL_KINDS, fail_rate=0.08,
                    limit=64, grow_to=1024)
    putters_checked(run, serialize, 13)
    check(run, engine)
    assert run.h.max_in_flight == LANES, "never two waves in flight: the lanes were not used"


@pytest.mark.parametrize("seed", _seeds(12001, 3))
def test_random_close_racing_puts_on_two_lanes(engine, seed):
    """Putters put at will while close runs, failures of every kind: every put that returned is
    handed over or listed once, the lane rule holds through the close, the thread stops."""
    run = _lane_run(engine, seed, putters=3, per=300, kinds=ALL_KINDS, fail_rate=0.1)
    close_racing_putters(run, seed, 0.1)
    check(run, engine)


@pytest.mark.parametrize("seed", _seeds(13001, 3))
def test_random_two_lane_waves_in_a_deterministic_engine_count_every_wave(seed):
    """One putter; the feeder's waits end the lane they wait for (punctual), the test ends one
    lane's work at random points between puts, only while no enqueue is in progress, so every
    wave boundary is known to both: ``waves_started`` equals the waves the engine saw begin,
    each within the rule, in order, nothing failed."""
    eng = LaneEngine(seed)
    eng.punctual = True
    rng = random.Random(seed)
    try:
        h = LHarness(eng, 100, direct=rng.random() < 0.7)
        ids = list(range(1, 301))
        for i in ids:
            put_ok(h, h.job(i, rng.choice([0, 1, 10, 30, 50, 99, 100, 101, 250])))
            r = rng.random()
            if r < 0.5:
                with h.feeder._cond:
                    if not h.feeder._enqueuing:
                        if r < 0.1:
                            eng.finish_all()
                        else:
                            eng.finish(rng.randint(1, 3))
            if rng.random() < 0.3:
                time.sleep(0.0005)
        bounded(h.feeder.wait_fed, set(ids))
        until(lambda: len(h.ids()) == len(ids), "all handed over", timeout=WAIT_S)
        assert h.ids() == ids and h.feeder.take_failed() == []
        assert h.violations == [] and h.overlaps == [], (h.violations + h.overlaps)[:5]
        assert h.feeder.waves_started == h.waves_seen, (
            f"waves_started {h.feeder.waves_started}, the engine saw {h.waves_seen}")
        assert h.max_in_flight == LANES
        close(h)
    finally:
        release(eng)
