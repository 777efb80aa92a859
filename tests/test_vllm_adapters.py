"""Our pieces inside vLLM's own offloading: FileTier under TieringOffloadingSpec, and our
policies inside CPUOffloadingManager."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from test_vllm_spec import BLOCK, config, shm_in_tmp  # noqa: E402,F401 - fixture reused
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tiering.backends.reader import NamespaceReader, find_namespaces  # noqa: E402
from tiering.vllm.compat import VLLM_VERSION  # noqa: E402

KEYS = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(12)]


def step_until(m, ctx, key, want, steps=200):
    for _ in range(steps):
        m.on_schedule_end(ScheduleEndContext([], []))
        r = m.lookup(key, ctx)
        if r == want and not m.has_pending_work():
            return r
        time.sleep(0.005)
    return r


def tiering_manager(tmp_path, **tier):
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * BLOCK,
             "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                                  "path": str(tmp_path / "kv"), "capacity": 8 * BLOCK,
                                  "io": "posix", **tier}]}
    return TieringOffloadingSpec(config(extra, engine=f"t{time.monotonic_ns()}")).get_manager()


def test_file_tier_under_vllm_tiering_cascades_and_promotes(tmp_path):
    m = tiering_manager(tmp_path)
    ctx = ReqContext(req_id="r")
    m.on_new_request(ctx)
    m.prepare_store(KEYS[:4], ctx)
    m.complete_store(KEYS[:4], ctx)  # cascade: written through to our file tier
    assert step_until(m, ctx, KEYS[0], LookupResult.HIT) == LookupResult.HIT
    m.reset_cache()  # the CPU tier forgets, the disk keeps
    # vLLM 0.33 holds promotions until the workers report the reset flushed
    getattr(m, "on_reset_flushed", lambda: None)()
    assert m.lookup(KEYS[2], ctx) == LookupResult.HIT_PENDING
    assert step_until(m, ctx, KEYS[2], LookupResult.HIT) == LookupResult.HIT
    assert str(m.get_load_source(KEYS[2], ctx).value) == "disk"
    m.shutdown()
    (ns,) = find_namespaces(tmp_path / "kv")
    with NamespaceReader(ns) as r:
        assert r.index.count() == 4
        assert r.verify() == []


def test_file_tier_under_vllm_tiering_is_bounded_and_persistent(tmp_path):
    m = tiering_manager(tmp_path, policy="lru")
    ctx = ReqContext(req_id="r")
    m.on_new_request(ctx)
    for lo in range(0, 12, 4):  # 12 chunks through a 4-row CPU tier into an 8-slot disk
        out = m.prepare_store(KEYS[lo:lo + 4], ctx)
        assert out is not None
        m.complete_store(KEYS[lo:lo + 4], ctx)
        step_until(m, ctx, KEYS[lo], LookupResult.HIT)
    m.shutdown()
    (ns,) = find_namespaces(tmp_path / "kv")
    with NamespaceReader(ns) as r:
        assert r.index.count() == 8  # capacity held: the 4 oldest were evicted
    m2 = tiering_manager(tmp_path, policy="lru")  # a restart
    ctx2 = ReqContext(req_id="r2")
    m2.on_new_request(ctx2)
    assert m2.lookup(KEYS[0], ctx2) == LookupResult.MISS  # evicted
    assert m2.lookup(KEYS[11], ctx2) == LookupResult.HIT_PENDING  # kept across the restart
    assert step_until(m2, ctx2, KEYS[11], LookupResult.HIT) == LookupResult.HIT
    m2.shutdown()


def test_bad_secondary_tier_key_names_it(tmp_path):
    with pytest.raises(ValueError, match="unknown key.*'capacty'"):
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * BLOCK,
                 "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                                      "path": str(tmp_path / "kv"), "capacity": "1MiB",
                                      "capacty": 3}]}
        TieringOffloadingSpec(config(extra, engine="bad")).get_manager()


@pytest.mark.parametrize("name", ["S3FIFOPolicy", "TieringARCPolicy", "TieringLRUPolicy"])
def test_our_policy_inside_vllm_cpu_manager(name):
    m = CPUOffloadingManager(num_chunks=4, cache_policy=name,
                             cache_policy_module_path="tiering.vllm")
    ctx = ReqContext(req_id="r")
    out = m.prepare_store(KEYS[:4], ctx)
    assert out.keys_to_store == KEYS[:4]
    assert m.lookup(KEYS[0], ctx) == LookupResult.HIT_PENDING
    assert m.prepare_store(KEYS[4:5], ctx) is None  # all four still being written: none evictable
    m.complete_store(KEYS[:4], ctx)
    m.prepare_load(KEYS[:2], ctx)  # pinned by a load
    out = m.prepare_store(KEYS[4:6], ctx)
    assert out is not None and set(out.evicted_keys) == {KEYS[2], KEYS[3]}
    assert m.prepare_store(KEYS[6:7], ctx) is None  # the rest is pinned or being written
    m.complete_load(KEYS[:2], ctx)
    m.complete_store(KEYS[4:6], ctx)
    assert m.lookup(KEYS[0], ctx) == LookupResult.HIT
    assert m.lookup(KEYS[2], ctx) == LookupResult.MISS


def _positioned_context(req_id: str, keys: list[bytes]) -> ReqContext:
    """A request context that knows each key's end token, as vLLM's scheduler records it."""
    ctx = ReqContext(req_id=req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    return ctx


def _evict_one_by_one(m, ctx, fresh: list[bytes]) -> list[bytes]:
    """Store one new key at a time into a full manager; return the keys pushed out, in order."""
    victims = []
    for k in fresh:
        out = m.prepare_store([k], ctx)
        assert out is not None
        victims += list(out.evicted_keys)
        m.complete_store([k], ctx)
    return victims


POLICIES = ["S3FIFOPolicy", "TieringARCPolicy", "TieringLRUPolicy"]
# vLLM's own policies as references for the ordering contract: 0.33's LRU orders a running
# request's chunks tail first (0.32's and both ARCs only once the request has finished).
IN_REQUEST_REFERENCE = ["lru"] if VLLM_VERSION >= (0, 33) else []


def _cpu_manager(name: str, num_chunks: int) -> CPUOffloadingManager:
    if name in ("lru", "arc"):  # vLLM's own, as the reference for the ordering contract
        return CPUOffloadingManager(num_chunks=num_chunks, cache_policy=name)
    return CPUOffloadingManager(num_chunks=num_chunks, cache_policy=name,
                                cache_policy_module_path="tiering.vllm")


@pytest.mark.parametrize("name", [*IN_REQUEST_REFERENCE, *POLICIES])
def test_policy_evicts_the_tail_of_a_stored_prefix_first(name):
    """One request stores a 4-chunk prefix in one batch; under pressure from another request the
    tail goes first, so the head (which every later chunk needs) stays hittable."""
    m = _cpu_manager(name, 4)
    prefix = KEYS[:4]
    ctx = _positioned_context("a", prefix)
    m.on_new_request(ctx)
    m.prepare_store(prefix, ctx)
    m.complete_store(prefix, ctx)
    other = ReqContext(req_id="b")
    m.on_new_request(other)
    assert _evict_one_by_one(m, other, KEYS[4:7]) == [KEYS[3], KEYS[2], KEYS[1]]
    assert m.lookup(KEYS[0], other) == LookupResult.HIT


# vLLM 0.32 passes no request context to insert(): there a request's batches are ordered when
# it finishes (next test); this one exists only where 0.33 passes the context.
if VLLM_VERSION >= (0, 33):
    @pytest.mark.parametrize("name", [*IN_REQUEST_REFERENCE, *POLICIES])
    def test_policy_evicts_the_tail_first_across_store_batches(name):
        """A long prompt is stored over several scheduler steps (chunked prefill): the chunks of a
        later batch are still the request's tail and go before the earlier batches' chunks."""
        m = _cpu_manager(name, 4)
        prefix = KEYS[:4]
        ctx = _positioned_context("a", prefix)
        m.on_new_request(ctx)
        for lo in (0, 2):
            m.prepare_store(prefix[lo:lo + 2], ctx)
            m.complete_store(prefix[lo:lo + 2], ctx)
        other = ReqContext(req_id="b")
        m.on_new_request(other)
        assert _evict_one_by_one(m, other, KEYS[4:6]) == [KEYS[3], KEYS[2]]


@pytest.mark.parametrize("name", ["lru", "arc", *POLICIES])
def test_policy_keeps_tail_first_order_after_the_request_finished(name):
    m = _cpu_manager(name, 4)
    prefix = KEYS[:4]
    ctx = _positioned_context("a", prefix)
    m.on_new_request(ctx)
    for lo in (0, 2):
        m.prepare_store(prefix[lo:lo + 2], ctx)
        m.complete_store(prefix[lo:lo + 2], ctx)
    m.on_request_finished(ctx)
    other = ReqContext(req_id="b")
    m.on_new_request(other)
    assert _evict_one_by_one(m, other, KEYS[4:8]) == [KEYS[3], KEYS[2], KEYS[1], KEYS[0]]


@pytest.mark.parametrize("name", ["lru", "arc", *POLICIES])
def test_policy_reused_prefix_outlives_a_newer_one_shot_prefix(name):
    """Request b reuses a's head and adds its own tail: at b's end the reused head is the most
    recent, b's new tail goes first, then a's unreused tail."""
    m = _cpu_manager(name, 6)
    a = _positioned_context("a", KEYS[:4])
    m.on_new_request(a)
    m.prepare_store(KEYS[:4], a)
    m.complete_store(KEYS[:4], a)
    m.on_request_finished(a)
    b_keys = KEYS[:2] + KEYS[4:6]
    b = _positioned_context("b", b_keys)
    m.on_new_request(b)
    m.prepare_load(KEYS[:2], b)
    m.complete_load(KEYS[:2], b)
    m.prepare_store(b_keys, b)
    m.complete_store(KEYS[4:6], b)
    m.on_request_finished(b)
    c = ReqContext(req_id="c")
    m.on_new_request(c)
    victims = _evict_one_by_one(m, c, KEYS[6:10])
    assert KEYS[0] not in victims and KEYS[1] not in victims
    assert victims.index(KEYS[5]) < victims.index(KEYS[4])
    assert victims.index(KEYS[3]) < victims.index(KEYS[2])
