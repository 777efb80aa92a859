# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contract: our CachePolicy classes (tiering.vllm TieringLRUPolicy, TieringARCPolicy,
S3FIFOPolicy) inside vLLM's own CPUOffloadingManager.

Origin: vLLM 0.33.0 source distribution, tests/v1/kv_offload/cpu/test_manager.py, licence
Apache-2.0 (the vLLM project's contributors). Run against our policies: every change to the
original is marked ADAPTED or NOT BROUGHT IN with the reason.
"""

import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

import tiering.vllm as ours


def make_req_context(
    req_id: str = "", kv_transfer_params: dict | None = None
) -> ReqContext:
    """Create a ReqContext as production code would, from a request's params."""
    return ReqContext(req_id=req_id, kv_transfer_params=kv_transfer_params)


_EMPTY_REQ_CTX = make_req_context()


# ADAPTED: every manager runs one of OUR policies, loaded by module path as a user configures
# it ("eviction_policy": ..., "cache_policy_module_path": "tiering.vllm"). vLLM's "lru" and
# "arc" map to ours of the same kind; DEFAULT_POLICY is what a test that names no policy gets.
OUR_POLICIES = {"lru": "TieringLRUPolicy", "arc": "TieringARCPolicy", "s3fifo": "S3FIFOPolicy"}
DEFAULT_POLICY = "lru"


@pytest.fixture(autouse=True, params=sorted(OUR_POLICIES))
def default_policy(request, monkeypatch):
    """ADAPTED: every test runs once per policy of ours as the default; tests that name
    "lru" or "arc" keep that kind."""
    monkeypatch.setattr(sys.modules[__name__], "DEFAULT_POLICY", request.param)
    return request.param


def make_cpu_manager(
    num_chunks: int = 4,
    cache_policy: str | None = None,
    cache_policy_module_path: str | None = None,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> CPUOffloadingManager:
    return CPUOffloadingManager(
        num_chunks=num_chunks,
        cache_policy=OUR_POLICIES[cache_policy or DEFAULT_POLICY],
        cache_policy_module_path="tiering.vllm",
        enable_events=enable_events,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
    )


@dataclass
class ExpectedPrepareStoreOutput:
    keys_to_store: list[int]
    store_chunk_ids: list[int]
    evicted_keys: list[int]


class _CountingOrderedDict(OrderedDict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.items_yielded = 0

    def items(self):
        for item in super().items():
            self.items_yielded += 1
            yield item


def to_key(int_hash: int) -> OffloadKey:
    return make_offload_key(str(int_hash).encode(), 0)


def to_keys(int_hashes: list[int]) -> list[OffloadKey]:
    return [to_key(i) for i in int_hashes]


def verify_store_output(
    prepare_store_output: PrepareStoreOutput | None,
    expected_prepare_store_output: ExpectedPrepareStoreOutput,
):
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == to_keys(
        expected_prepare_store_output.keys_to_store
    )
    assert prepare_store_output.evicted_keys == to_keys(
        expected_prepare_store_output.evicted_keys
    )
    store_spec = prepare_store_output.store_spec
    assert isinstance(store_spec, CPULoadStoreSpec)
    expected_array = np.array(
        expected_prepare_store_output.store_chunk_ids, dtype=np.int64
    )
    assert np.array_equal(expected_array, store_spec.chunk_ids)


def verify_load_output(
    prepare_load_output: LoadStoreSpec, expected_prepare_load_output: list[int]
):
    assert isinstance(prepare_load_output, CPULoadStoreSpec)
    expected_array = np.array(expected_prepare_load_output, dtype=np.int64)
    assert np.array_equal(expected_array, prepare_load_output.chunk_ids)


def check_split_usage_stats(
    manager: CPUOffloadingManager, write: float, read: float, total: float
):
    stats = manager.get_stats()
    assert stats is not None
    reduced = stats.reduce()
    assert reduced[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC] == pytest.approx(
        write
    )
    assert reduced[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC] == pytest.approx(
        read
    )
    assert reduced[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC] == pytest.approx(total)


def verify_events(
    events: Iterable[OffloadingEvent],
    expected_stores: tuple[set[int], ...] = (),
    expected_evictions: tuple[set[int], ...] = (),
):
    stores: list[set[OffloadKey]] = []
    evictions: list[set[OffloadKey]] = []
    for event in events:
        assert event.medium == Medium.CPU
        if event.removed:
            evictions.append(set(event.keys))
        else:
            stores.append(set(event.keys))

    def to_key_sets(
        int_sets: tuple[set[int], ...],
    ) -> tuple[set[OffloadKey], ...]:
        return tuple([set(to_keys(list(int_set))) for int_set in int_sets])

    assert tuple(evictions) == to_key_sets(expected_evictions)
    assert tuple(stores) == to_key_sets(expected_stores)


def test_cpu_eviction_removed_precedes_stored():
    """An eviction is announced before the store that reuses its capacity."""
    manager = make_cpu_manager(num_chunks=2, enable_events=True)

    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    list(manager.take_events())

    manager.prepare_store(to_keys([3]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([3]), _EMPTY_REQ_CTX)

    events = list(manager.take_events())
    removed_idx = [i for i, event in enumerate(events) if event.removed]
    stored_idx = [i for i, event in enumerate(events) if not event.removed]
    assert removed_idx and stored_idx, events
    assert max(removed_idx) < min(stored_idx)
    assert all(event.medium == manager.medium for event in events)


@pytest.mark.parametrize("eviction_policy", ["lru", "arc"])
def test_already_stored_chunk_not_evicted_during_prepare_store(eviction_policy):
    """Regression test: a chunk that is already stored must not be evicted
    by prepare_store() when it needs to make room for new chunks.
    Applies to both lru and arc policies.

    Scenario:
        - Store chunks [1, 2] and complete.
        - touch([1]) makes chunk 2 the LRU candidate.
        - prepare_store([2, 3, 4, 5]):
            * chunk 2 is filtered out as "already stored"
            * but without the fix, chunk 2 would be evicted as the LRU
              candidate to make room for [3, 4, 5]
        - After complete_store([2, 3, 4, 5]), chunk 2 must still be present.
    """
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy=eviction_policy,
        enable_events=True,
    )

    # store [1, 2] and complete
    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

    # touch [1] to make chunk 2 the LRU candidate
    manager.touch(to_keys([1]), _EMPTY_REQ_CTX)

    # prepare_store([2, 3, 4, 5]):
    #   - chunk 2 is already stored -> filtered out of keys_to_store
    #   - chunk 2 must NOT be evicted even though it is the LRU candidate
    #   - chunk 1 (ID 0) is evicted instead; new chunks [3,4,5] get IDs 2,3,0
    prepare_store_output = manager.prepare_store(to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[3, 4, 5],
            store_chunk_ids=[2, 3, 0],
            evicted_keys=[1],  # chunk 1 evicted, not chunk 2
        ),
    )

    # complete_store must not silently drop chunk 2
    manager.complete_store(to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX)

    # chunk 2 must still be present in the cache
    assert manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT


def test_filter_reused_manager_reports_stores_skipped_counter():
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        store_threshold=2,
    )

    prepare_store_output = manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)

    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[],
            store_chunk_ids=[],
            evicted_keys=[],
        ),
    )
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 3
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 0


def test_cpu_manager_reports_no_config_info_without_info():
    """A caller that passes no info keeps the empty default.

    The scheduler still sends an info payload, so the metric appears with the
    engine labels alone. Tests in tests/v1/kv_offload/test_factory.py cover the
    published labels, because a real spec supplies the info.
    """
    manager = make_cpu_manager(num_chunks=4)

    assert manager.config_info() == [{}]


def test_cpu_manager_reports_cache_usage_gauge():
    def check_usage_stats(manager: CPUOffloadingManager, value: float):
        stats = manager.get_stats()
        assert stats is not None
        assert stats.reduce()[
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
        ] == pytest.approx(value)

    # Zero-capacity manager always reports 0.0
    manager = make_cpu_manager(num_chunks=0)
    check_usage_stats(manager, 0.0)

    # Empty manager (4 chunks, none allocated): usage = 0.0
    manager = make_cpu_manager(num_chunks=4)
    check_usage_stats(manager, 0.0)

    # After allocating 2 of 4 chunks: usage = 0.5
    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 0.5)

    # After filling all 4 chunks: usage = 1.0
    manager.prepare_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 1.0)

    # After completing store, the chunks become evictable as not actively used
    # and usage drops.
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 0.5)

    # After completing store, the chunks become evictable as not actively used
    # and usage drops.
    manager.complete_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 0.0)


def test_cpu_manager_reports_allocation_size_histogram():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)

    stats = manager.get_stats()

    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 2
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 3

    # The cache-usage gauge is always reported, so get_stats() never returns
    # None, but the histogram has nothing new once its samples are consumed.
    second_stats = manager.get_stats()
    assert second_stats is not None
    assert f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count" not in (
        second_stats.reduce()
    )


def test_cpu_manager_reports_allocation_size_on_allocation_failure(monkeypatch):
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    def fail_allocate_chunks(keys):
        raise RuntimeError("allocation failed")

    monkeypatch.setattr(manager, "_allocate_chunks", fail_allocate_chunks)

    with pytest.raises(RuntimeError, match="allocation failed"):
        manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)

    stats = manager.get_stats()

    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 1
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 3


def test_cpu_manager_reports_allocation_size_on_eviction_failure():
    manager = make_cpu_manager(num_chunks=1, cache_policy="lru")

    manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX)
    manager.get_stats()

    assert manager.prepare_store(to_keys([2]), _EMPTY_REQ_CTX) is None

    stats = manager.get_stats()

    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 1
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 1


def test_cpu_manager_reports_cache_write_and_read_usage_gauges():
    manager = make_cpu_manager(num_chunks=4)

    # Store path: pins write usage until complete_store.
    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.5, read=0.0, total=0.5)

    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.0, read=0.0, total=0.0)

    # Load path: pins read usage until complete_load.
    assert manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT
    manager.prepare_load(to_keys([1]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.0, read=0.25, total=0.25)

    manager.complete_load(to_keys([1]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.0, read=0.0, total=0.0)

    # Concurrent write + read pins are both reflected and additive.
    manager.prepare_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    manager.prepare_load(to_keys([2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.5, read=0.25, total=0.75)


def test_cpu_manager_clears_write_usage_after_failed_store():
    manager = make_cpu_manager(num_chunks=4)

    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.5, read=0.0, total=0.5)

    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX, success=False)
    check_split_usage_stats(manager, write=0.0, read=0.0, total=0.0)


def test_cpu_manager():
    """Tests CPUOffloadingManager with lru policy."""
    # initialize a CPU manager with a capacity of 4 chunks
    cpu_manager = make_cpu_manager(num_chunks=4, cache_policy="lru", enable_events=True)

    # prepare store [1, 2]
    prepare_store_output = cpu_manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[1, 2],
            store_chunk_ids=[0, 1],
            evicted_keys=[],
        ),
    )

    # lookup [1, 2] -> write in-flight, not yet ready
    assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT_PENDING
    assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT_PENDING

    # no events so far
    assert list(cpu_manager.take_events()) == []

    # complete store [1, 2]
    cpu_manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    verify_events(cpu_manager.take_events(), expected_stores=({1, 2},))

    # lookup [1, 2]
    assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(3), _EMPTY_REQ_CTX) is LookupResult.MISS

    # prepare store [2, 3, 4, 5] -> evicts [1]
    prepare_store_output = cpu_manager.prepare_store(
        to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX
    )
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[3, 4, 5],
            store_chunk_ids=[2, 3, 0],
            evicted_keys=[1],
        ),
    )

    # verify eviction event
    verify_events(cpu_manager.take_events(), expected_evictions=({1},))

    # prepare store with no space
    assert cpu_manager.prepare_store(to_keys([1, 6]), _EMPTY_REQ_CTX) is None

    # complete store [2, 3, 4, 5]
    cpu_manager.complete_store(to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX)

    # lookup (now that we have [2, 3, 4, 5])
    assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.MISS
    assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(3), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(4), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(5), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(0), _EMPTY_REQ_CTX) is LookupResult.MISS

    # prepare load [2, 3]
    load_ctx = make_req_context("load-2-3")
    prepare_load_output = cpu_manager.prepare_load(to_keys([2, 3]), load_ctx)
    verify_load_output(prepare_load_output, [1, 2])

    # prepare store with no space ([2, 3] is being loaded)
    assert cpu_manager.prepare_store(to_keys([6, 7, 8]), _EMPTY_REQ_CTX) is None

    # complete load [2, 3]. Load changes the eviction list, making 2, 3 recent.
    cpu_manager.complete_load(to_keys([2, 3]), load_ctx)
    cpu_manager.on_request_finished(load_ctx)

    # prepare store [6, 7, 8] -> evicts [4, 5, 3] (oldest). Within
    # the accessed prefix [2, 3], the tail is less valuable than the head.
    prepare_store_output = cpu_manager.prepare_store(to_keys([6, 7, 8]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[6, 7, 8],
            store_chunk_ids=[2, 0, 3],
            evicted_keys=[4, 5, 3],
        ),
    )

    # complete store [6, 7, 8]
    cpu_manager.complete_store(to_keys([6, 7, 8]), _EMPTY_REQ_CTX)

    # touch [2, 6, 7] (move to end of LRU order)
    cpu_manager.touch(to_keys([2, 6, 7]), _EMPTY_REQ_CTX)

    # prepare store [7, 9] -> evicts [8] (oldest following previous touch)
    prepare_store_output = cpu_manager.prepare_store(to_keys([9]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[9],
            store_chunk_ids=[3],
            evicted_keys=[8],
        ),
    )

    # complete store [7, 9] with failure
    cpu_manager.complete_store(to_keys([7, 9]), _EMPTY_REQ_CTX, success=False)

    # assert [7] is still stored, but [9] is not
    assert cpu_manager.lookup(to_key(7), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(9), _EMPTY_REQ_CTX) is LookupResult.MISS

    verify_events(
        cpu_manager.take_events(),
        expected_stores=({3, 4, 5}, {6, 7, 8}),
        expected_evictions=({4, 5, 3}, {8}, {9}),
    )


def test_prepare_load_preserves_key_order():
    """chunk_ids[i] must correspond to keys[i] (co-indexed invariant)."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    key_a, key_b, key_c = to_key(0), to_key(1), to_key(2)

    # Store all three keys and learn their chunk ID assignments
    store_output = manager.prepare_store([key_a, key_b, key_c], _EMPTY_REQ_CTX)
    assert store_output is not None
    assert isinstance(store_output.store_spec, CPULoadStoreSpec)
    key_to_chunk_id = {
        k: int(cid)
        for k, cid in zip(
            store_output.keys_to_store, store_output.store_spec.chunk_ids, strict=True
        )
    }
    manager.complete_store([key_a, key_b, key_c], _EMPTY_REQ_CTX)

    # Forward order: [a, b, c]
    spec_fwd = manager.prepare_load([key_a, key_b, key_c], _EMPTY_REQ_CTX)
    assert isinstance(spec_fwd, CPULoadStoreSpec)
    assert [int(x) for x in spec_fwd.chunk_ids] == [
        key_to_chunk_id[key_a],
        key_to_chunk_id[key_b],
        key_to_chunk_id[key_c],
    ]
    manager.complete_load([key_a, key_b, key_c], _EMPTY_REQ_CTX)  # order irrelevant

    # Arbitrary permutation: [b, c, a]
    spec_perm = manager.prepare_load([key_b, key_c, key_a], _EMPTY_REQ_CTX)
    assert isinstance(spec_perm, CPULoadStoreSpec)
    assert [int(x) for x in spec_perm.chunk_ids] == [
        key_to_chunk_id[key_b],
        key_to_chunk_id[key_c],
        key_to_chunk_id[key_a],
    ]
    manager.complete_load([key_a, key_b, key_c], _EMPTY_REQ_CTX)  # order irrelevant


def test_lru_batch_eviction_failure_is_atomic():
    # ADAPTED: the isinstance check on vLLM's LRUCachePolicy dropped; evict() is called
    # through the CachePolicy interface on ours.
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    policy = manager._policy
    keys = to_keys([1, 2, 3, 4])
    assert manager.prepare_store(keys, _EMPTY_REQ_CTX) is not None
    manager.complete_store(keys, _EMPTY_REQ_CTX)

    protected = set(keys[1:])
    assert policy.evict(2, protected) is None
    assert all(manager.lookup(key, _EMPTY_REQ_CTX) is LookupResult.HIT for key in keys)

    evicted = policy.evict(1, protected)
    assert evicted is not None
    assert [key for key, _ in evicted] == [keys[0]]


def test_lru_repeated_pin_cycles_compact_lazy_heap_entries():
    # ADAPTED: the bound on vLLM's lazy heap (policy._heap) is internal to its LRU and
    # dropped; pin cycles must still leave exactly one evictable entry for the key.
    manager = make_cpu_manager(num_chunks=1, cache_policy="lru")
    policy = manager._policy
    key = to_key(1)
    assert manager.prepare_store([key], _EMPTY_REQ_CTX) is not None
    manager.complete_store([key], _EMPTY_REQ_CTX)

    for _ in range(128):
        manager.prepare_load([key], _EMPTY_REQ_CTX)
        manager.complete_load([key], _EMPTY_REQ_CTX)

    evicted = policy.evict(1, set())
    assert evicted is not None
    assert [evicted_key for evicted_key, _ in evicted] == [key]


def _arc_lists(manager: CPUOffloadingManager) -> tuple[int, int]:
    """ADAPTED helper: (|T1|, |T2|) of our ARC, where vLLM's tests read its lists."""
    stats = manager._policy.policy.stats()
    return stats["t1"], stats["t2"]


def test_reset_discards_stale_request_access_classification():
    # ADAPTED: T1/T2 membership read as list sizes of our ARC (_arc_lists)
    manager = make_cpu_manager(num_chunks=1, cache_policy="arc")
    key = to_key(1)
    resumed_ctx = make_req_context("resumed")

    assert manager.prepare_store([key], resumed_ctx) is not None
    manager.complete_store([key], resumed_ctx)
    manager.reset_cache()

    replacement_ctx = make_req_context("replacement")
    assert manager.prepare_store([key], replacement_ctx) is not None
    manager.complete_store([key], replacement_ctx)
    manager.on_request_finished(replacement_ctx)
    assert _arc_lists(manager) == (1, 0)

    manager.prepare_load([key], resumed_ctx)
    manager.complete_load([key], resumed_ctx)
    manager.on_request_finished(resumed_ctx)

    assert _arc_lists(manager) == (0, 1)


# NOT BROUGHT IN: class TestARCPolicy (17 tests). Every one asserts vLLM's ARCCachePolicy
# internals (its T1/T2/B1/B2 OrderedDicts, target_t1_size, how many entries an eviction scan
# visits) by reading or rewriting them; our ARC keeps different structures. Its behaviour
# (ghost adaptation, scan resistance, fallback to the other list, bounded ghosts) is tested in
# tests/test_policies.py, and the manager-level ARC tests below run against ours.


def test_take_events_prunes_retried_cleanup_and_drains_once():
    """Failed-write cleanup must not outlive a retry that re-owns the key, and a
    partially consumed drain must not replay it."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru", enable_events=True)

    assert manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX) is not None
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX, success=False)
    # A retry re-allocates key 1 before the cleanup is drained.
    assert manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX) is not None
    assert manager.prepare_store(to_keys([3]), _EMPTY_REQ_CTX) is not None
    manager.complete_store(to_keys([3]), _EMPTY_REQ_CTX)

    drain = iter(manager.take_events())
    cleanup = next(drain)
    assert cleanup.removed and cleanup.metadata_only
    assert cleanup.keys == to_keys([2])
    # Stopping early must not leave the batch queued for the next drain.
    assert list(manager.take_events()) == []
    assert [event.keys for event in drain] == [to_keys([3])]


def test_filter_reused_manager():
    """Tests CPUOffloadingManager reuse filtering (store_threshold=2)."""
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        enable_events=True,
        store_threshold=2,
        max_tracker_size=3,
    )

    # lookup() does not count towards store admission
    assert manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.MISS
    assert manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.MISS
    # store_threshold > 1 means the reuse tracker is enabled, so counts exists.
    assert manager.counts is not None
    assert not manager.counts

    # 1st offer of [1, 2] -> tracked at count 1, not eligible yet
    prepare_store_output = manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == []
    assert manager.counts[to_keys([1])[0]] == 1
    assert manager.counts[to_keys([2])[0]] == 1

    # 2nd offer -> the whole repeated prefix becomes eligible at once
    prepare_store_output = manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == to_keys([1, 2])
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

    # Offer [3, 4] -> 1st time, evicting the tracker's LRU entry [1]
    prepare_store_output = manager.prepare_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == []
    assert to_keys([1])[0] not in manager.counts
    assert manager.counts[to_keys([3])[0]] == 1
    assert manager.counts[to_keys([4])[0]] == 1

    # [1] re-enters the tracker at count 1, so it is filtered again
    prepare_store_output = manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == []
    assert manager.counts.get(to_keys([1])[0]) == 1


def test_filter_reused_manager_oversized_offer_makes_progress():
    """An offer larger than the tracker capacity must not churn forever."""
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        store_threshold=2,
        max_tracker_size=3,
    )
    keys = to_keys([1, 2, 3, 4])
    stored_keys: set[OffloadKey] = set()

    for _ in range(4):
        remaining_keys = [key for key in keys if key not in stored_keys]
        output = manager.prepare_store(remaining_keys, _EMPTY_REQ_CTX)
        assert output is not None
        if output.keys_to_store:
            manager.complete_store(output.keys_to_store, _EMPTY_REQ_CTX)
            stored_keys.update(output.keys_to_store)

    assert stored_keys == set(keys)


def test_store_threshold_does_not_hide_ready_reuse():
    manager = make_cpu_manager(
        num_chunks=2,
        cache_policy="lru",
        store_threshold=2,
        max_tracker_size=2,
    )
    head, tail, noise_1, noise_2, replacement = to_keys(list(range(5)))

    seed_ctx = make_req_context("seed")
    output = manager.prepare_store([head, tail], seed_ctx)
    assert output is not None
    assert not output.keys_to_store
    output = manager.prepare_store([head, tail], seed_ctx)
    assert output is not None
    assert output.keys_to_store == [head, tail]
    manager.complete_store([head, tail], seed_ctx)
    manager.on_request_finished(seed_ctx)

    # Age both resident keys out of the admission tracker without storing the
    # noise keys. Reusing the tail recreates its counter at one, below the
    # threshold, but must still refresh its cache recency.
    output = manager.prepare_store([noise_1, noise_2], make_req_context("noise"))
    assert output is not None
    assert not output.keys_to_store
    reuse_ctx = make_req_context("reuse")
    skipped_before_reuse = manager.stores_skipped_in_current_batch
    output = manager.prepare_store([tail], reuse_ctx)
    assert output is not None
    assert not output.keys_to_store
    assert manager.stores_skipped_in_current_batch == skipped_before_reuse
    manager.on_request_finished(reuse_ctx)

    replacement_ctx = make_req_context("replacement")
    output = manager.prepare_store([replacement], replacement_ctx)
    assert output is not None
    assert not output.keys_to_store
    output = manager.prepare_store([replacement], replacement_ctx)
    assert output is not None
    assert output.evicted_keys == [head]


def test_evictable_cache_chunk_count(monkeypatch):
    """Verifies _num_evictable_cache_chunks is maintained correctly through the
    full store/load lifecycle, eviction, failed stores, concurrent loads,
    reset_cache, and the early-exit fast path in prepare_store.
    """
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    # Initially no chunks allocated.
    assert manager._num_evictable_cache_chunks == 0

    # Initial cache state [x, x, x, x]

    # We get 3 chunks from the cache.
    manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)
    # cache state [1', 2', 3', x] <- 1', 2', 3' are actively being used.
    assert manager._num_evictable_cache_chunks == 0

    # Completing stores makes them idle.
    manager.complete_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)
    # cache state [1, 2, 3, x] <- 1, 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 3

    # prepare_load pins a chunk: idle count decrements once even if the
    # same chunk is loaded by two concurrent callers.
    manager.prepare_load(to_keys([1]), _EMPTY_REQ_CTX)
    # cache state [1', 2, 3, x] <- 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 2
    manager.prepare_load(to_keys([1]), _EMPTY_REQ_CTX)  # 2nd concurrent load
    # cache state [1', 2, 3, x] <- 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 2  # no double-decrement

    # First complete_load does not restore idle (ref_cnt still 1).
    manager.complete_load(to_keys([1]), _EMPTY_REQ_CTX)
    # cache state [1', 2, 3, x] <- 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 2
    # Second complete_load drops ref_cnt to 0 -> chunk becomes idle again.
    manager.complete_load(to_keys([1]), _EMPTY_REQ_CTX)
    # cache state [1, 2, 3, x] <- 1, 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 3

    # Eviction decrements idle count.
    # Cache has 3 stored chunks and 1 free slot. Storing 3 new keys needs 2 eviction.
    manager.prepare_store(to_keys([4, 5, 6]), _EMPTY_REQ_CTX)
    # cache state [1, 4', 5', 6'] <- chunk 1 is idle
    assert manager._num_evictable_cache_chunks == 1

    # Failed store does not increment idle count (chunk discarded from cache).
    manager.complete_store(to_keys([4, 5, 6]), _EMPTY_REQ_CTX, success=False)
    # cache state [1, x, x, x] <- chunk 1 is idle. Other returned to cache.
    assert manager._num_evictable_cache_chunks == 1

    # reset_cache zeroes the count unconditionally.
    manager.reset_cache()
    # cache state [x, x, x, x]
    assert manager._num_evictable_cache_chunks == 0

    # setup 3 chunks with loads so idle count drops to 0.
    manager.prepare_store(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    manager.prepare_load(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    # cache state [10', 11', 12', x]
    assert manager._num_evictable_cache_chunks == 0

    # prepare_store requiring eviction must return None immediately (fast exit).
    # Spy on policy.evict to confirm the fast path short-circuits before calling it.
    evict_called = False
    original_evict = manager._policy.evict

    def spy_evict(*args, **kwargs):
        nonlocal evict_called
        evict_called = True
        return original_evict(*args, **kwargs)

    monkeypatch.setattr(manager._policy, "evict", spy_evict)
    # cache state [10', 11', 12', x] <- cannot evict anything
    assert manager.prepare_store(to_keys([14, 15]), _EMPTY_REQ_CTX) is None
    assert not evict_called, (
        "_num_evictable_cache_chunks==0 should short-circuit before evict()"
    )

    # After releasing the loads, eviction becomes possible again.
    manager.complete_load(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    # cache state [10, 11, 12, x] <- 10, 11, 12 are idle
    assert manager._num_evictable_cache_chunks == 3
    assert manager.prepare_store(to_keys([14, 15]), _EMPTY_REQ_CTX) is not None
    # cache state [10, 11, 14', 15'] <- 10, 11 are idle
    assert manager._num_evictable_cache_chunks == 2
    manager.complete_store(to_keys([14, 15]), _EMPTY_REQ_CTX)
    # cache state [10, 11, 14, 15] <- all chunks idle
    assert manager._num_evictable_cache_chunks == 4


def test_touch_forwards_req_context_to_policy(monkeypatch):
    """Regression: CPUOffloadingManager.touch forwards ReqContext to policy."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    received = []

    def spy_touch(keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        received.append((list(keys), req_context))

    monkeypatch.setattr(manager._policy, "touch", spy_touch)

    keys = to_keys([1, 2])
    ctx = make_req_context(
        req_id="test-req",
        kv_transfer_params={"test_param": "test_value"},
    )

    manager.touch(keys, ctx)

    assert len(received) == 1
    assert received[0][0] == keys
    assert received[0][1] is ctx


@pytest.mark.parametrize("finish_before_completion", [False, True])
def test_request_finish_orders_lru_prefix_independent_of_store_completion(
    finish_before_completion: bool,
):
    """A transfer's completion order must not make the prefix head LRU."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    prefix = to_keys([1, 2, 3, 4])
    ctx = make_req_context("prefix")

    output = manager.prepare_store(prefix, ctx)
    assert output is not None
    if finish_before_completion:
        manager.on_request_finished(ctx)
    manager.complete_store(set(prefix), ctx)
    if not finish_before_completion:
        manager.on_request_finished(ctx)

    output = manager.prepare_store(to_keys([5]), make_req_context("evict"))
    assert output is not None
    assert output.evicted_keys == to_keys([4])


@pytest.mark.parametrize("finish_before_completion", [False, True])
def test_request_finish_orders_lru_prefix_independent_of_load_completion(
    finish_before_completion: bool,
):
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    prefix = to_keys([1, 2, 3, 4])

    seed_ctx = make_req_context("seed")
    output = manager.prepare_store(prefix, seed_ctx)
    assert output is not None
    manager.complete_store(prefix, seed_ctx)

    reuse_ctx = make_req_context("reuse")
    manager.prepare_load(prefix, reuse_ctx)
    if finish_before_completion:
        manager.on_request_finished(reuse_ctx)
    manager.complete_load(set(prefix), reuse_ctx)
    if not finish_before_completion:
        manager.on_request_finished(reuse_ctx)

    output = manager.prepare_store(to_keys([5]), make_req_context("evict"))
    assert output is not None
    assert output.evicted_keys == to_keys([4])


def test_late_old_completion_does_not_override_newer_request_recency():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    old_keys = to_keys([1, 2])
    new_keys = to_keys([3, 4])

    old_ctx = make_req_context("old")
    assert manager.prepare_store(old_keys, old_ctx) is not None
    manager.on_request_finished(old_ctx)

    new_ctx = make_req_context("new")
    assert manager.prepare_store(new_keys, new_ctx) is not None
    manager.complete_store(new_keys, new_ctx)
    manager.on_request_finished(new_ctx)

    # Physical completion is late, but the logical access is still older.
    manager.complete_store(old_keys, old_ctx)

    output = manager.prepare_store(to_keys([5]), make_req_context("evict"))
    assert output is not None
    assert output.evicted_keys == [old_keys[-1]]


def test_arc_counts_reuse_once_and_keeps_insertions_in_t1():
    # ADAPTED: list membership read as our ARC's list sizes; the order within a list is
    # checked by eviction order in tests/test_vllm_adapters.py instead of by iterating it.
    manager = make_cpu_manager(num_chunks=4, cache_policy="arc")
    prefix = to_keys([1, 2, 3, 4])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store(prefix, seed_ctx) is not None
    manager.complete_store(prefix, seed_ctx)
    # Repeated store offers from the same request must not become ARC hits.
    assert manager.prepare_store(prefix, seed_ctx) is not None
    # Nor should an internal read used to cascade the new chunks to a tier.
    manager.prepare_load(prefix, seed_ctx)
    manager.complete_load(prefix, seed_ctx)
    manager.on_request_finished(seed_ctx)

    assert _arc_lists(manager) == (4, 0)

    reuse_ctx = make_req_context("reuse")
    manager.prepare_load(prefix, reuse_ctx)
    manager.complete_load(prefix, reuse_ctx)
    # A duplicate internal pin, as used by tiering cascades, is deduplicated.
    manager.prepare_load(prefix, reuse_ctx)
    manager.complete_load(prefix, reuse_ctx)
    manager.on_request_finished(reuse_ctx)

    assert _arc_lists(manager) == (0, 4)


def test_arc_reuse_wins_if_same_request_later_reinserts_key():
    # ADAPTED: T1/T2 membership read as our ARC's list sizes
    manager = make_cpu_manager(num_chunks=1, cache_policy="arc")
    key_1, key_2 = to_keys([1, 2])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store([key_1], seed_ctx) is not None
    manager.complete_store([key_1], seed_ctx)
    manager.on_request_finished(seed_ctx)

    reuse_ctx = make_req_context("reuse-and-reinsert")
    manager.prepare_load([key_1], reuse_ctx)
    manager.complete_load([key_1], reuse_ctx)

    other_ctx = make_req_context("evict-reused-key")
    assert manager.prepare_store([key_2], other_ctx) is not None
    manager.complete_store([key_2], other_ctx)
    manager.on_request_finished(other_ctx)

    assert manager.prepare_store([key_1], reuse_ctx) is not None
    manager.complete_store([key_1], reuse_ctx)
    manager.on_request_finished(reuse_ctx)

    assert _arc_lists(manager) == (0, 1)
    assert manager.lookup(key_1, reuse_ctx) is LookupResult.HIT


def test_request_finish_forwards_grouped_deduplicated_accesses(monkeypatch):
    manager = make_cpu_manager(num_chunks=5)
    existing = make_offload_key(b"existing", 0)
    group_0_new = make_offload_key(b"group-0-new", 0)
    group_1_head = make_offload_key(b"group-1-head", 1)
    group_1_tail = make_offload_key(b"group-1-tail", 1)

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store([existing], seed_ctx) is not None
    manager.complete_store([existing], seed_ctx)

    ctx = make_req_context("grouped")
    # Group 1 is observed first, but policy finalization follows group index.
    offered = [group_1_head, existing, group_0_new]
    assert manager.prepare_store(offered, ctx) is not None
    # Later offers extend a group's prefix and may repeat earlier keys.
    assert (
        manager.prepare_store([group_0_new, group_1_head, group_1_tail], ctx)
        is not None
    )

    received = []

    def on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context):
        received.append((key_groups, insertion_only_keys, reused_keys, req_context))

    monkeypatch.setattr(manager._policy, "on_request_finished", on_request_finished)
    manager.on_request_finished(ctx)
    manager.on_request_finished(ctx)

    assert received == [
        (
            ((existing, group_0_new), (group_1_head, group_1_tail)),
            {group_0_new, group_1_head, group_1_tail},
            {existing},
            ctx,
        )
    ]


def test_failed_store_records_access_once_and_uses_store_miss_hook(monkeypatch):
    manager = make_cpu_manager(num_chunks=1)
    resident, candidate = to_keys([1, 2])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store([resident], seed_ctx) is not None
    manager.complete_store([resident], seed_ctx)

    pin_ctx = make_req_context("pin")
    manager.prepare_load([resident], pin_ctx)

    record_calls = 0
    original_record = manager._record_request_cache_access

    def record_access(*args, **kwargs):
        nonlocal record_calls
        record_calls += 1
        return original_record(*args, **kwargs)

    store_miss_calls = []

    def on_store_miss(keys, req_context):
        store_miss_calls.append((list(keys), req_context))

    finalized = []

    def on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context):
        finalized.append((key_groups, insertion_only_keys, reused_keys, req_context))

    monkeypatch.setattr(manager, "_record_request_cache_access", record_access)
    monkeypatch.setattr(manager._policy, "on_store_miss", on_store_miss)
    monkeypatch.setattr(manager._policy, "on_request_finished", on_request_finished)

    ctx = make_req_context("failed-store")
    assert manager.prepare_store([candidate, resident], ctx) is None
    assert record_calls == 1
    assert store_miss_calls == [([candidate], ctx)]

    manager.on_request_finished(ctx)
    assert finalized == [
        (((candidate, resident),), set(), {resident}, ctx),
    ]

    manager.complete_load([resident], pin_ctx)


def test_arc_ghost_hit_adapts_once_per_request_before_insertion():
    # ADAPTED: vLLM bounds each ghost list by the capacity; our ARC keeps the paper's bound
    # |T1| + |B1| <= capacity, so with vLLM's 2 chunks, all in T1, no ghost would survive.
    # Same steps with 4 chunks, two of them reused (T2), so B1 has room. B1 membership and the
    # target size are read from our ARC (b1, p). One deliberate difference at the end: vLLM
    # puts a returning ghost in T1, our ARC (as the paper) in T2.
    manager = make_cpu_manager(num_chunks=4, cache_policy="arc")
    policy = manager._policy.policy
    keys = to_keys([1, 2, 3, 4, 5])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store(keys[:4], seed_ctx) is not None
    manager.complete_store(keys[:4], seed_ctx)
    manager.on_request_finished(seed_ctx)
    reuse_ctx = make_req_context("reuse")
    manager.prepare_load(keys[:2], reuse_ctx)
    manager.complete_load(keys[:2], reuse_ctx)
    manager.on_request_finished(reuse_ctx)

    evict_ctx = make_req_context("create-ghost")
    output = manager.prepare_store([keys[4]], evict_ctx)
    assert output is not None
    [ghost_key] = output.evicted_keys
    manager.complete_store([keys[4]], evict_ctx)
    manager.on_request_finished(evict_ctx)
    assert ghost_key in policy.b1

    resident_keys = [key for key in keys if key != ghost_key]
    pin_ctx = make_req_context("pin-residents")
    manager.prepare_load(resident_keys, pin_ctx)

    ghost_ctx = make_req_context("ghost-hit")
    target_before = policy.p
    assert manager.prepare_store([ghost_key], ghost_ctx) is None
    target_after_first_offer = policy.p
    assert target_after_first_offer > target_before
    assert manager.prepare_store([ghost_key], ghost_ctx) is None
    assert policy.p == target_after_first_offer

    manager.complete_load(resident_keys, pin_ctx)
    output = manager.prepare_store([ghost_key], ghost_ctx)
    assert output is not None
    assert policy.p == target_after_first_offer
    manager.complete_store([ghost_key], ghost_ctx)
    manager.on_request_finished(ghost_ctx)
    assert ghost_key in policy.t2 and ghost_key not in policy.t1  # ours: see above


def test_arc_pending_chunk_is_not_a_frequency_hit():
    # ADAPTED: T1/T2 membership read as our ARC's list sizes
    manager = make_cpu_manager(num_chunks=2, cache_policy="arc")
    policy = manager._policy
    key = to_key(1)

    writer_ctx = make_req_context("writer")
    assert manager.prepare_store([key], writer_ctx) is not None

    observer_ctx = make_req_context("pending-observer")
    output = manager.prepare_store([key], observer_ctx)
    assert output is not None and not output.keys_to_store
    manager.on_request_finished(observer_ctx)

    chunk = policy.get(key)
    assert chunk is not None and not chunk.is_ready
    assert _arc_lists(manager) == (1, 0)


def test_request_key_positions_override_store_observation_order():
    manager = make_cpu_manager(num_chunks=2, cache_policy="lru")
    head, tail = to_keys([1, 2])
    ctx = make_req_context("out-of-order-store")
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)

    # A backfill or partial-tail path may offer a later key first.
    assert manager.prepare_store([tail], ctx) is not None
    assert manager.prepare_store([head], ctx) is not None
    manager.on_request_finished(ctx)
    manager.complete_store({head, tail}, ctx)

    output = manager.prepare_store([to_key(3)], make_req_context("evict-tail"))
    assert output is not None
    assert output.evicted_keys == [tail]


def test_request_key_positions_order_tails_across_kv_groups():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    group_0_head = make_offload_key(b"group-0-head", 0)
    group_0_tail = make_offload_key(b"group-0-tail", 0)
    group_1_head = make_offload_key(b"group-1-head", 1)
    group_1_tail = make_offload_key(b"group-1-tail", 1)
    keys = [group_0_head, group_0_tail, group_1_head, group_1_tail]
    ctx = make_req_context("hybrid-groups")
    for key in (group_0_head, group_1_head):
        ctx.set_offload_key_position(key, 16)
    for key in (group_0_tail, group_1_tail):
        ctx.set_offload_key_position(key, 32)

    assert manager.prepare_store(keys, ctx) is not None
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)

    output = manager.prepare_store(to_keys([10, 11]), make_req_context("evict"))
    assert output is not None
    assert set(output.evicted_keys) == {group_0_tail, group_1_tail}


@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("reverse_completion", [False, True])
def test_unfinished_lru_prefix_survives_pressure_across_store_batches(
    batch_size, reverse_completion
):
    """Keep a contiguous prefix while its owner is still generating."""
    manager = make_cpu_manager(num_chunks=8)
    ctx = make_req_context("unfinished")
    groups = [
        [make_offload_key(str(position).encode(), group) for position in range(3)]
        for group in range(2)
    ]
    batches = []
    for start in range(0, 3, batch_size):
        batch = [key for group in groups for key in group[start : start + batch_size]]
        for group in groups:
            for position in range(start, min(start + batch_size, 3)):
                ctx.set_offload_key_position(group[position], (position + 1) * 16)
        assert manager.prepare_store(batch, ctx) is not None
        batches.append(batch)
        if not reverse_completion:
            manager.complete_store(batch, ctx)
    if reverse_completion:
        for batch in reversed(batches):
            manager.complete_store(batch, ctx)

    output = manager.prepare_store(to_keys([10, 11, 12, 13]), make_req_context("B"))
    assert output is not None
    assert set(output.evicted_keys) == {group[-1] for group in groups}
    for group in groups:
        assert all(manager.lookup(key, ctx) is LookupResult.HIT for key in group[:-1])


@pytest.mark.parametrize("reuse_method", ["load", "store"])
def test_unfinished_lru_reused_prefix_outlives_new_tail(reuse_method):
    manager = make_cpu_manager(num_chunks=4)
    head, middle, tail = to_keys([1, 2, 3])
    seed = make_req_context("seed")
    assert manager.prepare_store([head, middle], seed) is not None
    manager.complete_store([head, middle], seed)
    manager.on_request_finished(seed)

    ctx = make_req_context("reuse")
    for position, key in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(key, position * 16)
    if reuse_method == "load":
        manager.prepare_load([head, middle], ctx)
        manager.complete_load([middle, head], ctx)
    else:
        assert manager.prepare_store([head, middle], ctx) is not None
    assert manager.prepare_store([tail], ctx) is not None
    manager.complete_store([tail], ctx)

    output = manager.prepare_store(to_keys([10, 11, 12]), make_req_context("B"))
    assert output is not None
    assert set(output.evicted_keys) == {middle, tail}
    assert manager.lookup(head, ctx) is LookupResult.HIT


def test_unfinished_lru_backfill_orders_by_token_position():
    manager = make_cpu_manager(num_chunks=3)
    ctx = make_req_context("backfill")
    head, middle, tail = to_keys([1, 2, 3])
    for position, key in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(key, position * 16)
    for key in [head, tail, middle]:
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)

    output = manager.prepare_store([to_key(4)], make_req_context("B"))
    assert output is not None
    assert output.evicted_keys == [tail]


def test_lru_failed_store_retry_preserves_prefix_order():
    manager = make_cpu_manager(num_chunks=2)
    ctx = make_req_context("retry")
    head, tail = to_keys([1, 2])
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    assert manager.prepare_store([head], ctx) is not None
    manager.complete_store([head], ctx, success=False)
    for key in [head, tail]:
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)

    output = manager.prepare_store([to_key(3)], make_req_context("B"))
    assert output is not None
    assert output.evicted_keys == [tail]


def test_lru_reset_discards_unfinished_request_recency():
    manager = make_cpu_manager(num_chunks=2)
    ctx = make_req_context("resumed")
    head = to_key(1)
    ctx.set_offload_key_position(head, 16)
    assert manager.prepare_store([head], ctx) is not None
    manager.complete_store([head], ctx)
    manager.reset_cache()

    other = make_req_context("other")
    other_key = to_key(9)
    other.set_offload_key_position(other_key, 16)
    assert manager.prepare_store([other_key], other) is not None
    manager.complete_store([other_key], other)
    assert manager.prepare_store([head], ctx) is not None
    manager.complete_store([head], ctx)

    output = manager.prepare_store([to_key(10)], make_req_context("B"))
    assert output is not None
    assert output.evicted_keys == [other_key]


def test_older_lru_request_does_not_demote_a_newer_shared_access():
    manager = make_cpu_manager(num_chunks=3)
    old = make_req_context("old")
    pinned, cold, shared = to_keys([1, 2, 3])
    for context, key, position in [
        (old, pinned, 16),
        (make_req_context("cold"), cold, 16),
        (make_req_context("newer"), shared, 32),
    ]:
        context.set_offload_key_position(key, position)
        assert manager.prepare_store([key], context) is not None
        manager.complete_store([key], context)
    manager.prepare_load([pinned], old)

    old.set_offload_key_position(shared, 32)
    manager.prepare_load([shared], old)
    manager.complete_load([shared], old)
    output = manager.prepare_store([to_key(4)], make_req_context("pressure"))
    assert output is not None
    assert output.evicted_keys == [cold]
    manager.complete_load([pinned], old)


def test_lru_incremental_stores_do_not_rescan_the_prefix():
    class CountingContext(ReqContext):
        position_lookups = 0

        def get_offload_key_position(self, key: OffloadKey) -> int | None:
            self.position_lookups += 1
            return super().get_offload_key_position(key)

    keys = to_keys(list(range(64)))
    manager = make_cpu_manager(num_chunks=len(keys))
    ctx = CountingContext(req_id="incremental")
    for position, key in enumerate(keys, 1):
        ctx.set_offload_key_position(key, position * 16)
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)

    assert 0 < ctx.position_lookups <= 3 * len(keys)


@pytest.mark.parametrize("ready_on_insert", [False, True])
def test_lru_insert_orders_positioned_chunks_without_followup_access(
    ready_on_insert, default_policy
):
    """Insertion alone orders new chunks, including out-of-order backfills."""
    # ADAPTED: built from our policy class (each of ours in turn) instead of vLLM's LRU
    policy = getattr(ours, OUR_POLICIES[default_policy])(cache_capacity=3)
    ctx = make_req_context("insert")
    head, middle, tail = to_keys([1, 2, 3])
    for position, key in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(key, position * 16)
    for chunk_id, key in enumerate([head, tail, middle]):
        chunk = ChunkStatus(chunk_id)
        if ready_on_insert:
            chunk.ref_cnt = 0
        policy.insert(key, chunk, ctx)
        if not ready_on_insert:
            chunk.ref_cnt = 0
            policy.mark_evictable(key)

    evicted = policy.evict(2, set())
    assert evicted is not None
    assert [key for key, _ in evicted] == [tail, middle]
    assert policy.get(head) is not None
