"""Hostile tests of the step clock's runs (``StepClock.output``, commit c8b934d): a run of
consecutive prompt-computing steps is one sample, from its first step's start to its last step's
output, at most ``ADVISOR_RUN_STEPS`` steps; ``PrefillModel`` takes the run's step count.

An engine model with a recorder (``_serve``: vLLM's batch queue of ``depth`` steps, the store
order of vLLM 0.32 or later, launches that may hold the scheduler thread) gives the ground truth
each sample is checked against: which steps it covers, when they were scheduled, ran on the GPU
and were taken back. ``_serve`` with depth 2 and the later order is ``run_async_engine``
(checked first). Fixed seeds throughout."""

from __future__ import annotations

import json
import math
import random
import time

import numpy as np
import pytest
from async_engine import (
    BLOCKING,
    BUDGET,
    E32,
    FREE,
    LAUNCHES,
    ORDERS,
    Rec,
    gpu_costs,
    packed_step,
    run_async_engine,
)
from async_engine import serve_recorded as _serve

import tiering.backends.staging as staging
from tiering.advisor import PromotionAdvisor
from tiering.prefill_model import PrefillModel, stretch_features
from tiering.settings import (
    ADVISOR_LOAD_STEPS,
    ADVISOR_MIN_SAMPLE_TOKENS,
    ADVISOR_MODEL_WINDOW,
    ADVISOR_OUTPUT_QUEUE_LIMIT,
    ADVISOR_RUN_STEPS,
)
from tiering.step_clock import StepClock

ROW = 8192
CHUNK = 64


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def gpu_of(sample, c: float, a: float, b: float) -> float:
    tokens, attention, _, steps = sample
    return c * steps + a * tokens + b * attention


def advisor(order: str = "async", **kw) -> PromotionAdvisor:
    after_end, asynchronous = ORDERS[order]
    return PromotionAdvisor(1, ROW, CHUNK, step_lag=int(asynchronous) - int(after_end),
                            tokens_after_end=after_end, **kw)


def chunks(n: int, k: int = 0, budget: int = BUDGET) -> list[list[tuple[int, int]]]:
    """A prompt's tokens ``[k, n)`` as chunked prefill steps."""
    return [[(s, min(n, s + budget))] for s in range(k, n, budget)]


def expected_samples(recs: list[Rec]) -> list[tuple[float, float, float, float]]:
    return [s for s, _ in expected_runs(recs)]


def expected_runs(recs: list[Rec]) -> list[tuple[tuple[float, float, float, float], Rec]]:
    """The samples the clock's contract gives for the recorded steps (all busy periods, in
    order): maximal runs of prompt steps whose successor was scheduled before their output,
    cut at ``ADVISOR_RUN_STEPS``; from the first step's schedule end (or the previous step's
    output, if that one computed prompt tokens and came later) to the last step's output;
    runs of fewer than ``ADVISOR_MIN_SAMPLE_TOKENS`` tokens dropped."""
    out = []
    run = None
    prev: Rec | None = None
    for idx, r in enumerate(recs):
        if r.tokens <= 0:
            run, prev = None, r
            continue
        if run is None:
            start = r.sched
            if prev is not None and prev.tokens > 0:
                start = max(start, prev.out)
            run = [0, 0.0, 0.0, start]
        run[0] += 1
        run[1] += r.tokens
        run[2] += r.attention
        prev = r
        nxt = recs[idx + 1] if r.ahead else None
        if run[0] < ADVISOR_RUN_STEPS and nxt is not None and nxt.tokens > 0:
            continue
        if run[1] >= ADVISOR_MIN_SAMPLE_TOKENS:
            out.append(((run[1], run[2], r.out - run[3], float(run[0])), r))
        run = None
    return out


def samples(adv: PromotionAdvisor) -> list[tuple[float, float, float, float]]:
    return list(adv.prefill._steps)  # noqa: SLF001


def same_samples(got, want) -> bool:
    """The samples are the same (to rounding), in order."""
    return len(got) == len(want) and all(
        g == pytest.approx(w, rel=1e-12, abs=1e-12) for g, w in zip(got, want, strict=True))


def fit_of(m: PrefillModel) -> tuple[float, float, float]:
    return m.c, m.a, m.b


def _random_period(rng: random.Random, *, decode: bool = True) -> list[list[tuple[int, int]]]:
    """One busy period of a continuously batching engine: decode-only steps, prompts of one
    step (several requests packed in a step's budget, some with a GPU-cached prefix), chunked
    long prompts, and steps that complete a chunk of a decoding request (a few tokens)."""
    steps: list[list[tuple[int, int]]] = []
    for _ in range(rng.randint(1, 6)):
        if decode:
            steps += [[] for _ in range(rng.choice((0, 0, 1, 2, 5)))]
        kind = rng.random()
        if kind < 0.45:
            n = rng.choice((2048, 4096, 8192, 16384, 32768, 65536, 40000))
            k = rng.choice((0, 0, 0, 1024))
            steps += chunks(n, k)
        elif kind < 0.75:
            steps.append(packed_step(rng))
        elif kind < 0.9:
            steps.append([(4096, 4096 + rng.choice((1, 16, 32)))])  # a decoding request's chunk
        else:
            steps.append([(0, rng.choice((16, 64, 200)))])
    if decode:
        steps += [[] for _ in range(rng.randint(1, 4))]
    return steps


# -- 0. the recorder is the project's engine model ----------------------------------------------

def test_the_recording_engine_is_run_async_engine():
    """``_serve`` with a batch queue of two and the later store order makes exactly the calls
    of ``tests/async_engine.py``: the same samples, fit and busy_until."""
    rng = random.Random(5)
    for launch_s, share in (BLOCKING, FREE, (0.03, 0.2)):
        gpu_s = gpu_costs(*E32)
        ours, theirs = advisor(), advisor()
        t1 = t2 = 0.0
        for _ in range(6):
            period = _random_period(rng)
            gap = rng.uniform(0.1, 3.0)
            _, t1 = _serve(ours, period, gpu_s, launch_s, share, start=t1 + gap)
            t2 = run_async_engine(theirs, period, gpu_s, launch_s, share, start=t2 + gap)
        assert t1 == t2
        assert samples(ours) == samples(theirs) and samples(ours)
        assert fit_of(ours.prefill) == fit_of(theirs.prefill)
        assert ours.clock.busy_until == theirs.clock.busy_until


# -- 1. mixed serving ---------------------------------------------------------------------------

def _mixed(launch: str, seed: int, costs=E32) -> tuple[PromotionAdvisor, list[Rec]]:
    rng = random.Random(seed)
    gpu_s = gpu_costs(*costs)
    adv = advisor()
    recs: list[Rec] = []
    t = 0.0
    for _ in range(8):
        rs, t = _serve(adv, _random_period(rng), gpu_s, *LAUNCHES[launch],
                       start=t + rng.uniform(0.05, 2.0))
        recs += rs
    return adv, recs


@pytest.mark.parametrize("launch", ["blocking", "free"])
def test_mixed_serving_prices_long_prompts_within_a_quarter(launch):
    """Decode-only steps between prefills of several requests, chunked prompts, packed steps:
    the fitted recompute price of 8k, 16k and 32k prompts is within 25% of the GPU's."""
    c, a, b = E32
    for seed in range(6):
        adv, recs = _mixed(launch, seed)
        assert adv.clock.by_output and adv.prefill.samples >= 4
        assert same_samples(samples(adv), expected_samples(recs)[-ADVISOR_MODEL_WINDOW:])
        for n in (8192, 16384, 32768):
            truth = a * n + b * n * n / 2
            price = adv.prefill.seconds(0, n)
            assert price == pytest.approx(truth, rel=0.25), (seed, n, price / truth,
                                                             fit_of(adv.prefill))


def _sample_timed_as_on_the_gpu(adv, recs, launch_s, costs=E32) -> list[tuple]:
    """The kept samples whose seconds are not within 25% of their steps' GPU time (plus the
    next step's launch where one was launched before the run's last output)."""
    runs = expected_runs(recs)[-ADVISOR_MODEL_WINDOW:]
    assert same_samples(samples(adv), [s for s, _ in runs])
    bad = []
    for s, last in runs:
        gpu = gpu_of(s, *costs)
        # the run's last output taken after the next step's launch: that launch may be in it
        allowed = max(1.25 * gpu, gpu + launch_s + 0.003) if last.ahead else 1.25 * gpu
        if not 0.75 * gpu <= s[2] <= allowed:
            bad.append((s[0], s[3], round(s[2], 4), round(gpu, 4)))
    return bad


def test_mixed_serving_samples_take_their_gpu_time_where_launches_hold_the_thread():
    """Blocking launches (the 32B shape): each kept sample is its steps' GPU time within 25%,
    or at most the next step's launch more."""
    for seed in range(6):
        adv, recs = _mixed("blocking", seed)
        bad = _sample_timed_as_on_the_gpu(adv, recs, BLOCKING[0])
        assert not bad, (seed, bad)


IN_FLIGHT_DECODE = (
    "a prompt step scheduled while a decode step is still on the GPU (a busy engine's batch "
    "queue) is timed from its own schedule end, so its sample holds the rest of that decode "
    "step (a step cost c): 32B shape, launches that return at once, a 2048-token prefill after "
    "a decode step is timed 0.378 s for 0.259 s of GPU (1.46x), a 64-token one 0.242 for 0.123")


@pytest.mark.xfail(strict=True, reason=IN_FLIGHT_DECODE)
def test_mixed_serving_samples_take_their_gpu_time_where_launches_return_at_once():
    for seed in range(6):
        adv, recs = _mixed("free", seed)
        bad = _sample_timed_as_on_the_gpu(adv, recs, FREE[0])
        assert not bad, (seed, bad)


@pytest.mark.xfail(strict=True, reason=IN_FLIGHT_DECODE)
def test_a_prefill_behind_a_decode_step_is_timed_from_its_gpu_start():
    """The smallest case: request A decodes, request B's 2048-token prompt comes; B's step is
    scheduled while A's decode step runs and starts on the GPU 0.12 s after its schedule end."""
    c, a, b = E32
    gpu_s = gpu_costs(c, a, b)
    adv = advisor()
    recs, _ = _serve(adv, [[], [], [], [(0, 2048)], [], []], gpu_s, *FREE, start=1.0)
    prefill = recs[3]
    assert prefill.gstart - prefill.sched == pytest.approx(c, abs=0.002)  # waited for A
    (sample,) = samples(adv)
    assert sample[2] == pytest.approx(gpu_of(sample, c, a, b), rel=0.25), (
        sample, gpu_of(sample, c, a, b))


@pytest.mark.xfail(strict=True, reason=(
    "the step cost the output-timed fit takes from the step-end clock (StepClock.by_ends) is "
    "timed step by step: under blocking launches a chunked prompt's step-end intervals are "
    "half a chunk off each way (the 32k prompt's chunks, GPU 4.45 and 11.81 s, timed 8.13 and "
    "5.96 s), the step-end fit then drops c to 0 and the model's c (a load's extra steps, "
    "load_overhead) goes to 0 instead of 0.12"))
def test_chunked_prompts_under_blocking_launches_keep_the_step_cost():
    """The scenario of ``tests/test_step_outputs_hostile.py``'s ``_serve_chunked`` (H100, 32B,
    prompts chunked at 16384 tokens): the fit's step cost and a load's extra steps are the
    engine's (0.12 s a step) within 25%."""
    c = E32[0]
    adv = _serve_chunked_prompts(BLOCKING)
    assert adv.prefill.step_cost == pytest.approx(c, rel=0.25)
    assert adv.prefill.c == pytest.approx(c, rel=0.25)
    assert adv.load_overhead() == pytest.approx(ADVISOR_LOAD_STEPS * c, rel=0.25)


def _serve_chunked_prompts(launch: tuple) -> PromotionAdvisor:
    """The H100 32B engine serving the phases' prompts chunked at 16384 tokens, each then
    decoding seven steps, with ``launch`` (``BLOCKING`` or ``FREE``)."""
    gpu_s = gpu_costs(*E32)
    adv = advisor()
    t = 0.0
    for n in (64, 2048, 8192, 32768, 2048, 8192, 32768, 8192):
        _, t = _serve(adv, chunks(n) + [[]] * 7, gpu_s, *launch, start=t + 1.0)
    return adv


def _prefill_only(order: str, tail: int) -> tuple[PromotionAdvisor, tuple]:
    """Requests of one prompt step each (max_tokens 1, or an end of sequence at once), under
    asynchronous scheduling each followed by ``tail`` empty steps before the engine is idle,
    with idle gaps of 0.05 to 1 s; the 8B shape's engine (launches return at once)."""
    after_end, _ = ORDERS[order]
    costs = (0.01, 2e-5, 7e-9)
    gpu_s = gpu_costs(*costs)
    adv = advisor(order)
    rng = random.Random(1)
    t = 0.0
    for _ in range(30):
        n = rng.choice((2048, 8192, 16384, 32768))
        _, t = _serve(adv, [[(0, n)]] + [[]] * tail, gpu_s, *FREE, after_end=after_end,
                      start=t + rng.uniform(0.05, 1.0))
    return adv, costs


@pytest.mark.parametrize("order", ["async", "async-0.32"])
def test_prefill_only_requests_keep_the_step_cost(order):
    """Found by this file (fixed: a step-end interval ends at the step's output at the latest,
    ``StepClock._interval_end``): the step-end clock times step s by t[s+2] - t[s+1]; where a
    prompt step is the second-to-last step of a busy period (a request that ends after its
    prefill, one empty step still scheduled), t[s+2] was the next period's first step end and
    the sample held the idle gap: c came out 0.067 instead of 0.01, a load's extra steps priced
    0.13 s instead of 0.02 (at 32B 0.26-0.32 instead of 0.12)."""
    adv, (c, _, _) = _prefill_only(order, tail=1)
    assert adv.prefill.c == pytest.approx(c, rel=0.25)
    assert adv.load_overhead() == pytest.approx(ADVISOR_LOAD_STEPS * c, rel=0.25)


@pytest.mark.parametrize("order", ["async", "async-0.32"])
def test_prefill_only_requests_with_two_empty_steps_keep_the_step_cost(order):
    """Control for the test above: two empty steps after each prefill."""
    adv, (c, _, _) = _prefill_only(order, tail=2)
    assert adv.prefill.c == pytest.approx(c, rel=0.25)
    assert adv.load_overhead() == pytest.approx(ADVISOR_LOAD_STEPS * c, rel=0.25)


def test_chunked_prompts_with_free_launches_keep_the_step_cost():
    """Control for the xfail ``test_chunked_prompts_under_blocking_launches_keep_the_step_cost``:
    the same prompts with launches that return at once."""
    c = E32[0]
    adv = _serve_chunked_prompts(FREE)
    assert adv.prefill.c == pytest.approx(c, rel=0.25)
    assert adv.load_overhead() == pytest.approx(ADVISOR_LOAD_STEPS * c, rel=0.25)


# -- 2. runs longer than ADVISOR_RUN_STEPS --------------------------------------------------------

@pytest.mark.parametrize("launch", ["blocking", "free"])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_a_long_busy_period_is_cut_into_runs_without_losing_or_doubling_time(launch, extra):
    """Back-to-back prompt steps (four 128k prompts chunked at 16384, ``extra`` more steps):
    cut every ``ADVISOR_RUN_STEPS`` steps; the runs' tokens and attention add up to the
    period's, their seconds to the period's wall time (first schedule end to last prompt
    output; each cut starts the next run at the output that closed the last), and each run is
    its GPU time within one step."""
    c, a, b = E32
    gpu_s = gpu_costs(c, a, b)
    adv = advisor()
    steps = [st for n in (131072, 131072, 131072, 131072) for st in chunks(n)]
    steps += chunks(1024 * extra, budget=1024)
    recs, _ = _serve(adv, steps + [[]] * 3, gpu_s, *LAUNCHES[launch], start=5.0)
    got = samples(adv)
    n_steps = len(steps)
    want_runs = [ADVISOR_RUN_STEPS] * (n_steps // ADVISOR_RUN_STEPS)
    if n_steps % ADVISOR_RUN_STEPS:
        want_runs.append(n_steps % ADVISOR_RUN_STEPS)
    assert [s[3] for s in got] == want_runs
    prompt = [r for r in recs if r.tokens > 0]
    assert sum(s[0] for s in got) == sum(r.tokens for r in prompt)
    assert sum(s[1] for s in got) == pytest.approx(sum(r.attention for r in prompt), rel=1e-12)
    wall = prompt[-1].out - prompt[0].sched
    assert sum(s[2] for s in got) == pytest.approx(wall, rel=1e-12)
    assert same_samples(got, expected_samples(recs))
    longest = max(r.g for r in prompt)
    for s in got:
        assert abs(s[2] - gpu_of(s, c, a, b)) <= longest + LAUNCHES[launch][0], s


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_long_synchronous_or_asynchronous_period_loses_at_most_the_schedule_gaps(order):
    """The same period in every store order and scheduling: the samples' seconds add up to the
    wall time less only the gaps between an output and the next schedule end (synchronous
    scheduling: each step its own run), never more than the wall time."""
    after_end, asynchronous = ORDERS[order]
    gpu_s = gpu_costs(*E32)
    adv = advisor(order)
    steps = [st for n in (131072, 98304, 40000) for st in chunks(n)]
    recs, _ = _serve(adv, steps + [[]] * 2, gpu_s, *BLOCKING, depth=2 if asynchronous else 1,
                     after_end=after_end, start=2.0, schedule_s=0.002)
    got = samples(adv)
    prompt = [r for r in recs if r.tokens > 0]
    wall = prompt[-1].out - prompt[0].sched
    total = sum(s[2] for s in got)
    gaps = sum(max(0.0, nxt.sched - r.out) for r, nxt in zip(prompt, prompt[1:], strict=False))
    assert total == pytest.approx(wall - gaps, rel=1e-12)
    assert total <= wall + 1e-9
    assert sum(s[0] for s in got) == sum(r.tokens for r in prompt)
    assert max(s[3] for s in got) == (ADVISOR_RUN_STEPS if asynchronous else 1)


# -- 3. every store order and scheduling against the ground truth ---------------------------------

@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("launch", ["blocking", "free"])
def test_random_serving_gives_the_ground_truths_samples_in_every_order(order, launch):
    """Random busy periods (decode steps, packed prompts, chunked prompts, few-token steps,
    prefixes cached) with idle gaps, an asynchronous scheduler that now and then has nothing to
    schedule ahead: the kept samples are exactly the ground truth's runs, busy_until is the
    last prompt step's output, nothing is left queued or open."""
    after_end, asynchronous = ORDERS[order]
    for seed in range(8):
        rng = random.Random(f"{seed} {order} {launch}")
        costs = (rng.uniform(0.005, 0.12), rng.uniform(1e-5, 8e-5), rng.uniform(3e-9, 3e-8))
        gpu_s = gpu_costs(*costs)
        adv = advisor(order)
        recs: list[Rec] = []
        t = rng.uniform(0, 100)
        for _ in range(rng.randint(3, 8)):
            rs, t = _serve(adv, _random_period(rng), gpu_s, *LAUNCHES[launch],
                           depth=2 if asynchronous else 1, after_end=after_end,
                           start=t + rng.uniform(0.01, 3.0), hold=rng.choice((0.0, 0.3)), rng=rng)
            recs += rs
        want = expected_samples(recs)
        assert same_samples(samples(adv), want[-ADVISOR_MODEL_WINDOW:]), seed
        assert all(s[2] > 0 for s in samples(adv))
        prompt = [r for r in recs if r.tokens > 0]
        if prompt:
            assert adv.clock.busy_until == prompt[-1].out
        assert not adv.clock._scheduled and adv.clock._run is None  # noqa: SLF001


@pytest.mark.parametrize("order", list(ORDERS))
def test_with_free_launches_every_order_learns_the_step_cost(order):
    """Launches that return at once, periods that end with at least two decode steps (the
    xfail ``test_prefill_only_requests_keep_the_step_cost`` is the one-step case), a scheduler
    that always schedules ahead: the fit's c is the engine's (within 25%, or the two schedule
    gaps a synchronous step's step ends also hold)."""
    after_end, asynchronous = ORDERS[order]
    for seed in range(8):
        rng = random.Random(f"{seed} {order} c")
        costs = (rng.uniform(0.005, 0.12), rng.uniform(1e-5, 8e-5), rng.uniform(3e-9, 3e-8))
        gpu_s = gpu_costs(*costs)
        adv = advisor(order)
        t = 0.0
        for _ in range(6):
            _, t = _serve(adv, _random_period(rng) + [[], []], gpu_s, *FREE,
                          depth=2 if asynchronous else 1, after_end=after_end,
                          start=t + rng.uniform(0.01, 3.0), schedule_s=0.001)
        assert adv.clock.by_ends.samples
        assert adv.prefill.c == pytest.approx(costs[0], rel=0.25, abs=0.0021), (
            seed, costs, fit_of(adv.prefill))


@pytest.mark.parametrize("order", list(ORDERS))
def test_every_order_prices_chunked_prompts_within_a_quarter(order):
    """Each order with its own scheduling, launches that hold the thread: a 32k prompt chunked
    at 16384, 8k prompts and decode steps; the 8k, 16k and 32k prices within 25%."""
    after_end, asynchronous = ORDERS[order]
    c, a, b = E32
    gpu_s = gpu_costs(c, a, b)
    adv = advisor(order)
    t = 0.0
    for n in (2048, 8192, 32768, 4096, 16384, 32768, 8192, 65536, 8192):
        _, t = _serve(adv, chunks(n) + [[]] * 5, gpu_s, *BLOCKING,
                      depth=2 if asynchronous else 1, after_end=after_end, start=t + 1.0)
    for n in (8192, 16384, 32768):
        truth = a * n + b * n * n / 2
        assert adv.prefill.seconds(0, n) == pytest.approx(truth, rel=0.25), (n, order)


# -- 4. restore: old and new rows, bad rows, JSON -------------------------------------------------

def _a_model() -> PrefillModel:
    m = PrefillModel()
    m.step_cost = 0.05
    c, a, b = 0.05, 3e-5, 2e-8
    for n, steps in ((2048, 1), (8192, 1), (32768, 2), (4096, 3), (16384, 1), (65536, 4)):
        x1, x2 = stretch_features(0, n)
        m.add_step(x1, x2, c * steps + a * x1 + b * x2, steps)
    return m


def _snapshot(m: PrefillModel):
    return list(m._steps), fit_of(m), m.samples, m.step_cost, m.outliers  # noqa: SLF001


def test_restore_takes_old_three_column_rows_as_one_step_each():
    c, a, b = 0.02, 3e-5, 2e-8
    rows = []
    ref = PrefillModel()
    for n in (1024, 4096, 8192, 2048, 16384, 512):
        x1, x2 = stretch_features(0, n)
        rows.append([x1, x2, c + a * x1 + b * x2])
        ref.add_step(x1, x2, c + a * x1 + b * x2)
    m = PrefillModel()
    m.restore(json.loads(json.dumps({"steps": rows, "samples": 10, "coef": [0.0, 0.0, 0.0]})))
    assert [s[3] for s in m._steps] == [1.0] * len(rows)  # noqa: SLF001
    assert list(m._steps) == list(ref._steps) and m.samples == 10  # noqa: SLF001
    assert fit_of(m) == pytest.approx(fit_of(ref), rel=1e-9, abs=1e-15)
    assert fit_of(m) == pytest.approx((c, a, b), rel=1e-6)


def test_restore_takes_four_column_rows_and_round_trips_through_json():
    m = _a_model()
    state = json.loads(json.dumps(m.state()))
    assert all(len(row) == 4 for row in state["steps"])
    again = PrefillModel()
    again.restore(state)
    assert list(again._steps) == list(m._steps)  # noqa: SLF001
    assert again.samples == m.samples and again.step_cost == m.step_cost
    assert fit_of(again) == pytest.approx(fit_of(m), rel=1e-9, abs=1e-15)
    assert fit_of(again) == pytest.approx((0.05, 3e-5, 2e-8), rel=1e-6)
    # the same rows as one step each would fit another engine: the step column counts
    one_each = PrefillModel()
    one_each.restore({**state, "steps": [row[:3] for row in state["steps"]]})
    assert fit_of(one_each) != pytest.approx(fit_of(m), rel=1e-3)
    # the clock's own runs survive a round trip
    adv = advisor()
    gpu_s = gpu_costs(*E32)
    t = 0.0
    for n in (32768, 8192, 65536, 2048):
        _, t = _serve(adv, chunks(n) + [[]] * 3, gpu_s, *BLOCKING, start=t + 1.0)
    assert max(s[3] for s in samples(adv)) > 1
    back = PrefillModel()
    back.restore(json.loads(json.dumps(adv.prefill.state())))
    assert list(back._steps) == samples(adv)  # noqa: SLF001
    assert fit_of(back) == pytest.approx(fit_of(adv.prefill), rel=1e-9, abs=1e-15)


BAD_STEPS = [0, 1.5, -1, ADVISOR_MODEL_WINDOW + 1, math.nan, math.inf, -math.inf, 1e300, 0.999999]


@pytest.mark.parametrize("bad", BAD_STEPS)
def test_restore_refuses_a_bad_step_count_and_changes_nothing(bad):
    m = _a_model()
    before = _snapshot(m)
    state = json.loads(json.dumps(m.state()))
    rows = [list(r) for r in state["steps"]]
    rows[2][3] = bad
    for target in (m, PrefillModel()):
        snap = _snapshot(target)
        with pytest.raises(ValueError, match="prefill model"):
            target.restore({**state, "steps": rows})
        assert _snapshot(target) == snap
    assert _snapshot(m) == before


@pytest.mark.parametrize("rows", [
    [[1024.0, 524288.0, 0.1], [2048.0, 2097152.0, 0.2, 1.0]],  # ragged: old and new rows mixed
    [[1024.0, 524288.0, 0.1, 1.0, 1.0]],  # five columns
    [[1024.0, 524288.0]],
    [[1024.0, 524288.0, 0.0]],  # a sample of 0 s (old row)
    [[1024.0, 524288.0, -0.1]],
    [[1024.0, math.nan, 0.1]],
    [[0.0, 524288.0, 0.1, 1.0]],
    [[1024.0, 524288.0, math.inf, 2.0]],
    [[[1024.0, 524288.0, 0.1, 1.0]]],  # three levels
    [[1024.0, 524288.0, 0.1, 1.0]] * (ADVISOR_MODEL_WINDOW + 1),
    [[1024.0, 524288.0, 0.1, None]],
    [[1024.0, 524288.0, 0.1, "x"]],
    "steps",
    7,
    None,
])
def test_restore_refuses_bad_rows_and_changes_nothing(rows):
    m = _a_model()
    before = _snapshot(m)
    state = m.state()
    with pytest.raises(ValueError, match="prefill model"):
        m.restore({**state, "steps": rows, "samples": 100})
    assert _snapshot(m) == before


@pytest.mark.parametrize("steps", [1.5, 2.25])
def test_add_step_refuses_what_restore_refuses(steps):
    """Found by this file (fixed): ``add_step`` kept a fractional step count that ``restore``
    refuses; the next engine's restore of that state then failed and lost the whole fit."""
    m = _a_model()
    n = m.samples
    m.add_step(8192.0, 8192.0 * 4096, 1.0, steps)
    assert m.samples == n  # refused like restore refuses it, or else ...
    PrefillModel().restore(json.loads(json.dumps(m.state())))  # ... its own state restores


@pytest.mark.parametrize("steps", [0, -1, ADVISOR_MODEL_WINDOW + 1, math.nan, math.inf])
def test_add_step_ignores_a_bad_step_count(steps):
    m = _a_model()
    before = _snapshot(m)
    m.add_step(8192.0, 8192.0 * 4096, 1.0, steps)
    assert _snapshot(m) == before


# -- 5. the cap on c ------------------------------------------------------------------------------

def _per_step_floor(m: PrefillModel) -> float:
    return min(s[2] / s[3] for s in m._steps)  # noqa: SLF001


def test_multi_step_samples_fit_the_engine_exactly_and_cap_c_per_step():
    """Samples of 1 to 8 steps from one engine: the fit is the engine (c counted per step), and
    c is never above the fastest sample's time a step."""
    rng = random.Random(11)
    for _ in range(20):
        c, a, b = rng.uniform(0.001, 0.2), rng.uniform(5e-6, 1e-4), rng.uniform(1e-9, 3e-8)
        m = PrefillModel()
        for _ in range(30):
            steps = rng.randint(1, ADVISOR_RUN_STEPS)
            x1 = x2 = 0.0
            for _ in range(steps):
                k = rng.choice((0, 0, 8192, 16384))
                f1, f2 = stretch_features(k, k + rng.choice((512, 2048, 8192, 16384)))
                x1, x2 = x1 + f1, x2 + f2
            m.add_step(x1, x2, c * steps + a * x1 + b * x2, steps)
            assert m.c <= _per_step_floor(m) * (1 + 1e-12)
        assert fit_of(m) == pytest.approx((c, a, b), rel=1e-5)
        assert not m.outliers


def test_a_run_faster_a_step_than_the_fit_caps_c_at_its_time_a_step():
    """One 8-step run took 0.4 s (0.05 s a step) where every single step took over 0.1 s: no
    step is faster than c, so c is at most 0.05 whatever the step cost given."""
    for given in (None, 0.02, 0.05, 0.08, 0.3):
        m = PrefillModel()
        m.step_cost = given
        for n in (2048, 8192, 4096, 16384, 1024):
            x1, x2 = stretch_features(0, n)
            m.add_step(x1, x2, 0.1 + 3e-5 * x1 + 2e-8 * x2)
        m.add_step(8 * 64.0, 8 * 64.0 * 32, 0.4, 8)
        floor = _per_step_floor(m)
        assert floor == pytest.approx(0.05)
        assert m.c <= floor * (1 + 1e-12), (given, fit_of(m), m.outliers)
        if given is not None and not m.outliers:
            assert m.c == pytest.approx(min(given, floor), rel=1e-12), given


@pytest.mark.parametrize("given", [0.0, 0.01, 0.05, 0.1, 0.11, 0.2, 5.0])
def test_a_given_step_cost_is_c_capped_by_the_fastest_sample_a_step(given):
    c, a, b = 0.1, 3e-5, 2e-8
    rng = random.Random(3)
    m = PrefillModel()
    m.step_cost = given
    for _ in range(40):
        steps = rng.choice((1, 1, 2, 3, 8))
        n = rng.choice((1024, 2048, 8192, 16384))
        x1, x2 = stretch_features(0, n)
        x1, x2 = x1 * steps, x2 * steps
        m.add_step(x1, x2, (c * steps + a * x1 + b * x2) * rng.uniform(0.98, 1.02), steps)
        floor = _per_step_floor(m)
        assert m.c <= floor * (1 + 1e-12)
        if not m.outliers:
            assert m.c == pytest.approx(min(given, floor), rel=1e-12)
    if given == c:
        assert (m.a, m.b) == (pytest.approx(a, rel=0.1), pytest.approx(b, rel=0.1))


def test_through_the_clock_c_is_the_step_ends_cost_capped_by_the_fastest_run_a_step():
    """Free launches, 8-step runs (long chunked prompts) and single steps: each time a sample
    is added the model's c is min(the step-end clock's c, the fastest kept sample a step)."""
    gpu_s = gpu_costs(*E32)
    adv = advisor()
    orig = adv.prefill.add_step
    checked = []

    def add_step(*args):
        orig(*args)
        m = adv.prefill
        floor = _per_step_floor(m)
        assert m.c <= floor * (1 + 1e-12)
        if m.step_cost is not None and not m.outliers:
            assert m.c == pytest.approx(min(m.step_cost, floor), rel=1e-12)
            checked.append(args[3])

    adv.prefill.add_step = add_step
    t = 0.0
    for n in (2048, 200000, 8192, 131072, 4096, 32768, 300000):
        _, t = _serve(adv, chunks(n) + [[]] * 4, gpu_s, *FREE, start=t + 1.0)
    assert ADVISOR_RUN_STEPS in checked and 1 in checked


# -- 6. hostile call orders -------------------------------------------------------------------------

def _check(adv: PromotionAdvisor) -> None:
    for m in (adv.prefill, adv.clock.by_ends):
        for s in m._steps:  # noqa: SLF001
            assert 0 < s[2] < math.inf and 1 <= s[3] <= ADVISOR_RUN_STEPS, s
        assert all(math.isfinite(v) and v >= 0 for v in fit_of(m))
    assert len(adv.clock._scheduled) <= ADVISOR_OUTPUT_QUEUE_LIMIT  # noqa: SLF001
    run = adv.clock._run  # noqa: SLF001
    assert run is None or (0 < run[0] < ADVISOR_RUN_STEPS and adv.clock._scheduled)  # noqa: SLF001


@pytest.mark.parametrize("order", list(ORDERS))
def test_random_call_orders_never_raise_or_give_a_sample_of_no_time(order):
    """computes / step_end / step_output in any order on an honest (forward, sometimes
    standing) clock: outputs with nothing scheduled, more outputs than steps, an output between
    a step's computes and its step end, step ends without outputs. Never an exception, never a
    sample of <= 0 s or of more than the run limit; a run open only while a step is scheduled;
    after an idle gap a new request gives samples again."""
    for seed in range(25):
        rng = random.Random(f"{seed} {order}")
        adv = advisor(order)
        t = rng.uniform(0, 10)
        for _ in range(rng.randint(50, 400)):
            t += rng.choice((0.0, rng.expovariate(50), rng.expovariate(2)))
            r = rng.random()
            if r < 0.35:
                k = rng.choice((0, 0, 1024, 16384))
                adv.computes(k, k + rng.choice((16, 64, 2048, 8192, 16384)))
            elif r < 0.65:
                adv.step_end(t)
            else:
                adv.step_output(t)
            _check(adv)
        before = adv.prefill.samples
        gpu_s = gpu_costs(*E32)
        after_end, asynchronous = ORDERS[order]
        for n in (8192, 32768):
            _, t = _serve(adv, chunks(n) + [[]] * 3, gpu_s, *BLOCKING,
                          depth=2 if asynchronous else 1, after_end=after_end, start=t + 5.0)
            _check(adv)
        assert adv.prefill.samples > before, seed


class _Spurious:
    """Forwards the engine's calls to ``adv``, adding spurious outputs: after a step end (an
    output between two steps' scheduling) and after an output (stats asked twice)."""

    def __init__(self, adv: PromotionAdvisor, rng: random.Random) -> None:
        self.adv, self.rng = adv, rng

    def computes(self, k, n):
        self.adv.computes(k, n)

    def step_end(self, now):
        self.adv.step_end(now)
        if self.rng.random() < 0.15:
            self.adv.step_output(now)
        _check(self.adv)

    def step_output(self, now):
        self.adv.step_output(now)
        for _ in range(self.rng.choice((0, 0, 0, 1, 2))):
            self.adv.step_output(now)
        _check(self.adv)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("launch", ["blocking", "free"])
def test_spurious_outputs_mid_period_heal_by_the_next_idle_engine(order, launch):
    """Spurious outputs (stats asked once more than vLLM's loop would) at random points of a
    busy period, runs open included: no exception, no sample of <= 0 s; once the engine is idle
    again the queue is empty, no run is open, and the next request is timed exactly as a clock
    that never saw them times it."""
    after_end, asynchronous = ORDERS[order]
    gpu_s = gpu_costs(*E32)
    for seed in range(10):
        rng = random.Random(f"{seed} {order} {launch}")
        noisy, clean = advisor(order), advisor(order)
        t = 0.0
        period = _random_period(rng)
        _, t = _serve(_Spurious(noisy, rng), period, gpu_s, *LAUNCHES[launch],
                      depth=2 if asynchronous else 1, after_end=after_end, start=1.0)
        assert not noisy.clock._scheduled and noisy.clock._run is None  # noqa: SLF001
        n_noisy, n_clean = noisy.prefill.samples, clean.prefill.samples
        for adv in (noisy, clean):
            _serve(adv, chunks(40000) + [[(0, 2048)], []], gpu_s, *LAUNCHES[launch],
                   depth=2 if asynchronous else 1, after_end=after_end, start=t + 3.0)
        new_noisy = samples(noisy)[len(samples(noisy)) - (noisy.prefill.samples - n_noisy):]
        new_clean = samples(clean)[len(samples(clean)) - (clean.prefill.samples - n_clean):]
        assert new_noisy == new_clean and new_clean, (seed, new_noisy, new_clean)


@pytest.mark.parametrize("order", list(ORDERS))
def test_an_output_between_computes_and_step_end_times_nothing_wrong(order):
    """A synchronous engine whose stats are also asked between a step's chunks and its step
    end (and before its first step): each prefill is still timed from its step end to its
    output."""
    after_end, _ = ORDERS[order]
    adv = advisor(order)
    c, a, b = 0.01, 3e-5, 1e-8
    t = 0.0
    want = []
    for n in (2048, 8192, 0, 16384, 4096, 0, 0, 1024):
        adv.step_output(t)  # spurious: nothing scheduled
        if not after_end and n:
            adv.computes(0, n)
            adv.step_output(t + 0.0001)  # spurious, between the chunks and the step end
        t += 0.001
        adv.step_end(t)
        start = t
        if after_end and n:
            adv.computes(0, n)
        t += c + a * n + b * n * n / 2
        adv.step_output(t)
        if n:
            want.append((float(n), n * n / 2.0, t - start, 1.0))
    assert same_samples(samples(adv), want)


def test_step_ends_without_outputs_then_outputs_again_leave_no_endless_run():
    """Outputs stop for more steps than the queue keeps while a run is open, then resume: the
    run closes within ``ADVISOR_RUN_STEPS`` outputs, the queue drains, and a later request from
    an idle engine is timed right."""
    gpu_s = gpu_costs(*E32)
    adv = advisor()
    adv.step_output(0.0)
    for i in range(3):  # a run opens: two prompt steps in flight, one output taken
        adv.computes(0, 16384)
        adv.step_end(1.0 + i)
    adv.step_output(3.5)
    assert adv.clock._run is not None  # noqa: SLF001
    for i in range(3 * ADVISOR_OUTPUT_QUEUE_LIMIT):
        adv.computes(0, 8192)
        adv.step_end(10.0 + i)
        _check(adv)
    for j in range(ADVISOR_OUTPUT_QUEUE_LIMIT + 5):
        adv.step_output(100.0 + j)
        _check(adv)
    assert adv.clock._run is None and not adv.clock._scheduled  # noqa: SLF001
    recs, _ = _serve(adv, [[(0, 8192)], [], []], gpu_s, *FREE, start=500.0)
    assert samples(adv)[-1] == pytest.approx(expected_samples(recs)[-1], rel=1e-12)


# -- 7. nothing grows without bound -----------------------------------------------------------------

@pytest.mark.parametrize("order", list(ORDERS))
def test_ten_thousand_steps_keep_everything_bounded(order):
    after_end, asynchronous = ORDERS[order]
    gpu_s = gpu_costs(*E32)
    adv = advisor(order)
    rng = random.Random(order)
    steps: list[list[tuple[int, int]]] = []
    while len(steps) < 10_000:
        steps += _random_period(rng)
    most = [0, 0, 0]

    class Watch:
        def computes(self, k, n):
            adv.computes(k, n)

        def step_end(self, now):
            adv.step_end(now)
            self.look()

        def step_output(self, now):
            adv.step_output(now)
            self.look()

        def look(self):
            clock = adv.clock
            most[0] = max(most[0], len(clock._scheduled))  # noqa: SLF001
            most[1] = max(most[1], len(adv.prefill._steps), len(clock.by_ends._steps))  # noqa: SLF001
            run = clock._run  # noqa: SLF001
            most[2] = max(most[2], int(run[0]) if run else 0)

    t0 = time.perf_counter()
    _serve(Watch(), steps, gpu_s, *FREE, depth=2 if asynchronous else 1, after_end=after_end)
    elapsed = time.perf_counter() - t0
    assert most[0] <= 2 and most[1] <= ADVISOR_MODEL_WINDOW and most[2] < ADVISOR_RUN_STEPS
    assert adv.prefill.samples > 100
    assert elapsed < 60  # generous: a sanity bound, not a timing claim
    # an engine whose outputs never come: the queue stays at its limit
    silent = advisor(order)
    silent.step_output(0.0)
    for i in range(10_000):
        silent.computes(0, 2048)
        silent.step_end(1.0 + i)
    assert len(silent.clock._scheduled) == ADVISOR_OUTPUT_QUEUE_LIMIT  # noqa: SLF001


def test_a_clock_alone_with_a_fixed_rate_keeps_no_samples():
    """A fixed prefill rate (config) never fits: the clock's runs change nothing."""
    m = PrefillModel(tokens_per_s=50_000.0)
    clock = StepClock(m, lag=1)
    gpu_s = gpu_costs(*E32)

    class Adv:
        computes = staticmethod(clock.computes)
        step_end = staticmethod(clock.step_end)
        step_output = staticmethod(clock.output)

    _serve(Adv(), chunks(131072) + [[]] * 2, gpu_s, *FREE)
    assert not m._steps and m.samples == 0  # noqa: SLF001
    assert fit_of(m) == (0.0, 1 / 50_000.0, 0.0)
    assert np.isfinite(m.seconds(0, 8192))
