"""Hostile tests of the promotion advisor's engine backlog (``engine_backlog_s``, commits
6396b69 and 46a0fb7): the waiting count and the "recent request" average under vLLM's real call
sequences (a real vLLM ``Scheduler`` with our spec, ``tests/vllm_harness.py``), and the pricing
itself (``PromotionAdvisor``).

The backlog is ``waiting_requests x (a * mean_tokens + b * mean_attention)``: a request counted
waiting while vLLM runs it, or a mean pulled towards zero by requests that never ran, both
misprice every load-or-recompute decision taken meanwhile."""

from __future__ import annotations

import math
import random

import pytest

from tiering.advisor import PromotionAdvisor
from tiering.prefill_model import stretch_features
from tiering.settings import ADVISOR_BACKLOG_HORIZON_S, ADVISOR_PAYOFF_MARGIN

CHUNK = 128  # the harness spec's tokens per chunk (extra()["block_size"])
PROMPT = 512
FEATURES_512 = stretch_features(0, PROMPT)  # (512.0, 131072.0)


# -- a real vLLM scheduler -------------------------------------------------------------------

def assert_learned_512(adv: PromotionAdvisor) -> None:
    """What a recent request computed is a 512-token prompt's features."""
    tokens, attention = adv.recent_request()
    assert tokens == pytest.approx(FEATURES_512[0], rel=1e-6), tokens
    assert attention == pytest.approx(FEATURES_512[1], rel=1e-6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm")
    from benchmarks.tiny_model import build

    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


def extra(tmp_path, cpu_rows: int = 8, cap: int | None = None) -> dict:
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "block_size": CHUNK, "cpu_bytes_to_use": cpu_rows * (256 << 10),
          "tiers": [{"medium": "cpu", "policy": "lru", "store_threshold": 0, "promote": "auto"},
                    {"medium": "file", "path": str(tmp_path / "kv"), "capacity": "64MiB",
                     "io": "posix", "store_threshold": 0}]}
    if cap is not None:
        ex["max_loading_requests"] = cap
    return ex


def harness(model, tmp_path, **kw):
    from vllm_harness import Harness

    h = Harness(model, extra(tmp_path, **{k: kw.pop(k) for k in ("cpu_rows", "cap") if k in kw}),
                **kw)
    assert h.manager.chain.advisor is not None
    return h, h.manager.chain.advisor


def test_a_prompt_shorter_than_a_chunk_is_not_counted_waiting_while_vllm_runs_it(model,
                                                                                tmp_path):
    """vLLM never looks up nor offers a prompt without a full chunk: counted waiting until its
    first lookup or offer, it stayed "waiting" for its whole life (here, 30 decode steps), and
    the advisor priced four requests waiting behind every decision while nothing waited. vLLM's
    report of the requests it scheduled (``ScheduleEndContext.new_req_ids``) ends the wait."""
    h, adv = harness(model, tmp_path, batched_tokens=512, max_num_seqs=8)
    try:
        for i in range(4):
            h.add(f"s{i}", prompt(i, 50), max_tokens=30)
        assert adv.waiting_requests == 4  # announced, not scheduled yet: right
        h.step()
        h.step()
        running = {r.request_id for r in h.scheduler.running}
        assert running == {f"s{i}" for i in range(4)} and not h.scheduler.waiting
        assert adv.waiting_requests == 0, "requests vLLM is running counted as waiting"
    finally:
        h.manager.shutdown()


def test_a_request_aborted_while_waiting_teaches_the_advisor_nothing(model, tmp_path):
    """A request aborted before the scheduler reached it (a client gone while queued: what an
    overloaded engine sees most) computed nothing because it never ran, not because requests
    are cheap. Fed to the moving average as a zero-token request, it seeds it at 0 (the first
    sample is taken whole), and the next 512-token requests moved it 5% each: the backlog was
    then priced at a fraction of its compute. A request the scheduler never reached is no
    sample."""
    from vllm.v1.request import RequestStatus

    h, adv = harness(model, tmp_path, batched_tokens=512, max_num_seqs=8)
    try:
        h.add("gone", prompt(1))
        h.scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
        h.step()
        assert adv.waiting_requests == 0 and h.manager.live_requests() == 0
        assert adv.recent_request() == (None, None), adv.recent_request()
        for i in range(4):
            h.add(f"r{i}", prompt(10 + i))
        h.run()
        tokens, attention = adv.recent_request()
        assert tokens == pytest.approx(FEATURES_512[0], rel=1e-6)
        assert attention == pytest.approx(FEATURES_512[1], rel=1e-6)
    finally:
        h.manager.shutdown()


def test_vllms_untracked_request_path_does_not_pull_the_recent_request_to_zero(model,
                                                                              tmp_path):
    """vLLM (0.32 and 0.33) finalizes a request it never tracked (``request_finished`` with no
    request state) by calling the manager's ``on_new_request`` and at once its
    ``on_request_finished``. The manager must not learn "a request computes nothing" from it:
    after 20 such requests the average of 512-token requests must still be 512 (it was 184)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    h, adv = harness(model, tmp_path, batched_tokens=512, max_num_seqs=8)
    try:
        h.add("cold", prompt(9))
        h.run()
        assert adv.recent_request() == pytest.approx(FEATURES_512)
        sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        connector = h.scheduler.connector.connector_scheduler
        for i in range(20):
            req = Request(request_id=f"u{i}", prompt_token_ids=prompt(50 + i),
                          sampling_params=sp, pooling_params=None, block_hasher=h._hasher)
            assert connector.request_finished(req) == (False, None)
        assert adv.waiting_requests == 0 and h.manager.live_requests() == 0
        assert_learned_512(adv)
    finally:
        h.manager.shutdown()


def test_a_connector_reset_keeps_the_waiting_count_and_counts_no_prompt_twice(model, tmp_path):
    """vLLM's connector reset (``reset_cache``) between two steps of a chunked prefill: the
    requests still queued keep waiting (counted once), and vLLM then re-offers the running
    request's chunks from chunk 0 (``next_stored_chunk_idx = 0``) to store them again. Those
    re-offers are stores of KV computed before, not compute: each request computed its 512
    prompt tokens once, so what a recent request computed is 512 tokens (the scan counted
    768 for the request caught mid-prefill, and its step clock the re-offers as compute)."""
    h, adv = harness(model, tmp_path, batched_tokens=CHUNK, max_num_seqs=8)
    try:
        h.add("r0", prompt(1))
        h.add("r1", prompt(2))
        h.step()
        h.step()  # r0 has computed 2 chunks; r1 waits behind it (one chunk of budget a step)
        assert adv.waiting_requests == 1
        assert h.scheduler.reset_connector_cache()
        assert adv.waiting_requests == 1 and h.manager.live_requests() == 2
        h.run()
        assert adv.waiting_requests == 0 and h.manager.live_requests() == 0
        assert_learned_512(adv)
    finally:
        h.manager.shutdown()


def test_scans_deferred_by_the_load_gate_wait_until_admitted_and_leave_no_count(model,
                                                                                 tmp_path):
    """Regression: with ``max_loading_requests`` 1, CPU hits behind a loading one are deferred
    (the manager answers before the scan): each stays counted waiting until a lookup gets
    through, the count never goes up while nothing arrives, every request gets its hits, and
    nothing is left counted at the end."""
    h, adv = harness(model, tmp_path, cpu_rows=24, cap=1, gpu_tokens=8192, delay=3,
                     max_num_seqs=8)
    try:
        ps = [prompt(100 + i) for i in range(3)]
        for i, p in enumerate(ps):
            h.add(f"f{i}", p, max_tokens=1)
        h.run()
        h.reset_gpu_prefix_cache()
        for i, p in enumerate(ps):
            h.add(f"h{i}", p, max_tokens=1)
        seen = [adv.waiting_requests]
        for _ in range(60):
            if not h.scheduler.requests and not h._pending:
                break
            h.step()
            seen.append(adv.waiting_requests)
        h.run()
        stats = h.manager.chain.cpu.stats
        assert stats["loads_deferred"] > 0  # the gate did defer scans
        assert seen[0] == 3 and 0 < seen[1] < 3  # the deferred ones still wait
        assert seen == sorted(seen, reverse=True) and seen[-1] == 0, seen
        assert all(h.cached[f"h{i}"] >= 384 for i in range(3)), h.cached
        assert adv.waiting_requests == 0 and h.manager.live_requests() == 0
    finally:
        h.manager.shutdown()


def test_preemption_leaves_the_waiting_count_and_the_recent_request_right(model, tmp_path):
    """Regression: two requests that cannot both fit in the GPU KV cache; vLLM preempts one
    (back to its queue, never announced again). No count is left behind, and each request is
    learned as the 256 prompt tokens it computed (a preempted recompute is not re-offered)."""
    from vllm.v1.request import RequestStatus

    h, adv = harness(model, tmp_path, cpu_rows=16, gpu_tokens=6 * 128, delay=5)
    try:
        h.add("p1", prompt(5, 256), max_tokens=300)
        h.add("p2", prompt(6, 256), max_tokens=300)
        preempted = 0
        for _ in range(2000):
            if not h.scheduler.requests and not h._pending:
                break
            h.step()
            preempted += sum(r.status == RequestStatus.PREEMPTED for r in h.scheduler.waiting)
            assert adv.waiting_requests == 0
        h.run()
        assert preempted > 0, "the scenario did not preempt"
        assert adv.waiting_requests == 0 and h.manager.live_requests() == 0
        assert adv.recent_request() == pytest.approx(stretch_features(0, 256))
    finally:
        h.manager.shutdown()


# -- the pricing -----------------------------------------------------------------------------

ROW = 1 << 20


def _advisor(rate: float = 1e7, tokens_per_s: float | None = 1000.0) -> PromotionAdvisor:
    """One file tier read at ``rate`` bytes/s, 128-token chunks of 1 MiB, an engine computing
    ``tokens_per_s`` prompt tokens a second (fixed: a 128-token chunk costs 128 ms)."""
    adv = PromotionAdvisor(1, ROW, CHUNK, prefill_tokens_per_s=tokens_per_s)
    adv.observe_read_batch(1, 64 * ROW, 64 * ROW / rate, full=True)
    assert adv.read_rate(1) == pytest.approx(rate)
    return adv


def test_a_backlog_that_pays_for_the_first_chunk_does_not_load_any_run_unpriced():
    """``first_chunk_pays`` loads the run at once, for any length ("every later chunk costs
    more to compute and no more to read"), and the scan never asks ``decide``. That holds for
    the run's own compute, not for the backlog: the backlog is one fixed amount (and capped at
    ADVISOR_BACKLOG_HORIZON_S), so a first chunk priced against it says nothing of a longer
    run. Here 100 requests wait (backlog 100 s, priced 2 s), 16 MB of reads are queued ahead:
    the first chunk paid against the backlog (1.70 s <= 0.9 x 2 s) while ``decide`` declines
    every run of 2 chunks or more, and a 32-chunk run loaded at once would have read for
    4.96 s, past the horizon. The shortcut now weighs the run's own compute only."""
    adv = _advisor()
    adv.request_finished(*stretch_features(0, 1000))
    for _ in range(100):
        adv.request_waiting()
    queued, writing = {1: 16_000_000}, {1: 0}
    assert not adv.first_chunk_pays(1, 0, queued, writing)
    runs = {n: adv.decide([1] * n, 0, n * CHUNK, queued, writing, count=False)
            for n in (1, 2, 4, 8, 16, 32)}
    assert runs[1].load  # priced whole, one chunk loads (behind the queue, for the backlog)
    assert not any(runs[n].load for n in (2, 4, 8, 16, 32))
    # the shortcut still takes a run whose first chunk pays against its own compute
    fast = _advisor(rate=1e9)
    assert fast.first_chunk_pays(1, 0, {1: 0}, {1: 0})


def test_an_infinite_request_feature_does_not_poison_the_backlog_for_good():
    """``request_finished`` ignores NaN and negative features but takes an infinite one: the
    moving average is then infinite forever (inf x (1 - w) + w x = inf), and the backlog is
    NaN (0 x inf, with the attention cost 0) or infinite, whatever the later requests."""
    adv = _advisor()
    adv.request_finished(math.inf, math.inf)
    for _ in range(200):
        adv.request_finished(*FEATURES_512)
    adv.request_waiting()
    assert math.isfinite(adv.recent_request()[0])
    assert adv.engine_backlog_s == pytest.approx(PROMPT / 1000.0, rel=0.05)


def test_nan_and_negative_request_features_are_ignored():
    """Regression: a NaN or negative feature is no sample, whichever of the two it is in."""
    adv = _advisor()
    for bad in ((math.nan, 1.0), (1.0, math.nan), (-1.0, 1.0), (1.0, -1.0)):
        adv.request_finished(*bad)
    assert adv.recent_request() == (None, None)
    adv.request_finished(*FEATURES_512)
    adv.request_finished(math.nan, math.nan)
    assert adv.recent_request() == pytest.approx(FEATURES_512)


def test_the_backlog_with_a_fixed_prefill_rate_an_unknown_engine_and_a_huge_queue():
    """Regression. A fixed ``prefill_tokens_per_s`` prices the waiting requests at its rate (no
    attention term): a 4-chunk run that reads in 0.42 s and computes in 0.05 s alone is
    recomputed with nobody waiting and loaded (engine_busy) behind 10 waiting 512-token
    requests (0.51 s). An engine not measured yet prices no backlog and loads to measure.
    A billion waiting requests price a finite backlog, and a load still ends its reads
    within the horizon."""
    adv = _advisor(rate=1e7, tokens_per_s=1e4)
    run = [1] * 4
    assert not adv.decide(run, 0, 512, count=False).load
    adv.request_finished(*FEATURES_512)
    for _ in range(10):
        adv.request_waiting()
    assert adv.engine_backlog_s == pytest.approx(10 * PROMPT / 1e4)
    d = adv.decide(run, 0, 512, count=False)
    assert (d.load, d.reason) == (True, "engine_busy")

    unknown = PromotionAdvisor(1, ROW, CHUNK)
    unknown.observe_read_batch(1, 64 * ROW, 64 * ROW / 1e7, full=True)
    unknown.request_finished(*FEATURES_512)
    for _ in range(10):
        unknown.request_waiting()
    assert unknown.engine_backlog_s == 0.0
    assert (unknown.decide(run, 0, 512).load, unknown.decide(run, 0, 512).reason) == (
        True, "unmeasured")

    adv.waiting_requests = 10 ** 9
    assert math.isfinite(adv.engine_backlog_s) and adv.engine_backlog_s > 1e7
    for queued_s in (0.0, 1.0, 1.5, 1.9, 3.0):
        d = adv.decide(run, 0, 512, {1: int(queued_s * 1e7)}, count=False)
        assert not d.load or d.load_s <= ADVISOR_PAYOFF_MARGIN * ADVISOR_BACKLOG_HORIZON_S


@pytest.mark.parametrize("n", [128, 400])
def test_the_throughput_replay_depends_on_the_backlog(n):
    """Guard against tests/test_advisor_replay.py passing vacuously: the waiting prompts, priced,
    are what lifts the disk-backed throughput; priced at nothing (or never announced) the same
    replay must come out measurably lower. (Since a load's wait behind busy steps is no longer
    taken for its overhead, the last step's compute alone lets the disk take a share: the
    backlog adds the rest, 3-6% of compute plus disk here.)"""
    from test_advisor_replay import DATA, serve

    none, _ = serve("none", 1.0, n=n)
    seeing, reasons = serve("advisor", 1.0, n=n, announce=True)
    blind, _ = serve("advisor", 1.0, n=n)
    disk = 1.5e9 / DATA["shapes"]["8b"]["kv_bytes_per_token"]
    assert seeing >= 0.95 * (none + disk) and reasons.get("load:engine_busy", 0) > 0
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(PromotionAdvisor, "_backlog_term", lambda self: 0.0)
        priced_at_nothing, _ = serve("advisor", 1.0, n=n, announce=True)
    finally:
        mp.undo()
    assert priced_at_nothing * 1.02 < seeing and blind * 1.02 < seeing
