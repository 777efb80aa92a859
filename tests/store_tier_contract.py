"""The contract every store tier (``tiering.tier.StoreTier``) passes, as a mixin of tests.

A tier's test module subclasses ``StoreTierContract`` and supplies how to build the tier and how
to damage one stored chunk (``tests/test_tier_contract.py::TestFileTierContract``)::

    class TestMyTierContract(StoreTierContract):
        survives_restart = True          # a new instance over the same place sees old keys

        @pytest.fixture
        def make_tier(self, tmp_path):   # make_tier(model=...) -> an open tier of CAPACITY rows
            def make(model: str = "tiny") -> StoreTier:
                return MyTier(..., capacity=self.CAPACITY * ROW, namespace=model)
            return make

        def corrupt(self, tier, key):    # change the stored bytes of ``key`` behind its back
            ...

Every test builds its tiers with ``make_tier`` and ends with ``tier.check()``; the tests use
only the ``StoreTier`` methods, the outcome types and the counters of ``tiering.stats``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from tierutil import ROW, key, row_for

from tiering.backends.slab_io import aligned_buffer
from tiering.tier import Completion, Lookup, StoreTier

MakeTier = Callable[..., StoreTier]


class StoreTierContract:
    """Contract tests for a store tier; subclass it with ``make_tier`` and ``corrupt``."""

    CAPACITY = 8  # rows the tier built by ``make_tier`` holds
    survives_restart = True

    @pytest.fixture
    def make_tier(self) -> MakeTier:
        raise NotImplementedError("a StoreTierContract subclass provides make_tier")

    def corrupt(self, tier: StoreTier, k: bytes) -> None:
        raise NotImplementedError("a StoreTierContract subclass provides corrupt")

    @pytest.fixture
    def tier(self, make_tier: MakeTier) -> Iterator[StoreTier]:
        t = make_tier()
        yield t
        t.wait_idle()
        t.check()
        t.close()

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def store(t: StoreTier, keys: list[bytes]) -> list[Completion]:
        out = t.put(keys, [row_for(k, t.row_bytes) for k in keys])
        assert out.admitted == [k for k in keys if k not in out.rejected], out
        done = t.wait_idle()
        assert sorted(d.key for d in done if d.kind == "store") == sorted(out.admitted)
        return done

    @staticmethod
    def read(t: StoreTier, k: bytes) -> tuple[bytes | None, list[Completion]]:
        buf = aligned_buffer(t.row_bytes)
        if t.get([(k, buf, "token")]) != [True]:
            return None, []
        done = t.wait_idle()
        assert [(d.kind, d.key, d.token) for d in done] == [("read", k, "token")], done
        return (bytes(buf) if done[0].ok else None), done

    # -- writes and reads -----------------------------------------------------------------
    def test_stored_rows_read_back_byte_exact(self, tier: StoreTier) -> None:
        ks = [key(i) for i in range(4)]
        done = self.store(tier, ks)
        assert all(d.ok and d.kind == "store" for d in done), done
        for k in ks:
            assert tier.lookup(k) is Lookup.HIT and tier.contains(k)
            data, _ = self.read(tier, k)
            assert data == bytes(row_for(k, tier.row_bytes))
        assert tier.stats["stores"] == 4 and tier.stats["promotions"] == 4
        assert tier.usage()[2] == 4
        tier.check()

    def test_only_poll_makes_a_written_key_readable(self, tier: StoreTier) -> None:
        k = key("w")
        out = tier.put([k], [row_for(k, tier.row_bytes)])
        assert out.admitted == [k]
        assert tier.has_pending_work()
        assert tier.lookup(k, count=False) is Lookup.PENDING and not tier.contains(k)
        assert tier.get([(k, aligned_buffer(tier.row_bytes), None)]) == [False]
        done = tier.wait_idle()
        assert [(d.kind, d.key, d.ok) for d in done] == [("store", k, True)]
        assert not tier.has_pending_work() and tier.contains(k)

    def test_keys_already_held_are_not_stored_again(self, tier: StoreTier) -> None:
        k = key(0)
        self.store(tier, [k])
        out = tier.put([k], [row_for(k, tier.row_bytes)])
        assert out.admitted == [] and out.rejected == {} and tier.wait_idle() == []
        assert tier.stats["stores"] == 1

    def test_a_missing_key_is_a_miss_counted_once(self, tier: StoreTier) -> None:
        k = key("absent")
        assert tier.lookup(k) is Lookup.MISS
        for _ in range(3):
            assert tier.lookup(k, count=False) is Lookup.MISS
        assert (tier.stats["lookups"], tier.stats["hits"]) == (1, 0)
        assert tier.get([(k, aligned_buffer(tier.row_bytes), None)]) == [False]
        assert tier.stats["promotion_failures"] == 1
        tier.touch([k])  # unknown keys are ignored
        assert not tier.contains(k)

    def test_bad_input_raises_before_anything_changes(self, tier: StoreTier) -> None:
        k, other = key(0), key(1)
        with pytest.raises(ValueError, match="bytes"):
            tier.put([k, other], [row_for(k, tier.row_bytes), memoryview(b"short")])
        assert tier.wait_idle() == [] and not tier.contains(k) and tier.usage()[2] == 0
        self.store(tier, [k, other])
        with pytest.raises(ValueError, match="bytes"):
            tier.get([(k, aligned_buffer(tier.row_bytes), None), (other, bytearray(3), None)])
        assert not tier.has_pending_work()  # nothing was started, nothing stays pinned
        assert tier.drop([k, other]) == 2

    # -- removal --------------------------------------------------------------------------
    def test_a_dropped_key_is_gone_and_reported(self, tier: StoreTier) -> None:
        removed: list[bytes] = []
        tier.on_removed(removed.extend)
        ks = [key(i) for i in range(3)]
        self.store(tier, ks)
        assert tier.drop([ks[0], key("never")]) == 1
        assert removed == [ks[0]]
        assert tier.lookup(ks[0]) is Lookup.MISS and not tier.contains(ks[0])
        assert self.read(tier, ks[0]) == (None, [])
        assert tier.contains(ks[1]) and tier.usage()[2] == 2

    def test_evict_removes_by_policy_and_counts(self, tier: StoreTier) -> None:
        removed: list[bytes] = []
        tier.on_removed(removed.extend)
        ks = [key(i) for i in range(4)]
        for k in ks:  # one at a time: ks[0] is the least recently used
            self.store(tier, [k])
        tier.touch([ks[0]])
        gone = tier.evict(2)
        assert len(gone) == 2 and ks[0] not in gone and sorted(removed) == sorted(gone)
        assert not any(tier.contains(k) for k in gone)
        assert tier.stats["evictions"] == 2 and tier.usage()[2] == 2

    def test_a_full_tier_evicts_for_new_keys(self, tier: StoreTier) -> None:
        removed: list[bytes] = []
        tier.on_removed(removed.extend)
        ks = [key(i) for i in range(self.CAPACITY + 3)]
        for k in ks:
            self.store(tier, [k])
        assert tier.usage()[2] == self.CAPACITY
        assert len(removed) == 3 and not any(tier.contains(k) for k in removed)
        assert tier.stats["evictions"] == 3
        for k in ks:
            if k not in removed:
                assert self.read(tier, k)[0] == bytes(row_for(k, tier.row_bytes))

    def test_a_key_being_read_is_neither_dropped_nor_evicted(self, tier: StoreTier) -> None:
        ks = [key(i) for i in range(self.CAPACITY)]
        self.store(tier, ks)
        buf = aligned_buffer(tier.row_bytes)
        assert tier.get([(ks[0], buf, None)]) == [True]
        assert tier.drop([ks[0]]) == 0
        assert ks[0] not in tier.evict(self.CAPACITY)
        tier.check()
        (done,) = tier.wait_idle()
        assert done.ok and bytes(buf) == bytes(row_for(ks[0], tier.row_bytes))
        assert tier.drop([ks[0]]) == 1

    # -- faults ---------------------------------------------------------------------------
    def test_a_corrupt_chunk_is_a_counted_miss_and_dropped(self, tier: StoreTier) -> None:
        ks = [key(0), key(1)]
        self.store(tier, ks)
        self.corrupt(tier, ks[0])
        data, done = self.read(tier, ks[0])
        assert data is None and not done[0].ok and done[0].reason
        assert not tier.contains(ks[0]) and tier.lookup(ks[0]) is Lookup.MISS
        assert tier.stats["promotion_failures"] == 1
        assert self.read(tier, ks[1])[0] == bytes(row_for(ks[1], tier.row_bytes))

    # -- namespaces and restarts ----------------------------------------------------------
    def test_another_namespace_never_hits(self, make_tier: MakeTier) -> None:
        a = make_tier(model="model-a")
        try:
            self.store(a, [key(0)])
            b = make_tier(model="model-b")
            try:
                assert b.lookup(key(0)) is Lookup.MISS
                assert b.get([(key(0), aligned_buffer(b.row_bytes), None)]) == [False]
                b.check()
            finally:
                b.close()
            a.check()
        finally:
            a.close()

    def test_a_restart_keeps_hits(self, make_tier: MakeTier) -> None:
        if not self.survives_restart:
            pytest.skip("this tier does not keep keys across instances")
        ks = [key(i) for i in range(3)]
        t = make_tier()
        self.store(t, ks)
        t.close()
        t = make_tier()
        try:
            for k in ks:
                assert t.lookup(k) is Lookup.HIT
                assert self.read(t, k)[0] == bytes(row_for(k, t.row_bytes))
            t.check()
        finally:
            t.close()


__all__ = ["ROW", "StoreTierContract"]
