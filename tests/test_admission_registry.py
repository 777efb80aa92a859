"""store_threshold counting and the policy registry."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tiering.policies import LruPolicy, StoreThreshold, create, resolve


@pytest.mark.parametrize("n", [0, 1])
def test_threshold_zero_or_one_admits_all(n):
    adm = StoreThreshold(n)
    assert all(adm.offer(k) for k in range(100))
    assert adm.rejected == 0 and adm.admitted == 100
    assert len(adm) == 0  # nothing tracked when admitting everything


def test_threshold_counts_offers():
    adm = StoreThreshold(3)
    assert adm.offer("a") is False
    assert adm.offer("a") is False
    assert adm.offers("a") == 2
    assert adm.offer("a") is True
    assert adm.rejected == 2 and adm.admitted == 1
    # admitted keys leave the tracker: after an eviction they must prove reuse again
    assert adm.offers("a") == 0
    assert adm.offer("a") is False


def test_threshold_tracker_is_bounded_and_forgets_oldest():
    adm = StoreThreshold(2, tracker_size=3)
    for k in "abcd":
        adm.offer(k)
    assert len(adm) == 3
    assert adm.offers("a") == 0  # oldest forgotten
    assert adm.offer("a") is False  # so its count restarts
    assert adm.offer("d") is True


def test_threshold_recent_offer_refreshes_tracker_position():
    adm = StoreThreshold(3, tracker_size=2)
    adm.offer("a")
    adm.offer("b")
    adm.offer("a")  # a is now the newest
    adm.offer("c")  # evicts b, not a
    assert adm.offers("a") == 2 and adm.offers("b") == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_threshold_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="store_threshold"):
        StoreThreshold(bad)


def test_registry_names_are_case_insensitive():
    assert isinstance(create("LRU", capacity=3), LruPolicy)


def test_registry_unknown_name_lists_known():
    with pytest.raises(ValueError, match=r"unknown policy 'fifo'.*arc, lru, s3fifo"):
        create("fifo", capacity=3)


def test_registry_loads_out_of_tree_policy(tmp_path, monkeypatch):
    (tmp_path / "mypol.py").write_text(textwrap.dedent("""
        from tiering.policies.lru import LruPolicy

        class MruPolicy(LruPolicy):
            name = "mru"

            def _pick_victims(self, n, protected):
                victims = [k for k in reversed(self._order)
                           if not self._blocked(k, protected)][:n]
                for k in victims:
                    del self._order[k]
                return victims

        class NotAPolicy:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    p = create("mypol:MruPolicy", capacity=4)
    for k in range(3):
        p.insert(k)
    assert p.evict(1) == [2]
    with pytest.raises(ValueError, match="not an EvictionPolicy subclass"):
        resolve("mypol:NotAPolicy")
    with pytest.raises(ValueError, match="cannot import module 'nosuchmod'"):
        resolve("nosuchmod:X")
    sys.modules.pop("mypol", None)


@pytest.mark.parametrize("cap", [0, -3, 2.5])
def test_policy_rejects_bad_capacity(cap):
    with pytest.raises(ValueError, match="capacity"):
        create("arc", capacity=cap)
