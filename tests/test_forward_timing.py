"""Steps timed by the worker's forward passes (CPU tier ``step_timing`` "forward", the default
under ``TieredOffloadingConnector``; ``tiering/vllm/forward_timer.py``).

1. the step clock fed by the engine model of ``tests/async_engine.py`` whose worker reports each
   step's GPU span as our connector does: each prompt step is one sample of exactly its GPU
   time, in every scheduling order, with launches that hold the scheduler thread or not, and
   the two limits of the outputs' clock (``tests/test_step_runs_hostile.py``'s strict xfails)
   are gone;
2. bad reports (unknown, repeated, not a number) and a worker that never reports;
3. ``ForwardTimer`` on the CPU clock and over events that complete late, and one that fails;
4. the metadata in both directions through vLLM's own types and our connector's hooks, with a
   real manager of our spec (pickled between them, as vLLM's executor does).

The end-to-end check (a real vLLM server whose steps are timed so) is in
``tests/test_vllm_e2e.py``; the CUDA events run in the GPU tests."""

from __future__ import annotations

import logging
import math
import pickle
import random

import pytest
from async_engine import (
    BUDGET,
    E32,
    FREE,
    LAUNCHES,
    ORDERS,
    gpu_costs,
    packed_step,
    serve_recorded,
)

import tiering.backends.staging as staging
from tiering.advisor import PromotionAdvisor
from tiering.settings import (
    ADVISOR_FORWARD_PENDING_LIMIT,
    ADVISOR_LOAD_STEPS,
    ADVISOR_MIN_SAMPLE_TOKENS,
    ADVISOR_MODEL_WINDOW,
)

ROW = 8192
CHUNK = 64
E8 = (0.01, 2e-5, 7e-9)  # the 8B shape's order of magnitude


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def advisor(order: str = "async", forward: bool = True) -> PromotionAdvisor:
    after_end, asynchronous = ORDERS[order]
    return PromotionAdvisor(1, ROW, CHUNK, step_lag=int(asynchronous) - int(after_end),
                            tokens_after_end=after_end, step_forward=forward)


def chunks(n: int, k: int = 0) -> list[list[tuple[int, int]]]:
    return [[(s, min(n, s + BUDGET))] for s in range(k, n, BUDGET)]


def serve(adv, steps, costs, launch: str, order: str = "async", **kw):
    """``serve_recorded`` with the worker timing the forward passes (its unreported steps kept
    on the advisor between calls, as the worker keeps its timer)."""
    after_end, asynchronous = ORDERS[order]
    worker = adv.__dict__.setdefault("_test_worker", [])
    return serve_recorded(adv, steps, gpu_costs(*costs), *LAUNCHES[launch],
                          depth=2 if asynchronous else 1, after_end=after_end, worker=worker, **kw)


def random_period(rng: random.Random) -> list[list[tuple[int, int]]]:
    """A busy period: decode steps, prompts of one step (several packed in a step), chunked
    long prompts, a few tokens of a decoding request."""
    steps: list[list[tuple[int, int]]] = []
    for _ in range(rng.randint(1, 6)):
        steps += [[] for _ in range(rng.choice((0, 1, 2, 5)))]
        kind = rng.random()
        if kind < 0.45:
            steps += chunks(rng.choice((2048, 8192, 32768, 40000)), rng.choice((0, 0, 1024)))
        elif kind < 0.8:
            steps.append(packed_step(rng))
        else:
            k = rng.choice((100, 3000))
            steps.append([(k, k + rng.choice((1, 3, 70)))])
    return steps + [[], []]


def samples(adv: PromotionAdvisor) -> list[tuple[float, float, float, float]]:
    return list(adv.prefill._steps)  # noqa: SLF001


def fit_of(adv: PromotionAdvisor) -> tuple[float, float, float]:
    return adv.prefill.c, adv.prefill.a, adv.prefill.b


# -- 1. each prompt step one sample of its GPU time -----------------------------------------------

@pytest.mark.parametrize("launch", ["blocking", "free"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_each_reported_prompt_step_is_one_sample_of_its_gpu_span(order, launch):
    """Mixed serving with idle gaps: once the worker reported a step, the model's samples are
    the reported prompt steps (at least ``ADVISOR_MIN_SAMPLE_TOKENS`` tokens), each with its own
    tokens, attention term and GPU seconds, one step each, in step order; the outputs add none."""
    rng = random.Random(f"{order} {launch}")
    adv = advisor(order)
    recs, t = [], 0.0
    for _ in range(10):
        rs, t = serve(adv, random_period(rng), E32, launch, order, start=t + rng.uniform(0.01, 2))
        recs += rs
    reported = {n for r in recs for n in r.report}
    assert adv.clock.by_forward
    # every step reported once its GPU span ended, except the last ones (no later step's
    # output to carry them yet)
    unreported = [r for r in recs if r.number not in reported]
    assert unreported == recs[len(recs) - len(unreported):] and len(unreported) <= 2
    want = [(r.tokens, r.attention, r.g, 1.0) for r in recs
            if r.number in reported and r.tokens >= ADVISOR_MIN_SAMPLE_TOKENS]
    got = samples(adv)
    n = min(len(want), ADVISOR_MODEL_WINDOW)
    assert n >= 10
    assert len(got) >= n
    for g, w in zip(got[-n:], want[-n:], strict=True):
        assert g == pytest.approx(w, rel=1e-12)


@pytest.mark.parametrize("launch", ["blocking", "free"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("costs", [E32, E8], ids=["32b", "8b"])
def test_the_fit_prices_prompts_and_a_loads_extra_steps_as_the_gpu_runs_them(order, launch,
                                                                              costs):
    """The phases' prompts (a 32k one chunked), decode steps between: 2k to 32k prices within
    2% and the step cost within 10% of the engine's, so a load's extra steps cost what they
    do."""
    c, a, b = costs
    adv = advisor(order)
    t = 0.0
    for n in (64, 2048, 8192, 32768, 4096, 16384, 2048, 8192, 32768):
        _, t = serve(adv, chunks(n) + [[]] * 5, costs, launch, order, start=t + 1.0)
    for n in (2048, 8192, 32768):
        truth = a * n + b * n * n / 2
        assert adv.prefill.seconds(0, n) == pytest.approx(truth, rel=0.02), (n, fit_of(adv))
    assert adv.prefill.step_cost is None
    assert adv.prefill.c == pytest.approx(c, rel=0.1), fit_of(adv)
    assert adv.load_overhead() == pytest.approx(ADVISOR_LOAD_STEPS * c, rel=0.1)


def test_a_prefill_behind_a_decode_step_is_its_own_gpu_time():
    """The outputs' first limit (xfail ``test_a_prefill_behind_a_decode_step_is_timed_from_its_
    gpu_start``): B's 2048-token step, scheduled while A's decode step runs, is sampled at
    exactly its GPU time, not with the rest of A's step in it."""
    adv = advisor()
    recs, _ = serve(adv, [[], [], [], [(0, 2048)], [], []], E32, "free", start=1.0)
    prefill = recs[3]
    assert prefill.gstart - prefill.sched == pytest.approx(E32[0], abs=0.002)  # waited for A
    (sample,) = samples(adv)
    assert sample == pytest.approx((2048.0, 2048.0 ** 2 / 2, prefill.g, 1.0))


def test_chunked_prompts_under_blocking_launches_keep_the_step_cost():
    """The outputs' second limit (xfail of the same name in ``test_step_runs_hostile.py``):
    prompts chunked at 16384 tokens, launches holding the thread half a step; the step cost
    and a load's extra steps are the engine's."""
    adv = advisor()
    t = 0.0
    for n in (64, 2048, 8192, 32768, 2048, 8192, 32768, 8192):
        _, t = serve(adv, chunks(n) + [[]] * 7, E32, "blocking", start=t + 1.0)
    assert adv.prefill.c == pytest.approx(E32[0], rel=0.1)
    assert adv.load_overhead() == pytest.approx(ADVISOR_LOAD_STEPS * E32[0], rel=0.1)


def test_the_32b_8k_ram_disk_hit_is_loaded():
    """H100, 32B, the RAM disk (2026-12-06e): recomputing 8k took 1.50 s, vLLM's fs tier loaded
    it in 0.62-0.66 s (4 GiB/s or more). Timed by the steps' ends the fit priced recomputing at
    0.62 s and recomputed it; timed by the forward passes it loads it, and recomputes a
    64-token tail it cannot win on."""
    adv = advisor()
    t = 0.0
    for n in (64, 2048, 8192, 2048, 8192):  # the phases' warm-up, cold and recompute prompts
        _, t = serve(adv, chunks(n) + [[]] * 7, E32, "blocking", start=t + 1.0)
    row = 256 * 1024 * CHUNK  # 32B: 256 KiB of KV a token
    adv.row_bytes = row
    adv.observe_read_batch(1, 64 * row, 64 * row / 4e9, full=True)
    adv.observe_load(1, 0.5, 0.5 + 2 * E32[0])
    d8k = adv.decide([1] * (8192 // CHUNK), 0, 8192)
    c, a, b = E32
    assert d8k.load and d8k.recompute_s == pytest.approx(a * 8192 + b * 8192 ** 2 / 2,
                                                         rel=0.05), d8k
    assert not adv.decide([1], 8192, 8192 + CHUNK).load


# -- 2. bad reports, no reports -----------------------------------------------------------------

def _numbered(adv: PromotionAdvisor, tokens: int) -> int:
    adv.computes(0, tokens)
    adv.step_end(1.0)
    number = adv.forward_step()
    assert number is not None
    return number


@pytest.mark.parametrize("bad", [math.nan, -0.001, math.inf, "0.2", None, True, [0.2]])
def test_a_time_that_is_not_a_finite_non_negative_number_is_no_sample(bad):
    adv = advisor()
    number = _numbered(adv, 4096)
    adv.forward_times({number: bad})
    assert samples(adv) == [] and not adv.clock.by_forward
    adv.forward_times({number: 0.2})  # taken already: its number is not reported twice
    assert samples(adv) == []


def test_unknown_and_repeated_numbers_are_ignored_and_a_report_is_taken_in_step_order():
    adv = advisor()
    first, second = _numbered(adv, 4096), _numbered(adv, 8192)
    adv.forward_times({second + 50: 1.0, -1: 1.0})
    assert samples(adv) == [] and not adv.clock.by_forward
    adv.forward_times({second: 0.4, first: 0.2})
    got = samples(adv)
    assert len(got) == 2
    assert got[0][:3] == pytest.approx((4096, 4096 ** 2 / 2, 0.2))
    assert got[1][:3] == pytest.approx((8192, 8192 ** 2 / 2, 0.4))
    adv.forward_times({first: 9.0, second: 9.0})  # another rank's late report of both
    assert len(samples(adv)) == 2


def test_a_worker_that_stops_reporting_keeps_a_bounded_record():
    adv = advisor()
    numbers = [_numbered(adv, 2048) for _ in range(5 * ADVISOR_FORWARD_PENDING_LIMIT)]
    assert len(adv.clock._forward_steps) == ADVISOR_FORWARD_PENDING_LIMIT  # noqa: SLF001
    adv.forward_times({numbers[0]: 0.1})  # dropped long ago: no sample
    assert samples(adv) == []
    adv.forward_times({numbers[-1]: 0.1})
    assert len(samples(adv)) == 1


def test_without_reports_the_clock_times_by_the_outputs_as_before():
    """A worker that never reports (vLLM's own connector): the same samples as a clock that
    does not time forward passes at all."""
    runs = []
    for forward in (True, False):
        adv = advisor(forward=forward)
        rng = random.Random(3)
        t = 0.0
        for _ in range(6):
            _, t = serve_recorded(adv, random_period(rng), gpu_costs(*E32), *FREE,
                                  start=t + rng.uniform(0.05, 1.0))
        runs.append(samples(adv))
    assert runs[0] == runs[1] and len(runs[0]) >= 5


def test_a_clock_not_timing_forward_passes_numbers_no_step():
    adv = advisor(forward=False)
    adv.computes(0, 4096)
    adv.step_end(1.0)
    assert adv.forward_step() is None
    adv.forward_times({0: 0.2})
    assert samples(adv) == [] and not adv.clock.by_forward


def test_once_timed_by_forward_passes_the_outputs_add_no_sample():
    adv = advisor()
    number = _numbered(adv, 4096)
    adv.forward_times({number: 0.2})
    assert len(samples(adv)) == 1
    for n in (8192, 16384):  # prompt steps whose times never come: their outputs time nothing
        adv.computes(0, n)
        adv.step_end(2.0)
        adv.forward_step()
        adv.step_output(3.0)
    adv.step_output(4.0)
    assert len(samples(adv)) == 1


def test_a_restored_step_cost_gives_way_to_the_forward_fit():
    adv = advisor()
    adv.prefill.step_cost = 0.5  # as restored from a state saved by an outputs-timed engine
    number = _numbered(adv, 4096)
    adv.forward_times({number: 0.2})
    assert adv.prefill.step_cost is None and adv.prefill.c <= 0.2


# -- 3. the worker's timer -----------------------------------------------------------------------

class _Event:
    """What the timer asks of a CUDA event: done yet, and the span to another event."""

    def __init__(self, at: float, clock: list[float]) -> None:
        self.at, self.clock = at, clock

    def query(self) -> bool:
        return self.clock[0] >= self.at

    def elapsed_time(self, end: _Event) -> float:
        assert self.query() and end.query()
        return (end.at - self.at) * 1000.0


def test_the_timer_on_the_cpu_clock(monkeypatch):
    from tiering.vllm import forward_timer

    ticks = iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125, 3.25])
    monkeypatch.setattr(forward_timer.time, "perf_counter", lambda: next(ticks))
    t = forward_timer.ForwardTimer(cuda=False)
    t.end()  # nothing begun: nothing to end
    assert t.finished() == {}
    t.begin(7)
    t.end()
    t.begin(8)
    t.end()
    assert t.finished() == {7: 0.25, 8: 0.5}
    assert t.finished() == {}
    t.begin(9)
    t.begin(10)  # a step begun without its end (a no-forward step): the later one counts
    t.end()
    assert t.finished() == {10: 0.125}


def test_the_timer_reports_a_step_only_once_its_end_event_completed(monkeypatch):
    from tiering.vllm import forward_timer

    gpu = [0.0]
    marks = iter([0.0, 0.4, 0.4, 1.4, 1.4, 1.5])  # three steps back to back on the GPU
    t = forward_timer.ForwardTimer(cuda=True)
    monkeypatch.setattr(t, "_mark", lambda: _Event(next(marks), gpu))
    for number in (0, 1, 2):
        t.begin(number)
        t.end()
    assert t.finished() == {}
    gpu[0] = 1.45  # steps 0 and 1 done, 2 running
    assert t.finished() == pytest.approx({0: 0.4, 1: 1.0})
    gpu[0] = 2.0
    assert t.finished() == pytest.approx({2: 0.1})


def test_a_hung_stream_keeps_a_bounded_record(monkeypatch):
    from tiering.vllm import forward_timer

    gpu = [0.0]
    t = forward_timer.ForwardTimer(cuda=True)
    marks = iter(1.0 + 0.001 * i for i in range(10 ** 6))  # each a millisecond after the last
    monkeypatch.setattr(t, "_mark", lambda: _Event(next(marks), gpu))
    for number in range(3 * forward_timer.PENDING_LIMIT):
        t.begin(number)
        t.end()
        assert t.finished() == {}
    gpu[0] = 2.0
    done = t.finished()
    assert sorted(done) == list(range(2 * forward_timer.PENDING_LIMIT,
                                      3 * forward_timer.PENDING_LIMIT))


def test_a_timer_that_fails_logs_once_stops_and_never_raises(monkeypatch, caplog):
    from tiering.vllm import forward_timer

    t = forward_timer.ForwardTimer(cuda=True)

    def broken():
        raise RuntimeError("no CUDA context")
    monkeypatch.setattr(t, "_mark", broken)
    with caplog.at_level(logging.WARNING, logger=forward_timer.__name__):
        for number in range(5):
            t.begin(number)
            t.end()
            assert t.finished() == {}
    warnings = [r for r in caplog.records if "timing the forward passes failed" in r.message]
    assert len(warnings) == 1


# -- 4. through vLLM's metadata and our connector's hooks --------------------------------------

vllm = pytest.importorskip("vllm")


def _spec_manager(tmp_path, engine: str, **cpu):
    from test_vllm_spec import config, good

    from tiering.vllm import TieredOffloadingSpec

    extra = good(tmp_path)
    extra["tiers"][0].update(cpu)
    return TieredOffloadingSpec(config(extra, engine=engine)).get_manager()


def test_the_worker_metadata_keeps_vllms_fields_and_aggregates_ranks_by_the_slowest():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    from tiering.vllm.forward_timer import StepTimedWorkerMetadata

    theirs = OffloadingWorkerMetadata()
    theirs.mark_completed(11)
    ours = StepTimedWorkerMetadata.wrap(theirs, {3: 0.5, 4: 0.25})
    assert ours.completed_jobs == {11: 1} and ours.transfer_stats is theirs.transfer_stats
    other = StepTimedWorkerMetadata.wrap(None, {3: 0.75, 5: 0.125})
    other.mark_completed(11)
    merged = ours.aggregate(other)
    assert isinstance(merged, StepTimedWorkerMetadata)
    assert merged.completed_jobs == {11: 2}  # vLLM counts a job once per rank
    assert merged.step_seconds == {3: 0.75, 4: 0.25, 5: 0.125}
    plain = OffloadingWorkerMetadata()
    plain.mark_completed(12)
    merged = ours.aggregate(plain)  # a rank with no time to report this step
    assert merged.completed_jobs == {11: 1, 12: 1} and merged.step_seconds == {3: 0.5, 4: 0.25}
    back = pickle.loads(pickle.dumps(merged))
    assert back == merged and isinstance(back, StepTimedWorkerMetadata)


def test_a_step_number_rides_to_the_worker_and_its_time_back_to_our_advisor(tmp_path):
    """Our connector's four hooks with vLLM's metadata types and a real manager of our spec:
    the scheduler side numbers the step, the worker times it (CPU clock) and reports it in
    vLLM's worker metadata, pickled both ways as between vLLM's processes; the advisor takes it
    as a sample, and vLLM's own handling of the worker metadata still runs."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from tiering.vllm import TieredOffloadingConnector
    from tiering.vllm.forward_timer import ForwardTimer, StepTimedWorkerMetadata

    manager = _spec_manager(tmp_path, "forward-hooks")
    try:
        adv = manager.chain.advisor
        assert adv is not None and adv.clock.forward
        handed: list = []
        scheduler = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
        scheduler._awaiting_first_token = {}
        scheduler.connector_worker = None
        scheduler.connector_scheduler = SimpleNamespace(
            manager=manager,
            build_connector_meta=lambda out: OffloadingConnectorMetadata({}, {}),
            update_connector_output=handed.append)
        worker = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
        worker._awaiting_first_token = {}
        worker.connector_scheduler = None
        theirs = OffloadingWorkerMetadata()
        theirs.mark_completed(5)
        worker.connector_worker = SimpleNamespace(build_connector_worker_meta=lambda: theirs)
        worker._connector_metadata = None
        worker._forward_timer = ForwardTimer(cuda=False)

        # vLLM offers the step's chunks and ends its scheduling (0.32: in the other order)
        if not adv.clock.tokens_after_end:
            adv.computes(0, 4096)
        manager.on_schedule_end(None)
        if adv.clock.tokens_after_end:
            adv.computes(0, 4096)
        meta = pickle.loads(pickle.dumps(scheduler.build_connector_meta(None)))
        worker.bind_connector_metadata(meta)
        back = pickle.loads(pickle.dumps(worker.build_connector_worker_meta()))
        assert isinstance(back, StepTimedWorkerMetadata) and back.completed_jobs == {5: 1}
        (number,) = back.step_seconds
        output = KVConnectorOutput(kv_connector_worker_meta=back)
        scheduler.update_connector_output(output)
        assert handed == [output]
        assert adv.clock.by_forward
        (sample,) = samples(adv)
        assert sample[:3] == pytest.approx((4096, 4096 ** 2 / 2, back.step_seconds[number]))
    finally:
        manager.shutdown()


def test_with_another_step_timing_the_connector_leaves_vllms_metadata_alone(tmp_path):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )

    from tiering.vllm import TieredOffloadingConnector
    from tiering.vllm.forward_timer import STEP_NUMBER_FIELD, ForwardTimer

    manager = _spec_manager(tmp_path, "forward-off", step_timing="outputs")
    try:
        conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
        conn._awaiting_first_token = {}
        conn.connector_worker = None
        conn.connector_scheduler = SimpleNamespace(
            manager=manager, build_connector_meta=lambda out: OffloadingConnectorMetadata({}, {}))
        meta = conn.build_connector_meta(None)
        assert not hasattr(meta, STEP_NUMBER_FIELD)
        worker = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
        worker._awaiting_first_token = {}
        worker.connector_scheduler = None
        worker.connector_worker = SimpleNamespace(build_connector_worker_meta=lambda: None)
        worker._connector_metadata = None
        worker._forward_timer = ForwardTimer(cuda=False)
        worker.bind_connector_metadata(meta)
        assert worker.build_connector_worker_meta() is None
    finally:
        manager.shutdown()
