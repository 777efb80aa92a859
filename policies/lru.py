"""Least recently used: evict the key whose last insert or hit is oldest."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterator

from tiering.policies.base import EvictionPolicy, Key


class LruPolicy(EvictionPolicy[Key]):
    """One ordered dict, oldest first. Pinned keys keep their place and are stepped over."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._order))

    def peek_victims(self, n: int) -> list[Key]:
        return list(itertools.islice(self._order, n))

    def insert(self, key: Key) -> None:
        if key in self._order:
            raise KeyError(f"{key!r} is already resident")
        self._order[key] = None

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def refresh(self, key: Key) -> None:
        self.access(key)  # recency is all LRU knows

    def _discard(self, key: Key) -> bool:
        return self._order.pop(key, 0) is None

    def _scan_order(self) -> Iterator[Key]:
        return iter(self._order)

    def _pick_victims(self, n: int, protected: Collection[Key]) -> list[Key]:
        """Oldest first, stepping over pinned and protected keys; stops at the ``n``-th, so an
        eviction costs the blocked keys at the old end, not every pin and protected key."""
        victims = []
        pins = self._pins
        for key in self._order:
            if key in pins or key in protected:
                continue
            victims.append(key)
            if len(victims) == n:
                break
        for key in victims:
            del self._order[key]
        return victims

    def bulk_load(self, keys: list[Key], reused: list[bool]) -> None:
        if self._order:
            return super().bulk_load(keys, reused)
        self._order = OrderedDict.fromkeys(keys)
