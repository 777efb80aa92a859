"""TieredOffloadingSpec at engine start: config errors name the key; the manager works in-process
through vLLM's own types."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

import tiering.backends.staging as staging  # noqa: E402
from tiering.vllm import TieredOffloadingSpec  # noqa: E402

BLOCK = 1 << 16  # worker KV bytes per block


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def config(extra: dict, engine="eng") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0", "l1"), 0),), worker_kv_bytes_per_block=BLOCK,
        enable_kv_cache_events=True, extra_config=extra, engine_id=engine,
        model=OffloadingModelConfig("tiny", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout="LBHNC")


def good(tmp_path, **over) -> dict:
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "cpu_bytes_to_use": 8 * BLOCK,
             "tiers": [{"medium": "cpu", "policy": "arc"},
                       {"medium": "file", "path": str(tmp_path / "kv"), "capacity": "4MiB",
                        "io": "posix", "store_threshold": 0}]}
    extra.update(over)
    return extra


@pytest.mark.parametrize("mutate, message", [
    (lambda e: e.update(colour=1), "unknown key.*'colour'"),
    (lambda e: e.update(cpu_bytes_to_use="lots"), "cpu_bytes_to_use: expected a byte size"),
    (lambda e: e.pop("cpu_bytes_to_use"), "cpu_bytes_to_use: required"),
    (lambda e: e.update(cpu_bytes_to_use=1000), "cpu_bytes_to_use: 1000 bytes holds no row"),
    (lambda e: e.update(cpu_bytes_to_use=1e6 + 0.5), "cpu_bytes_to_use: .*whole number of bytes"),
    (lambda e: e.update(cpu_bytes_to_use=-4e10), "cpu_bytes_to_use: must not be negative"),
    (lambda e: e.update(cpu_bytes_to_use=float("nan")), "cpu_bytes_to_use: .*whole number"),
    (lambda e: e.update(cpu_bytes_to_use=float("inf")), "cpu_bytes_to_use: .*whole number"),
    (lambda e: e["tiers"][1].pop("path"), r"tiers\[1\].path: required"),
    (lambda e: e["tiers"][1].update(capacity="1XB"), r"tiers\[1\].*capacity"),
    (lambda e: e["tiers"][1].update(capacity=1000), r"tiers\[1\].capacity: 1000 bytes holds no"),
    (lambda e: e["tiers"][1].update(policy="nope"), r"tiers\[1\].*unknown policy 'nope'"),
    (lambda e: e["tiers"][0].update(policy="nope"), r"tiers\[0\].policy.*unknown policy"),
    (lambda e: e["tiers"][1].update(medium="tape"), r"tiers\[1\].medium: expected 'file'"),
    (lambda e: e["tiers"][0].update(medium="file"), r"tiers\[0\].medium: tier 0 .* 'cpu'"),
    (lambda e: e["tiers"][1].update(speed=3), r"tiers\[1\]: unknown key.*'speed'"),
    (lambda e: e.update(gpu_copy="fast"), "gpu_copy: expected one of auto, dma, staged, direct"),
    (lambda e: e.update(max_loading_requests=-1), "max_loading_requests: expected an integer"),
    (lambda e: e.update(max_loading_requests="8"), "max_loading_requests: expected an integer"),
])
def test_bad_config_is_one_clear_error_before_allocation(tmp_path, mutate, message):
    extra = good(tmp_path)
    mutate(extra)
    with pytest.raises(ValueError, match=message):
        TieredOffloadingSpec(config(extra))
    assert not (tmp_path / "kv").exists()
    assert not (tmp_path / "shm").exists() or not list((tmp_path / "shm").iterdir())


@pytest.mark.parametrize("value", [4e10, float(8 * BLOCK), 16.0 * 2**30])
def test_integral_float_cpu_bytes_is_accepted(tmp_path, value):
    """vLLM's own spec takes a JSON float here, and --kv-offloading-size <GiB> writes one."""
    spec = TieredOffloadingSpec(config(good(tmp_path, cpu_bytes_to_use=value)))
    assert spec.cfg.cpu_bytes_to_use == int(value)
    assert isinstance(spec.cfg.cpu_bytes_to_use, int)
    assert spec.num_rows == int(value) // spec.row_bytes


def test_manager_store_lookup_promote_through_vllm_types(tmp_path):
    spec = TieredOffloadingSpec(config(good(tmp_path)))
    m = spec.get_manager()
    ctx = ReqContext(req_id="r1", kv_transfer_params=None) if _takes_kw() else None
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(10)]
    out = m.prepare_store(keys[:8], ctx)
    assert out.keys_to_store == keys[:8] and len(out.store_spec.block_ids) == 8
    assert m.lookup(keys[0], ctx) == LookupResult.HIT_PENDING
    m.complete_store(keys[:8], ctx)
    assert m.lookup(keys[0], ctx) == LookupResult.HIT
    assert str(m.get_load_source(keys[0], ctx).value) == "host"
    m.chain.wait_idle()
    out2 = m.prepare_store(keys[8:], ctx)  # CPU full: evicts two (already on disk)
    assert len(out2.evicted_keys) == 2
    m.complete_store(keys[8:], ctx)
    m.chain.wait_idle()
    gone = out2.evicted_keys[0]
    assert m.lookup(gone, ctx) == LookupResult.HIT_PENDING  # promotion from disk (unmeasured)
    m.on_schedule_end(None)
    m.chain.wait_idle()
    assert m.lookup(gone, ctx) == LookupResult.HIT
    assert str(m.get_load_source(gone, ctx).value) == "disk"
    events = list(m.take_events())
    assert any(e.removed for e in events) and any(not e.removed for e in events)
    stats = m.get_stats()
    assert not stats.is_empty()
    defs = TieredOffloadingSpec.build_metric_definitions({})
    for name in stats.data["data"]:
        assert name in defs  # vLLM asserts every reported name is declared
    m.reset_cache()
    assert m.lookup(keys[9], ctx) == LookupResult.HIT_PENDING  # CPU emptied, disk kept
    m.shutdown()


def _takes_kw() -> bool:
    import inspect

    return "req_id" in inspect.signature(ReqContext).parameters


def test_repeated_lookups_of_one_request_count_once(tmp_path):
    m = TieredOffloadingSpec(config(good(tmp_path), engine="dedupe")).get_manager()
    key = bytes(32) + b"\0\0\0\1"
    ctx, other = ReqContext(req_id="a"), ReqContext(req_id="b")
    for _ in range(3):  # vLLM asks again every step while the request waits
        assert m.lookup(key, ctx) == LookupResult.MISS
    assert m.chain.tiers[0].stats["lookups"] == 1 and m.chain.tiers[1].stats["lookups"] == 1
    m.lookup(key, other)
    assert m.chain.tiers[0].stats["lookups"] == 2
    m.on_request_finished(ctx)
    m.lookup(key, ctx)  # a new request with the same id after the old one finished
    assert m.chain.tiers[0].stats["lookups"] == 3
    m.shutdown()


def _tp2_config(extra: dict, rank: int, replicated: bool, engine: str):
    """Tensor parallelism 2; ``replicated`` as vLLM sets it for MLA models, whose KV is the
    same on every rank."""
    import dataclasses

    return dataclasses.replace(
        config(extra, engine=engine), replicated_layout=replicated,
        parallel=OffloadingParallelConfig(rank, 2, 2, 1, 1, 1, 0, 1, None, False))


@pytest.mark.parametrize("replicated, copies", [(False, 2), (True, 1)])
def test_replicated_layout_sizes_rows_for_one_copy(replicated, copies):
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "cpu_bytes_to_use": 8 * BLOCK}
    spec = TieredOffloadingSpec(_tp2_config(extra, 0, replicated, "sizing"))
    assert spec.replicated_layout is replicated  # vLLM's worker then stores from rank 0 only
    assert spec.row_bytes == copies * BLOCK
    assert spec.num_rows == 8 // copies


def test_replicated_layout_every_rank_reads_the_one_stored_copy():
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from tiering.vllm.compat import GPULoadStoreSpec
    from tiering.vllm.worker import RowsSpec

    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "cpu_bytes_to_use": 8 * BLOCK}
    workers, caches = [], []
    for rank in (0, 1):
        spec = TieredOffloadingSpec(_tp2_config(extra, rank, True, "replicated"))
        t = torch.randint(-128, 127, (16, BLOCK), dtype=torch.int8)
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, BLOCK)], [[CanonicalKVCacheRef(0, BLOCK)]])
        caches.append(t)
        workers.append(spec.get_worker(kv))
    # vLLM submits the store on rank 0 only; every rank loads
    assert workers[0].submit_store(1, GPULoadStoreSpec([3], [1], [0]), RowsSpec([2]))
    assert [r.success for r in workers[0].get_finished()] == [True]
    for rank, w in enumerate(workers):
        assert w.submit_load(2, RowsSpec([2]), GPULoadStoreSpec([5], [1], [0]))
        assert [r.success for r in w.get_finished()] == [True]
        assert torch.equal(caches[rank][5], caches[0][3]), rank
    for w in workers:
        w.shutdown()


def test_manager_feeds_the_promotion_advisor(tmp_path):
    """Each step's offered chunks, placed where vLLM says they end in the prompt, are what the
    step computes: timed from one step end to the next, they are the advisor's prefill samples.
    A request's scan goes when vLLM reports it finished, its store completions need none."""
    m = TieredOffloadingSpec(config(good(tmp_path), engine="advisor")).get_manager()
    advisor = m.chain.advisor
    assert advisor is not None and not advisor.prefill.known()
    # no engine config here: synchronous scheduling; vLLM 0.32 ends a step before offering its
    # chunks (lag -1), 0.33 after
    from tiering.vllm.compat import schedule_end_before_stores

    assert advisor.clock.lag == (-1 if schedule_end_before_stores() else 0)
    keys = [bytes(32) + i.to_bytes(4, "big") for i in range(40)]  # 40 x 16 tokens = 640
    ctx = ReqContext(req_id="fresh")
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    for k in keys:
        assert m.lookup(k, ctx) == LookupResult.MISS
    m.on_schedule_end(None)
    for i in range(0, 40, 8):  # the CPU tier holds 8 rows: 8 chunks (128 tokens) a step
        out = m.prepare_store(keys[i:i + 8], ctx)
        assert out is not None and len(out.keys_to_store) == 8
        m.on_schedule_end(None)
        m.complete_store(keys[i:i + 8], ctx)
        m.chain.wait_idle()  # written down: the next 8 may evict them
    m.on_schedule_end(None)
    m.on_request_finished(ctx)
    assert m.live_requests() == 0
    # five steps of 128 tokens each, the first placed at [0, 128) and the last at [512, 640)
    assert advisor.prefill.samples == 5 and advisor.prefill.seconds(0, 640) > 0
    late = ReqContext(req_id="late")  # finished before its stores completed
    more = [bytes([7] * 32) + i.to_bytes(4, "big") for i in range(40)]
    for i, k in enumerate(more):
        late.set_offload_key_position(k, 16 * (i + 1))
    assert m.lookup(more[0], late) == LookupResult.MISS
    assert m.prepare_store(more[32:], late) is not None
    m.on_request_finished(late)
    assert m.live_requests() == 0
    m.complete_store(more[32:], late)
    assert m.live_requests() == 0
    m.on_schedule_end(None)  # the late request's step: [512, 640) of its prompt
    m.on_schedule_end(None)
    assert advisor.prefill.samples == 6
    m.shutdown()
    off = TieredOffloadingSpec(config(good(tmp_path, tiers=[
        {"medium": "cpu", "promote": "always"},
        {"medium": "file", "path": str(tmp_path / "kv2"), "capacity": "4MiB", "io": "posix"}]),
        engine="always")).get_manager()
    assert off.chain.advisor is None  # promote: always loads every disk hit
    off.shutdown()
