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
