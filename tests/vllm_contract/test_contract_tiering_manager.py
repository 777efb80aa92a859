# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contract: tiering.vllm.FileSecondaryTier as the secondary tiers of vLLM's own
TieringOffloadingManager (cascade, promotion, partial promotion failure, eviction, reset,
tier filters).

Origin: vLLM 0.33.0 source distribution,
tests/v1/kv_offload/tiering/test_tiering_offloading.py (class TestTieringOffloadingManager),
licence Apache-2.0 (the vLLM project's contributors). vLLM runs these with its in-memory
ExampleSecondaryTierManager, which completes every job inside the call; ours does real,
asynchronous file I/O, so where a test counted scheduler steps it now steps until the tier's
jobs are done (ADAPTED, with the reason at each place).

NOT BROUGHT IN: the tests of ExampleSecondaryTierManager itself, of the manager's private
bookkeeping driven by hand (_register_job/_process_finished_jobs with patched results),
metrics/config-info plumbing, tier-filter parsing, request-level (REQUEST_LEVEL) tiers and
lifecycle ordering with patched tiers: none of them exercises the secondary tier under test.
"""

import os
import time
from collections.abc import Iterable
from unittest.mock import MagicMock

import pytest
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.vllm import FileSecondaryTier

_CTX = ReqContext(req_id="test")
ROW_BYTES = 4096  # ADAPTED: one page per row (vLLM's mock uses 16-byte rows; ours are aligned)


def _spec() -> MagicMock:
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),), worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False, extra_config={}, engine_id="test-engine",
        model=OffloadingModelConfig(name="test-model", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False))
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(enable_kv_cache_events=False,
                                                     self_describing_kv_events=False)
    return spec


def _mock_mmap_region(num_chunks: int, row_bytes: int = ROW_BYTES):
    """Create a mock SharedOffloadRegion for testing (ADAPTED: page-aligned rows)."""
    raw = torch.zeros(num_chunks * row_bytes + 4096, dtype=torch.int8)
    shift = (-raw.data_ptr()) % 4096
    rows = raw[shift:shift + num_chunks * row_bytes].view(num_chunks, row_bytes)
    mock = MagicMock()
    mock.create_kv_memoryview.return_value = memoryview(rows.numpy())
    mock.rows = rows
    return mock


def to_keys(int_ids: Iterable[int]) -> list[OffloadKey]:
    return [make_offload_key(str(i).encode(), 0) for i in int_ids]


def count_hits(manager, keys: list[OffloadKey]) -> int | None:
    """Count consecutive lookup hits from the start of keys.

    Returns the count of leading HIT results, or None if any lookup
    returns HIT_PENDING or RETRY.
    """
    count = 0
    for key in keys:
        result = manager.lookup(key, _CTX)
        if result in (LookupResult.HIT_PENDING, LookupResult.RETRY):
            return None
        if result is not LookupResult.HIT:
            break
        count += 1
    return count


def histogram_count_key(metric_name: str, labelvalues: tuple[str, ...]) -> str:
    return f"{metric_name}:{labelvalues}_count"


def corrupt(tier: FileSecondaryTier, key: OffloadKey) -> None:
    """Damage one stored row in our slab files (its checksum then fails on read)."""
    store = tier.tier
    index, offset = divmod(store.entry(key).slot, store.slabs.slots_per_file)
    with open(store.folder / f"slab-{index:04d}.dat", "r+b") as f:
        f.seek(offset * store.slabs.slot_bytes)
        f.write(os.urandom(ROW_BYTES))


class TestTieringOffloadingManager:
    """Tests for TieringOffloadingManager with our file tier as both secondary tiers."""

    @pytest.fixture
    def manager_setup(self, tmp_path):
        # Create primary tier (CPU-based)
        mock_region = _mock_mmap_region(5)
        self.rows = mock_region.rows
        self.primary_tier = CPUPrimaryTierOffloadingManager(
            num_chunks=5, mmap_region=mock_region
        )

        mock_view = mock_region.create_kv_memoryview()

        # ADAPTED: two of our file tiers (own folders) instead of two example tiers
        def file_tier(name: str) -> FileSecondaryTier:
            return FileSecondaryTier(offloading_spec=_spec(), primary_kv_view=mock_view,
                            tier_type="FileTier", path=str(tmp_path / name),
                            capacity=16 * ROW_BYTES, io="posix", io_threads=2,
                            slab_file_bytes=4 * ROW_BYTES)

        self.secondary_tier1 = file_tier("t1")
        self.secondary_tier2 = file_tier("t2")

        # Create tiered manager
        self.manager = TieringOffloadingManager(
            primary_tier=self.primary_tier,
            secondary_tiers=[self.secondary_tier1, self.secondary_tier2],
        )
        yield
        self.manager.shutdown()

    def _simulate_on_schedule_end(self, new_req_ids: list[str] | None = None):
        """Simulate end of scheduler step: lifecycle flush + drain events."""
        ctx = ScheduleEndContext(new_req_ids=new_req_ids or [], preempted_req_ids=())
        self.manager.on_schedule_end(ctx)
        list(self.manager.take_events())

    def _step_until_idle(self, steps: int = 400):
        """ADAPTED: where vLLM counts two steps for its synchronous example tier, step
        until our tiers' file I/O has completed and been collected."""
        for _ in range(steps):
            self._simulate_on_schedule_end()
            if not self.manager.has_pending_work() and not self.manager._jobs:
                return
            time.sleep(0.005)
        raise AssertionError("tier jobs still pending")

    def _start_request(self, req_context: ReqContext = _CTX):
        if req_context.req_id not in self.manager._req_state:
            self.manager.on_new_request(req_context)

    def _put_in_secondary(self, tier: FileSecondaryTier, chunks: list[OffloadKey]):
        """ADAPTED: vLLM writes `tier.chunks[key] = True` into its in-memory example tier;
        ours gets the chunks by a real store from primary rows holding known bytes."""
        import numpy as np
        from vllm.v1.kv_offload.tiering.base import TransferJob

        for i, _ in enumerate(chunks):
            self.rows[i] = i + 1
        tier.submit_store(TransferJob(job_id=10_000, keys=chunks,
                                      chunk_ids=np.arange(len(chunks), dtype=np.int64),
                                      is_promotion=False, req_context=_CTX))
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]
        self.rows.zero_()

    def test_basic_store_to_primary(self, manager_setup):
        """Test basic store operation to primary tier."""
        chunks = to_keys(range(3))

        # Prepare store
        self._start_request()
        result = self.manager.prepare_store(chunks, _CTX)
        assert result is not None
        assert len(result.keys_to_store) == 3

        # Complete store
        self.manager.complete_store(chunks, _CTX, success=True)

        # Chunks should be in primary tier
        assert count_hits(self.primary_tier, chunks) == 3

    def test_cascade_to_all_secondary_tiers(self, manager_setup, monkeypatch):
        """Test that chunks are cascaded to ALL secondary tiers."""
        chunks = to_keys(range(3))

        tier1_submit_store = MagicMock(wraps=self.secondary_tier1.submit_store)
        tier2_submit_store = MagicMock(wraps=self.secondary_tier2.submit_store)
        monkeypatch.setattr(self.secondary_tier1, "submit_store", tier1_submit_store)
        monkeypatch.setattr(self.secondary_tier2, "submit_store", tier2_submit_store)

        # Store to primary
        self._start_request()
        result = self.manager.prepare_store(chunks, _CTX)
        assert result is not None

        # Complete store (triggers cascade via submit_store on each tier)
        self.manager.complete_store(chunks, _CTX, success=True)

        # submit_store was called once per secondary tier
        tier1_submit_store.assert_called_once()
        tier2_submit_store.assert_called_once()

        # ADAPTED: our writes complete asynchronously; then the chunks are in both tiers
        # (vLLM reads its example tier's get_num_chunks(); ours counts its index entries)
        self._step_until_idle()
        assert len(self.secondary_tier1.tier) == 3
        assert len(self.secondary_tier2.tier) == 3

        # Verify chunks are present
        assert all(
            self.secondary_tier1.lookup(c, _CTX) is LookupResult.HIT for c in chunks
        )
        assert all(
            self.secondary_tier2.lookup(c, _CTX) is LookupResult.HIT for c in chunks
        )

    def test_ref_cnt_protection_during_cascade(self, manager_setup):
        """Test that ref_cnt protects chunks during cascade."""
        chunks = to_keys(range(3))

        # Store to primary
        self._start_request()
        result = self.manager.prepare_store(chunks, _CTX)
        assert result is not None
        self.manager.complete_store(chunks, _CTX, success=True)

        # After complete_store, chunks should have ref_cnt > 0
        # (one for each secondary tier)
        for key in chunks:
            chunk = self.primary_tier._policy.get(key)
            assert chunk is not None
            # ref_cnt should be 2 (one for each secondary tier)
            assert chunk.ref_cnt == 2

        # ADAPTED: vLLM checks the exact step at which its synchronous tier's completions
        # are collected; ours finish when the disk says so, so step until they have
        self._step_until_idle()

        # After cascade completes, ref_cnt should be 0
        for key in chunks:
            chunk = self.primary_tier._policy.get(key)
            assert chunk is not None
            assert chunk.ref_cnt == 0

    def test_lookup_from_primary(self, manager_setup):
        """Test lookup when chunks are in primary tier."""
        chunks = to_keys(range(3))

        # Store chunks
        self._start_request()
        self.manager.prepare_store(chunks, _CTX)
        self.manager.complete_store(chunks, _CTX, success=True)

        # Lookup should find all chunks in primary
        assert count_hits(self.manager, chunks) == 3

    @pytest.mark.parametrize(
        "source",
        [CacheHitSource.EXTERNAL_UNSPECIFIED, CacheHitSource.DISK, CacheHitSource.P2P],
    )
    def test_promotion_from_secondary(self, manager_setup, monkeypatch, source):
        """Test promotion of chunks from secondary to primary tier."""
        monkeypatch.setattr(FileSecondaryTier, "cache_hit_source", source)
        chunks = to_keys(range(3))

        # Manually add chunks to secondary tier (simulate previous cascade)
        self._put_in_secondary(self.secondary_tier1, chunks)

        original_submit_load = self.secondary_tier1.submit_load

        def submit_load(job_metadata):
            assert job_metadata.job_id in self.manager._jobs
            original_submit_load(job_metadata)

        self.secondary_tier1.submit_load = submit_load  # type: ignore[method-assign]

        # Lookup each chunk to initiate promotion for all of them
        for chunk in chunks:
            result = self.manager.lookup(chunk, _CTX)
            assert result is LookupResult.HIT_PENDING  # promotion initiated

        # ADAPTED: step until the reads are done (vLLM: exactly two steps)
        self._step_until_idle()

        stats = self.manager.get_stats()
        assert stats is not None
        reduced = stats.reduce()
        assert (
            reduced[
                histogram_count_key(
                    TieringOffloadingMetrics.PROMOTION_LATENCY,
                    ("1:FileTier", "success"),  # ADAPTED: our tier's type in the label
                )
            ]
            == 1
        )

        # Now chunks should be in primary tier
        assert count_hits(self.primary_tier, chunks) == 3
        # ADAPTED (added): the promoted rows hold the bytes that were stored
        chunk_ids = [self.primary_tier._policy.get(c).chunk_id for c in chunks]
        assert [int(self.rows[cid][0]) for cid in chunk_ids] == [1, 2, 3]

        # Next lookup should succeed
        assert count_hits(self.manager, chunks) == 3

        # The request that caused the promotion retains the secondary origin.
        assert all(
            self.manager.get_load_source(chunk, _CTX) == source for chunk in chunks
        )

        # A later request sees the chunks as ordinary host-memory primary hits.
        later_context = ReqContext(req_id="later")
        self.manager.on_new_request(later_context)
        assert all(
            self.manager.lookup(chunk, later_context) is LookupResult.HIT
            for chunk in chunks
        )
        assert all(
            self.manager.get_load_source(chunk, later_context) == "host"
            for chunk in chunks
        )

    @pytest.mark.parametrize(
        ("bad_indices", "expected_results"),
        [
            ((1,), [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]),
            ((0, 1, 2), [LookupResult.MISS, LookupResult.MISS, LookupResult.MISS]),
        ],
        ids=["partial", "full-failure"],
    )
    def test_failed_promotion_keeps_only_successful_chunks(
        self, manager_setup, bad_indices, expected_results
    ):
        # ADAPTED: vLLM patches submit_load to report a made-up partial result; here the
        # failure is real: the rows at bad_indices are damaged on disk before the promotion.
        # (vLLM's check of its manager's private _request_load_sources is left out.)
        chunks = to_keys(range(3))
        self._put_in_secondary(self.secondary_tier1, chunks)
        for i in bad_indices:
            corrupt(self.secondary_tier1, chunks[i])

        for chunk in chunks:
            assert self.manager.lookup(chunk, _CTX) is LookupResult.HIT_PENDING

        self._step_until_idle()

        assert [
            self.primary_tier.lookup(chunk, _CTX) for chunk in chunks
        ] == expected_results
        # ADAPTED (added): a damaged chunk is gone from our tier, the others stay
        for i, chunk in enumerate(chunks):
            want = LookupResult.MISS if i in bad_indices else LookupResult.HIT
            assert self.secondary_tier1.lookup(chunk, _CTX) is want

    def test_partial_lookup(self, manager_setup):
        """Test lookup with partial hits."""
        chunks = to_keys(range(5))

        # Store first 3 chunks to primary
        self._start_request()
        self.manager.prepare_store(chunks[:3], _CTX)
        self.manager.complete_store(chunks[:3], _CTX, success=True)

        # Lookup all 5 chunks should return 3 (first 3 found)
        assert count_hits(self.manager, chunks) == 3

    def test_eviction_in_primary_tier(self, manager_setup):
        """Test eviction in primary tier when capacity is exceeded."""
        # Primary tier has capacity of 5 chunks
        # First, fill the primary tier
        chunks = to_keys(range(5))
        self._start_request()
        result = self.manager.prepare_store(chunks, _CTX)
        assert result is not None
        assert len(result.keys_to_store) == 5
        self.manager.complete_store(chunks, _CTX, success=True)

        # End of step: release ref_cnt from cascade (ADAPTED: once our writes are done)
        self._step_until_idle()

        # Now try to store 2 more chunks (should trigger eviction)
        more_chunks = to_keys(range(5, 7))
        result = self.manager.prepare_store(more_chunks, _CTX)

        # Should evict 2 chunks from primary tier
        assert result is not None
        assert len(result.evicted_keys) == 2
        assert len(result.keys_to_store) == 2

    def test_reset_cache_drains_all_tiers(self, manager_setup, monkeypatch):
        """reset_cache must drain each secondary tier before resetting
        the primary tier so no tier I/O is touching primary memory."""
        tier1_drain_jobs = MagicMock(wraps=self.secondary_tier1.drain_jobs)
        tier2_drain_jobs = MagicMock(wraps=self.secondary_tier2.drain_jobs)
        monkeypatch.setattr(self.secondary_tier1, "drain_jobs", tier1_drain_jobs)
        monkeypatch.setattr(self.secondary_tier2, "drain_jobs", tier2_drain_jobs)

        # Drive a cascade so a job lands in _jobs.
        chunks = to_keys(range(3))
        self._start_request()
        self.manager.prepare_store(chunks, _CTX)
        self.manager.complete_store(chunks, _CTX, success=True)
        assert self.manager._jobs

        self.manager.reset_cache()

        tier1_drain_jobs.assert_called_once()
        tier2_drain_jobs.assert_called_once()
        assert self.manager._jobs == {}
        # ADAPTED (added): nothing of ours is in flight any more, and what was written stays
        assert not self.secondary_tier1.has_pending_work()
        assert all(self.secondary_tier1.lookup(c, _CTX) is LookupResult.HIT for c in chunks)

    @pytest.mark.parametrize(
        "load_tier_filter",
        [
            # ADAPTED: vLLM's example tiers are CPU, so it excludes them with a STORAGE
            # matcher; ours are STORAGE, excluded by a CPU one
            TierFilter(matchers=(TierMatcher(medium=Medium.CPU),)),
            TierFilter(matchers=()),
        ],
        ids=["non_matching_medium", "empty_no_load"],
    )
    def test_tier_filter_skips_filtered_secondary(
        self, manager_setup, monkeypatch, load_tier_filter
    ):
        """Filter excluding secondary medium returns MISS from secondaries
        even when they hold the chunk; primary is unaffected."""
        chunks = to_keys(range(2))
        # Put one chunk only in secondary, then one in primary
        self._put_in_secondary(self.secondary_tier1, chunks[1:])
        self._start_request()
        self.manager.prepare_store(chunks[:1], _CTX)
        self.manager.complete_store(chunks[:1], _CTX, success=True)

        tier1_lookup = MagicMock(wraps=self.secondary_tier1.lookup)
        monkeypatch.setattr(self.secondary_tier1, "lookup", tier1_lookup)

        ctx = ReqContext(req_id="r1", load_tier_filter=load_tier_filter)
        assert self.manager.lookup(chunks[0], ctx) is LookupResult.HIT
        assert self.manager.lookup(chunks[1], ctx) is LookupResult.MISS
        tier1_lookup.assert_not_called()

    @pytest.mark.parametrize(
        "load_tier_filter",
        [
            TierFilter.ALL,
            # ADAPTED: STORAGE matches our tiers (vLLM's example tiers match CPU)
            TierFilter(matchers=(TierMatcher(medium=Medium.STORAGE),)),
            TierFilter(matchers=(TierMatcher(),)),
        ],
        ids=["all", "explicit_storage", "unconstrained_matcher"],
    )
    def test_tier_filter_allows_matching_secondary(
        self, manager_setup, monkeypatch, load_tier_filter
    ):
        """Filter that matches the secondary's medium allows lookup."""
        chunks = to_keys(range(1))
        self._put_in_secondary(self.secondary_tier1, chunks)

        tier1_lookup = MagicMock(wraps=self.secondary_tier1.lookup)
        monkeypatch.setattr(self.secondary_tier1, "lookup", tier1_lookup)

        ctx = ReqContext(req_id="r2", load_tier_filter=load_tier_filter)
        assert self.manager.lookup(chunks[0], ctx) is LookupResult.HIT_PENDING
        tier1_lookup.assert_called()
