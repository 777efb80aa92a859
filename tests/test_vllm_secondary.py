"""tiering.vllm.FileSecondaryTier, the SecondaryTierManager, on its own and under vLLM's tiering manager:
locality, KV events (stored, evicted, dropped; none while vLLM's KV events are off), empty jobs."""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
from test_vllm_adapters import KEYS, step_until, tiering_manager  # noqa: E402
from test_vllm_spec import BLOCK, config, shm_in_tmp  # noqa: E402,F401 - fixture reused
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    ReqContext,
    TierFilter,
    TierMatcher,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from tiering.vllm import FileSecondaryTier  # noqa: E402

ROWS = 8


def spec_stub(events: bool) -> SimpleNamespace:
    """What a SecondaryTierManager reads from its spec: the config and the KV-events switch."""
    return SimpleNamespace(
        config=config({}, engine="sec"), blocks_per_chunk=1,
        kv_events_config=OffloadingKVEventsConfig(enable_kv_cache_events=events,
                                                  self_describing_kv_events=False))


@pytest.fixture
def primary():
    """A page-aligned primary CPU tier of ROWS rows, as vLLM hands it to secondary tiers."""
    buf = mmap.mmap(-1, ROWS * BLOCK)
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(ROWS, BLOCK)
    rows[:] = np.random.default_rng(7).integers(0, 256, rows.shape, dtype=np.uint8)
    yield rows
    del rows


def make_tier(tmp_path, primary, events=True, **cfg) -> FileSecondaryTier:
    tier_cfg = {"path": str(tmp_path / "kv"), "capacity": 4 * BLOCK, "io": "posix", "policy": "lru",
                **cfg}
    return FileSecondaryTier(spec_stub(events), memoryview(primary), "FileTier", **tier_cfg)


def job(job_id: int, keys: list[bytes], chunk_ids: list[int], promotion=False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64),
                       is_promotion=promotion, req_context=ReqContext(req_id="r"))


def finish(tier: FileSecondaryTier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def store(tier: FileSecondaryTier, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
    tier.submit_store(job(job_id, keys, chunk_ids))
    assert [r.success for r in finish(tier)] == [True]


@pytest.mark.parametrize("value", ["local", "", "nearby", 3])
def test_bad_locality_is_one_clear_error(tmp_path, primary, value):
    with pytest.raises(ValueError, match=r"'FileTier'.*locality.*Locality"):
        make_tier(tmp_path, primary, locality=value)
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("value, expected", [(None, None), ("LOCAL", Locality.LOCAL),
                                             ("REMOTE", Locality.REMOTE)])
def test_locality_is_kept_and_carried_by_events(tmp_path, primary, value, expected):
    tier = make_tier(tmp_path, primary, **({} if value is None else {"locality": value}))
    try:
        assert tier.locality is expected
        store(tier, 1, KEYS[:2], [0, 1])
        (event,) = tier.take_events()
        assert event.keys == KEYS[:2] and not event.removed
        assert event.medium == Medium.STORAGE and event.locality is expected
    finally:
        tier.shutdown()


def test_remote_tier_does_not_serve_a_request_for_local_tiers(tmp_path):
    m = tiering_manager(tmp_path, locality="REMOTE")
    ctx = ReqContext(req_id="w")
    m.on_new_request(ctx)
    m.prepare_store(KEYS[:4], ctx)
    m.complete_store(KEYS[:4], ctx)
    step_until(m, ctx, KEYS[0], LookupResult.HIT)
    m.reset_cache()  # the CPU tier forgets: only the file tier has the chunks
    getattr(m, "on_reset_flushed", lambda: None)()
    local_only = ReqContext(req_id="l", load_tier_filter=TierFilter(
        (TierMatcher(Medium.STORAGE, Locality.LOCAL),)))
    m.on_new_request(local_only)
    assert m.lookup(KEYS[1], local_only) == LookupResult.MISS
    anywhere = ReqContext(req_id="a")
    m.on_new_request(anywhere)
    assert m.lookup(KEYS[1], anywhere) == LookupResult.HIT_PENDING
    assert step_until(m, anywhere, KEYS[1], LookupResult.HIT) == LookupResult.HIT
    m.shutdown()


def test_remote_tier_itself_misses_a_request_for_local_tiers(tmp_path, primary):
    tier = make_tier(tmp_path, primary, locality="REMOTE")
    try:
        store(tier, 1, KEYS[:1], [0])
        local_only = ReqContext(req_id="l", load_tier_filter=TierFilter(
            (TierMatcher(None, Locality.LOCAL),)))
        assert tier.lookup(KEYS[0], local_only) == LookupResult.MISS
        assert tier.lookup(KEYS[0], ReqContext(req_id="a")) == LookupResult.HIT
    finally:
        tier.shutdown()


def test_eviction_emits_a_removed_event(tmp_path, primary):
    tier = make_tier(tmp_path, primary)  # room for 4 rows, LRU
    try:
        store(tier, 1, KEYS[:4], [0, 1, 2, 3])
        store(tier, 2, KEYS[4:6], [4, 5])  # pushes out two of the first job's chunks
        events = list(tier.take_events())
        removed = [k for e in events if e.removed for k in e.keys]
        stored = [k for e in events if not e.removed for k in e.keys]
        assert sorted(stored) == sorted(KEYS[:6])
        assert len(removed) == 2 and set(removed) <= set(KEYS[:4])
        for k in removed:
            assert tier.lookup(k, ReqContext(req_id="x")) == LookupResult.MISS
        assert all(e.medium == Medium.STORAGE for e in events)
    finally:
        tier.shutdown()


def test_dropping_a_corrupt_chunk_emits_a_removed_event(tmp_path, primary):
    tier = make_tier(tmp_path, primary)
    try:
        store(tier, 1, KEYS[:2], [0, 1])
        list(tier.take_events())
        for slab in (tmp_path / "kv").glob("*/slab-*.dat"):  # every stored byte damaged
            size = slab.stat().st_size
            with open(slab, "r+b") as fh:
                fh.write(os.urandom(size))
        tier.submit_load(job(2, KEYS[:1], [6], promotion=True))
        (result,) = finish(tier)
        assert not result.success
        (event,) = tier.take_events()
        assert event.removed and event.keys == KEYS[:1]
        assert tier.lookup(KEYS[0], ReqContext(req_id="x")) == LookupResult.MISS
    finally:
        tier.shutdown()


def test_no_events_while_vllm_kv_events_are_off(tmp_path, primary):
    tier = make_tier(tmp_path, primary, events=False)
    try:
        store(tier, 1, KEYS[:4], [0, 1, 2, 3])
        store(tier, 2, KEYS[4:6], [4, 5])  # evictions too
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_tier_can_opt_out_of_events(tmp_path, primary):
    tier = make_tier(tmp_path, primary, enable_kv_events=False)
    try:
        store(tier, 1, KEYS[:4], [0, 1, 2, 3])
        store(tier, 2, KEYS[4:6], [4, 5])
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_empty_jobs_succeed(tmp_path, primary):
    tier = make_tier(tmp_path, primary)
    try:
        tier.submit_store(job(1, [], []))
        tier.submit_load(job(2, [], [], promotion=True))
        results = {r.job_id: r for r in finish(tier)}
        assert set(results) == {1, 2}
        assert results[1].success and results[2].success
        assert results[2].successful_keys is None
    finally:
        tier.shutdown()


def test_load_of_a_missing_chunk_fails_and_keeps_the_present_ones(tmp_path, primary):
    tier = make_tier(tmp_path, primary)
    try:
        store(tier, 1, KEYS[:2], [0, 1])
        want = bytes(primary[0])
        primary[6] = 0
        tier.submit_load(job(2, [KEYS[0], KEYS[9]], [6, 7], promotion=True))
        (result,) = finish(tier)
        assert not result.success and list(result.successful_keys) == [KEYS[0]]
        assert bytes(primary[6]) == want
    finally:
        tier.shutdown()


def test_example_secondary_tier_config_is_accepted(tmp_path, primary):
    """examples/tiering_secondary_tier.json's tier, through vLLM's own tier factory."""
    import json
    from pathlib import Path

    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    example = Path(__file__).parent.parent / "examples" / "tiering_secondary_tier.json"
    (tier_cfg,) = json.loads(example.read_text())["kv_connector_extra_config"]["secondary_tiers"]
    tier_cfg.update(path=str(tmp_path / "kv"), capacity=4 * BLOCK)  # the machine's disk aside
    tier = SecondaryTierFactory.create_secondary_tier(tier_cfg, memoryview(primary),
                                                      spec_stub(events=True))
    try:
        assert isinstance(tier, FileSecondaryTier) and tier.locality is Locality.LOCAL
        ctx = ReqContext(req_id="x")
        store(tier, 1, KEYS[:2], [0, 1])  # first offer: store_threshold 2 holds it back
        assert tier.lookup(KEYS[1], ctx) == LookupResult.MISS
        store(tier, 2, KEYS[:2], [0, 1])
        assert tier.lookup(KEYS[1], ctx) == LookupResult.HIT
    finally:
        tier.shutdown()


@pytest.mark.parametrize("extra, bpc", [({}, 1), ({"blocks_per_chunk": 2}, 2)])
def test_under_vllm_tiering_on_cuda_the_namespace_keeps_vllms_chunk(tmp_path, monkeypatch,
                                                                     extra, bpc):
    """Our 64-token CUDA default is our spec's alone: under vLLM's TieringOffloadingSpec the
    chunk is vLLM's (one GPU block unless named), and our file tier's namespace records that
    chunk, whatever the platform."""
    import json

    from test_vllm_spec import _chunk_config, _group
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    import tiering.vllm.compat as compat
    import tiering.vllm.spec as spec_mod
    from tiering.backends.reader import find_namespaces

    monkeypatch.setattr(spec_mod, "is_cuda_platform", lambda: True)
    monkeypatch.setattr(compat, "is_cuda_platform", lambda: True)
    ex = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * bpc * BLOCK,
          "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                               "path": str(tmp_path / "kv"), "capacity": 8 * bpc * BLOCK,
                               "io": "posix"}], **extra}
    spec = TieringOffloadingSpec(_chunk_config((_group(16),), ex, bpc=bpc, engine=f"v{bpc}"))
    assert spec.blocks_per_chunk == bpc
    m = spec.get_manager()
    m.shutdown()
    (ns,) = find_namespaces(tmp_path / "kv")
    meta = json.loads((ns / "meta.json").read_text())
    assert meta["chunk_tokens"] == 16 * bpc


def test_rows_in_vllms_canonical_layout_are_another_namespace(tmp_path, primary):
    """Under vLLM's TieringOffloadingSpec, ``canonical_layout`` makes vLLM's CPU rows hold
    canonical pages (every KV head of a layer, whatever the parallelism) instead of each
    worker's own pages: other bytes in rows of the same size. A file cache written with one
    layout must never serve an engine with the other (real files, real LMDB), and each keeps
    its own rows."""
    import dataclasses

    from tiering.backends.reader import find_namespaces

    key = KEYS[0]

    def open_tier(canonical: bool) -> FileSecondaryTier:
        stub = spec_stub(False)
        stub.config = dataclasses.replace(stub.config, canonical_layout=canonical)
        return FileSecondaryTier(stub, memoryview(primary), "FileTier", path=str(tmp_path / "kv"),
                                 capacity=4 * BLOCK, io="posix", policy="lru")

    direct = open_tier(False)
    store(direct, 1, [key], [2])
    direct.shutdown()
    canonical = open_tier(True)
    assert canonical.lookup(key, ReqContext(req_id="r")) is LookupResult.MISS
    store(canonical, 2, [KEYS[1]], [3])
    canonical.shutdown()
    assert len(find_namespaces(tmp_path / "kv")) == 2
    direct = open_tier(False)
    assert direct.lookup(key, ReqContext(req_id="r")) is LookupResult.HIT
    assert direct.lookup(KEYS[1], ReqContext(req_id="r")) is LookupResult.MISS
    direct.shutdown()


@pytest.mark.parametrize("cfg, want", [
    ({}, 0.0005),  # the default: our I/O threads read while vLLM's scheduler thread runs Python
    ({"switch_interval_ms": 2}, 0.002),
    ({"switch_interval_ms": 0}, 0.005),  # 0: Python's own
    ({"switch_interval_ms": 50}, 0.005),  # never raised
])
def test_the_file_tier_under_vllms_spec_shortens_the_switch_interval(tmp_path, primary, cfg, want):
    """Under vLLM's TieringOffloadingSpec our file tier's reads wait for the GIL as under ours
    (docs/benchmarks.md, the eleventh run): the process's interval is lowered the same way."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        tier = make_tier(tmp_path, primary, **cfg)
        assert sys.getswitchinterval() == pytest.approx(want)
        tier.shutdown()
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("value", [-1, "0.5", True, 1e9])
def test_a_bad_switch_interval_is_one_clear_error(tmp_path, primary, value):
    with pytest.raises(ValueError, match="switch_interval_ms: expected a number"):
        make_tier(tmp_path, primary, switch_interval_ms=value)
    assert not (tmp_path / "kv").exists()  # refused before the tier's folder was made
