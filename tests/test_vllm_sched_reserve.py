"""tiering.vllm.scheduler inside vLLM 0.33's scheduler: the remembered in-flight reservation
total equals vLLM's sum at every admission, the scheduler it drives decides exactly as vLLM's
does, it computes far fewer terms, and it falls back to vLLM's sum rather than raise."""

from __future__ import annotations

import logging
import random

import pytest

pytest.importorskip("vllm")

from vllm_harness import Harness  # noqa: E402

from benchmarks.tiny_model import build  # noqa: E402

sched_mod = pytest.importorskip("tiering.vllm.scheduler")
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

if not hasattr(Scheduler, "_inflight_prefill_reserved_blocks"):  # pragma: no cover
    pytest.skip("this vLLM has no in-flight reservation (0.33 added it)", allow_module_level=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


def _extra(rows: int) -> dict:
    # 2 layers x 2 heads x 64 dims x 2 (K, V) x 4 bytes x 128 tokens = 256 KiB per chunk;
    # no cap on requests loading at once, so that many loads are in flight together
    return {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
            "block_size": 128, "cpu_bytes_to_use": rows * (256 << 10),
            "tiers": [{"medium": "cpu", "policy": "lru"}], "max_loading_requests": 0,
            "hits_first": False}  # vLLM's queue order: the decisions are compared step by step


class _Spy:
    """Counts the scheduler's calls of vLLM's per-request term, and records, at every admission
    that asks for the in-flight reservation, (requests in flight, the answer given, vLLM's sum
    computed independently)."""

    def __init__(self, sched: Scheduler) -> None:
        self.terms = 0
        self.asks: list[tuple[int, int, int]] = []
        term = sched._request_remaining_blocks
        reserved = sched._inflight_prefill_reserved_blocks

        def counted_term(req):
            self.terms += 1
            return term(req)

        def recorded_reserved():
            got = reserved()
            exact = sum(term(r) for r in sched._inflight_prefills)  # not counted
            self.asks.append((len(sched._inflight_prefills), got, exact))
            return got

        sched._request_remaining_blocks = counted_term
        sched._inflight_prefill_reserved_blocks = recorded_reserved


def _stored_then_watched(h: Harness, prompts: list[list[int]]) -> _Spy:
    """Store every prompt (one fill request each, run to the end), drop them from the GPU's
    prefix cache so that they come back as CPU hits, and start watching the asks."""
    for i, p in enumerate(prompts):
        h.add(f"fill{i}", p, max_tokens=1)
    h.run()
    h.reset_gpu_prefix_cache()
    return _Spy(h.scheduler)


def _run(model: str, cls: type | None, n: int = 10):
    """n prompts of different lengths stored, the GPU prefix cache reset, then the n again with
    n new ones interleaved (hits that load asynchronously, misses that prefill in chunks),
    stepped by hand; what every step scheduled, per step."""
    h = Harness(model, _extra(8 * n), gpu_tokens=6 * n * 512, delay=3, max_num_seqs=4 * n,
                batched_tokens=1024, scheduler_cls=cls)
    prompts = [prompt(300 + i, 384 + 64 * (i % 5)) for i in range(n)]
    spy = _stored_then_watched(h, prompts)
    steps = []
    for i, p in enumerate(prompts):
        h.add(f"hit{i}", p, max_tokens=2)
        h.add(f"new{i}", prompt(900 + i, 300 + 50 * i), max_tokens=2)
    for _ in range(300):
        if not h.scheduler.requests and not h._pending:
            break
        h.step()
        steps.append((sorted(h.scheduler.requests), h.loads, h.stores,
                      dict(sorted(h.cached.items()))))
    h.run()
    h.manager.shutdown()
    return h, spy, steps


def test_the_remembered_total_is_vllms_sum_and_scheduling_is_unchanged(model):
    """Step by step, the same requests left, the same loads and stores issued and the same hits
    found as under vLLM's own scheduler; at every admission the answer is vLLM's sum, with
    several loads in flight; and vLLM's per-request term is computed far fewer times."""
    theirs, their_spy, their_steps = _run(model, None)
    ours, our_spy, our_steps = _run(model, sched_mod.TieringSyncScheduler)
    assert our_steps == their_steps
    assert ours.loads == theirs.loads >= 10
    assert all(ours.cached[f"hit{i}"] >= 256 for i in range(10)), ours.cached
    assert our_spy.asks == their_spy.asks
    assert all(got == exact for _, got, exact in our_spy.asks)
    assert max(k for k, _, _ in our_spy.asks) >= 5  # several in flight at an admission
    assert any(exact > 0 for _, _, exact in our_spy.asks)  # the sum is not trivially 0
    # vLLM: one term per request in flight per admission; ours: one per change of a request
    assert their_spy.terms == sum(k for k, _, _ in their_spy.asks)
    assert our_spy.terms * 3 < their_spy.terms, (our_spy.terms, their_spy.terms)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_pass_sum_is_exact_when_loads_finish_and_prefills_start_between_asks(
        model, seed, monkeypatch):
    """Within one ``schedule()`` pass the total is kept between asks (``_PassSum``). Random
    traffic (hits that load over random delays, new prompts prefilled in chunks, a GPU cache
    tight enough to preempt, requests arriving mid-run): at every ask the answer is vLLM's sum,
    and asks were answered after requests were scheduled in the same pass (``running`` grew).
    (A finished load taken in mid-pass, ``touched``, cannot come after an ask in vLLM 0.33,
    which drains the requests holding KV blocks first; the mark is kept for a release that
    does not.)"""
    seen = {"pass_asks": 0, "ran": 0}
    update = sched_mod._PassSum.update

    def watched(self, inflight, term):
        seen["pass_asks"] += 1
        seen["ran"] += len(self.running) > self.running_seen
        return update(self, inflight, term)

    monkeypatch.setattr(sched_mod._PassSum, "update", watched)
    rng = random.Random(seed)
    n = 24
    h = Harness(model, _extra(8 * n), gpu_tokens=3 * n * 512, delay=rng.randrange(1, 4),
                max_num_seqs=4 * n, batched_tokens=768,
                scheduler_cls=sched_mod.TieringSyncScheduler)
    prompts = [prompt(seed * 1000 + i, rng.randrange(200, 600)) for i in range(n)]
    spy = _stored_then_watched(h, prompts)
    later = []
    for i, p in enumerate(prompts):
        if rng.random() < 0.4:
            later.append(i)  # arrives mid-run
        else:
            h.add(f"hit{i}", p, max_tokens=rng.randrange(1, 4))
        h.add(f"new{i}", prompt(seed * 1000 + 500 + i, rng.randrange(100, 700)),
              max_tokens=rng.randrange(1, 4))
    for step in range(400):
        if later and step % 2:
            i = later.pop()
            h.add(f"hit{i}", prompts[i], max_tokens=1)
        if not later and not h.scheduler.requests and not h._pending:
            break
        h.delay = rng.randrange(0, 4)
        h.step()
    h.run()
    h.manager.shutdown()
    assert spy.asks and all(got == exact for _, got, exact in spy.asks), [
        a for a in spy.asks if a[1] != a[2]][:5]
    assert seen["pass_asks"] >= 5 and seen["ran"] > 0, seen


def test_the_pass_sum_recomputes_what_a_pass_can_change():
    """``_PassSum`` alone: a counted request appended to ``running`` or marked touched since the
    last ask is recomputed, one that joined or left the set is added or taken out, the others
    are not asked again; a replaced or shortened ``running`` list ends the pass's sum."""
    a, b, c, d = (f"req-{i}" for i in range(4))
    term = {a: 3, b: 5, c: 7, d: 11}
    asked: list[str] = []

    def term_of(req):
        asked.append(req)
        return term[req]

    running = [a]
    sums = sched_mod._PassSum({a: 3, b: 5}, running)
    assert sums.total == 8 and sums.valid_for(running)
    term[a], term[b] = 1, 2  # changed, but nothing says so: the pass keeps what it counted
    assert sums.update({a, b}, term_of) == 8 and asked == []
    running.append(b)  # b was scheduled in this pass
    assert sums.update({a, b}, term_of) == 3 + 2 and asked == [b]
    sums.touched.add(a)  # a's finished load was taken in
    assert sums.update({a, b, c}, term_of) == 1 + 2 + 7 and sorted(asked) == [a, b, c]
    assert sums.update({a, c, d}, term_of) == 1 + 7 + 11  # b left, d joined
    assert not sums.valid_for(list(running)) and not sums.valid_for(running[:1])


def test_the_inflight_set_notes_who_joined_and_left_and_knows_when_it_cannot():
    """``_InflightSet`` behaves as the set vLLM made, notes ``add``/``discard``/``remove``, and
    any other change makes its notes incomplete (the pass sum then compares sets); the pass sum
    follows the notes."""
    s = sched_mod._InflightSet({"a"})
    s.add("b")
    s.discard("a")
    s.discard("zz")  # not a member: noted, harmless (the sum finds it absent)
    assert s == {"b"} and s.take_notes() == {"a", "b", "zz"} and s.take_notes() == set()
    for change in (lambda x: x.update({"c"}), lambda x: x.clear(), lambda x: x.pop(),
                   lambda x: x.__ior__({"d"}), lambda x: x.difference_update({"b"})):
        x = sched_mod._InflightSet({"b", "q"})
        change(x)
        assert x.take_notes() is None and x.take_notes() == set()
    x = sched_mod._InflightSet({"b"})
    x |= {"e"}
    assert type(x) is sched_mod._InflightSet and x == {"b", "e"} and x.take_notes() is None
    sums = sched_mod._PassSum({"b": 1}, [])
    s.add("c")
    assert sums.update(s, {"b": 1, "c": 4}.__getitem__) == 5
    s.discard("b")
    assert sums.update(s, {"c": 4}.__getitem__) == 4
    s.update({"d"})  # not noted: the sets are compared
    assert sums.update(s, {"c": 4, "d": 9}.__getitem__) == 13


def test_a_changed_request_is_recomputed(model):
    """A remembered term is not reused once its inputs change: a request's blocks or computed
    tokens change between two asks, and the answer follows vLLM's sum."""
    h = Harness(model, _extra(16), gpu_tokens=8 * 512, delay=1,
                scheduler_cls=sched_mod.TieringSyncScheduler)
    s = h.scheduler
    h.add("a", prompt(1, 512), max_tokens=1)
    req = s.requests["a"]
    s._inflight_prefills.add(req)  # as vLLM adds a request still prefilling
    first = s._inflight_prefill_reserved_blocks()
    assert first == s._request_remaining_blocks(req) == 512 // h.block_size
    bs = h.block_size
    assert s.kv_cache_manager.allocate_slots(req, bs) is not None  # one block held now
    assert s._inflight_prefill_reserved_blocks() == s._request_remaining_blocks(req) == first - 1
    assert s.kv_cache_manager.allocate_slots(req, 3 * bs) is not None  # only the count changes
    assert s._inflight_prefill_reserved_blocks() == s._request_remaining_blocks(req) == first - 3
    req.num_computed_tokens = 3 * bs  # as vLLM counts scheduled chunks: the same blocks needed
    assert s._inflight_prefill_reserved_blocks() == s._request_remaining_blocks(req)
    s._inflight_prefills.discard(req)
    assert s._inflight_prefill_reserved_blocks() == 0
    h.manager.shutdown()


def test_a_failure_falls_back_to_vllms_sum_without_raising(model, caplog):
    """Anything failing in the remembered total is logged once and answered with vLLM's own
    sum, now and from then on: never an exception into vLLM's scheduler."""
    h = Harness(model, _extra(16), gpu_tokens=8 * 512,
                scheduler_cls=sched_mod.TieringSyncScheduler)
    s = h.scheduler
    h.add("a", prompt(2, 512), max_tokens=1)
    s._inflight_prefills.add(s.requests["a"])
    s._tiering_groups = ((None, None),)  # a layout the memo cannot read
    with caplog.at_level(logging.ERROR, logger="tiering.vllm.scheduler"):
        assert s._inflight_prefill_reserved_blocks() == 512 // h.block_size
        assert s._inflight_prefill_reserved_blocks() == 512 // h.block_size
    assert len([r for r in caplog.records if "remembering reservations failed" in r.message]) == 1
    h.manager.shutdown()


def test_the_check_mode_catches_a_wrong_remembered_term(model, caplog, monkeypatch):
    """TIERING_SCHEDULER_CHECK=1: a remembered term that no longer matches vLLM's is reported
    and vLLM's sum is returned (the check is not vacuous)."""
    monkeypatch.setenv(sched_mod.CHECK_ENV, "1")
    h = Harness(model, _extra(16), gpu_tokens=8 * 512,
                scheduler_cls=sched_mod.TieringSyncScheduler)
    s = h.scheduler
    h.add("a", prompt(3, 512), max_tokens=1)
    s._inflight_prefills.add(s.requests["a"])
    exact = s._inflight_prefill_reserved_blocks()
    (key,) = s._tiering_terms
    assert key[0] == "a"
    s._tiering_terms[key] += 5  # what a missed input would leave behind
    with caplog.at_level(logging.ERROR, logger="tiering.vllm.scheduler"):
        assert s._inflight_prefill_reserved_blocks() == exact
    assert any("!= vLLM's" in r.message for r in caplog.records)
    h.manager.shutdown()


def test_another_kv_cache_layout_is_summed_as_vllm_does(model):
    """A manager other than plain full attention (here a stand-in subclass, as vLLM's sliding
    window and sparse managers are) turns the memo off: vLLM's own sum is used."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    h = Harness(model, _extra(16), gpu_tokens=8 * 512,
                scheduler_cls=sched_mod.TieringSyncScheduler)
    s = h.scheduler
    assert s._tiering_groups is not None
    mgr = s.kv_cache_manager.coordinator.single_type_managers[0]

    class Windowed(FullAttentionManager):
        pass

    mgr.__class__ = Windowed
    assert s._full_attention_groups() is None
    h.manager.shutdown()


def test_the_scheduler_named_to_vllm_follows_its_async_setting(model):
    """``--scheduler-cls tiering.vllm.scheduler.TieringScheduler``: vLLM builds what it names
    whatever async scheduling is; it builds the async scheduler where that is on."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    h = Harness(model, None)
    cls = resolve_obj_by_qualname("tiering.vllm.scheduler.TieringScheduler")
    kv = h.scheduler.kv_cache_config
    from vllm.v1.structured_output import StructuredOutputManager

    for on, base in ((True, AsyncScheduler), (False, Scheduler)):
        h.config.scheduler_config.async_scheduling = on
        s = cls(vllm_config=h.config, kv_cache_config=kv,
                structured_output_manager=StructuredOutputManager(h.config),
                block_size=h.block_size, log_stats=False)
        assert isinstance(s, base) and isinstance(s, sched_mod._ReservationMemo)
        assert isinstance(s, AsyncScheduler) == on
        assert s._tiering_terms == {} and s._inflight_prefill_reserved_blocks() == 0
