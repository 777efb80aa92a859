"""tiering.vllm.MooncakeTier, our Mooncake Store tier as vLLM's SecondaryTierManager, against a
real mooncake_master: on its own (two engines' tiers share a chunk: RETRY, then HIT, then the
exact bytes in the other engine's primary rows) and under vLLM's own tiering manager (one
engine's cascade is another engine's promotion)."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")
pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from mooncake_util import MooncakeMaster  # noqa: E402
from test_vllm_adapters import KEYS  # noqa: E402
from test_vllm_secondary import finish, job, spec_stub  # noqa: E402
from test_vllm_spec import BLOCK, config, shm_in_tmp  # noqa: E402,F401 - fixture reused
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tiering.vllm import MooncakeTier  # noqa: E402

ROWS = 8


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.close()


def rows_of(seed: int) -> np.ndarray:
    buf = mmap.mmap(-1, ROWS * BLOCK)
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(ROWS, BLOCK)
    rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
    return rows


def tier_config(master: MooncakeMaster) -> dict:
    return {**master.tier_config(local_hostname="127.0.0.1", timeout_s=1.0)}


def wait_until(fn, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        r = fn()
        if r or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_two_engines_share_a_chunk_exactly(master):
    a_rows, b_rows = rows_of(1), rows_of(2)
    a = MooncakeTier(spec_stub(False), memoryview(a_rows), "MooncakeTier", **tier_config(master))
    b = MooncakeTier(spec_stub(False), memoryview(b_rows), "MooncakeTier", **tier_config(master))
    try:
        assert a.locality is Locality.REMOTE
        assert wait_until(lambda: a.tier.wait_connected(0.1) and b.tier.wait_connected(0.1))
        keys = [b"sec-%d-%d" % (time.monotonic_ns(), i) for i in range(3)]
        a.submit_store(job(1, keys, [0, 1, 2]))
        assert [r.success for r in finish(a)] == [True]
        ctx = ReqContext(req_id="r")
        assert b.lookup(keys[0], ctx) == LookupResult.RETRY  # the master is being asked
        assert wait_until(lambda: all(b.lookup(k, ctx) == LookupResult.HIT for k in keys))
        b.submit_load(job(2, keys, [5, 6, 7], promotion=True))
        (done,) = finish(b)
        assert done.success and done.transfer_bytes == 3 * BLOCK
        for src, dst in ((0, 5), (1, 6), (2, 7)):
            assert np.array_equal(b_rows[dst], a_rows[src])
        unknown = b"sec-unknown-%d" % time.monotonic_ns()
        assert b.lookup(unknown, ctx) == LookupResult.RETRY
        assert wait_until(lambda: b.lookup(unknown, ctx) == LookupResult.MISS)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_store_in_vllms_canonical_layout_is_not_anothers_hit(master):
    """vLLM's ``canonical_layout`` rows (every KV head of a layer in one page) are other bytes
    than the direct layout's in rows of the same size: in the shared store, an engine with one
    layout never hits the chunks an engine with the other stored."""
    import dataclasses

    canonical_stub = spec_stub(False)
    canonical_stub.config = dataclasses.replace(canonical_stub.config, canonical_layout=True)
    a = MooncakeTier(spec_stub(False), memoryview(rows_of(4)), "MooncakeTier",
                     **tier_config(master))
    b = MooncakeTier(canonical_stub, memoryview(rows_of(5)), "MooncakeTier",
                     **tier_config(master))
    try:
        assert wait_until(lambda: a.tier.wait_connected(0.1) and b.tier.wait_connected(0.1))
        keys = [b"canon-%d-%d" % (time.monotonic_ns(), i) for i in range(2)]
        a.submit_store(job(1, keys, [0, 1]))
        assert [r.success for r in finish(a)] == [True]
        ctx = ReqContext(req_id="r")
        assert wait_until(lambda: all(a.lookup(k, ctx) == LookupResult.HIT for k in keys))
        assert wait_until(lambda: all(b.lookup(k, ctx) == LookupResult.MISS for k in keys))
    finally:
        a.shutdown()
        b.shutdown()


def test_bad_setting_fails_the_engine_naming_it():
    with pytest.raises(ValueError, match=r"secondary tier 'MooncakeTier'.*'master' is required"):
        MooncakeTier(spec_stub(False), memoryview(rows_of(3)), "MooncakeTier",
                     metadata="http://127.0.0.1:1/metadata")


def vllm_tiering(master: MooncakeMaster, engine: str):
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * BLOCK,
             "secondary_tiers": [{"type": "MooncakeTier", "module_path": "tiering.vllm",
                                  **tier_config(master)}]}
    return TieringOffloadingSpec(config(extra, engine=engine)).get_manager()


def step(m, ctx, key, want, steps: int = 400):
    r = None
    for _ in range(steps):
        m.on_schedule_end(ScheduleEndContext([], []))
        r = m.lookup(key, ctx)
        if r == want:
            return r
        time.sleep(0.01)
    return r


def test_under_vllm_tiering_one_engines_store_is_anothers_hit(master):
    writer = vllm_tiering(master, f"w{time.monotonic_ns()}")
    reader = vllm_tiering(master, f"r{time.monotonic_ns()}")
    try:
        ctx = ReqContext(req_id="w")
        writer.on_new_request(ctx)
        keys = KEYS[:3]
        for m in (writer, reader):  # set up (a store before that is not admitted)
            assert m.secondary_tiers[0].tier.wait_connected(30)
        writer.prepare_store(keys, ctx)
        writer.complete_store(keys, ctx)  # cascade: written through to the Mooncake tier
        deadline = time.monotonic() + 15
        while writer.has_pending_work() and time.monotonic() < deadline:
            step(writer, ctx, keys[0], LookupResult.HIT, steps=1)
        rctx = ReqContext(req_id="r")
        reader.on_new_request(rctx)
        assert step(reader, rctx, keys[1], LookupResult.HIT) == LookupResult.HIT
        assert str(reader.get_load_source(keys[1], rctx).value) == "disk"
    finally:
        writer.shutdown()
        reader.shutdown()
