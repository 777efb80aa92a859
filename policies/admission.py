"""Admission: which offered chunks a tier accepts at all (``store_threshold``).

Every write to a tier costs bandwidth, and on an SSD also wear. Most chunks of a serving
workload are never read again, so a tier can require a chunk to prove reuse before it is
written: ``StoreThreshold(n)`` admits a key on its ``n``-th *offer* (a store attempt of a key
the tier does not hold), counted within a bounded LRU tracker so that memory stays bounded
and stale counts age out. ``n`` of 0 or 1 admits everything. Lookups are not offers: counting
them would make a key that is looked up and then stored reach the threshold twice as fast
(the bug that vLLM #52227 fixed for its CPU tier).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class StoreThreshold:
    """Admit a key once it has been offered ``n`` times. Not thread-safe (one caller thread)."""

    def __init__(self, n: int = 0, tracker_size: int = 64_000) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"store_threshold must be an integer >= 0, got {n!r}")
        if not isinstance(tracker_size, int) or tracker_size < 1:
            raise ValueError(f"tracker_size must be a positive integer, got {tracker_size!r}")
        self.n = n
        self.tracker_size = tracker_size
        self._offers: OrderedDict[Hashable, int] = OrderedDict()
        self.admitted = 0
        self.rejected = 0

    def offer(self, key: Hashable) -> bool:
        """Count one offer of ``key``; True if the tier should store it now."""
        if self.n <= 1:
            self.admitted += 1
            return True
        count = self._offers.pop(key, 0) + 1
        if count >= self.n:
            # Admitted keys leave the tracker: after an eviction they must prove reuse again.
            self.admitted += 1
            return True
        self._offers[key] = count
        if len(self._offers) > self.tracker_size:
            self._offers.popitem(last=False)
        self.rejected += 1
        return False

    def not_stored(self, key: Hashable) -> None:
        """An offer of ``key`` passed but the tier could not store it (no room now): the key
        keeps the offers it had, so its next offer passes instead of starting a new count."""
        self.admitted -= 1
        if self.n <= 1:
            return
        self._offers[key] = self.n - 1
        if len(self._offers) > self.tracker_size:
            self._offers.popitem(last=False)

    def offers(self, key: Hashable) -> int:
        """Offers counted so far for a key not yet admitted (0 if unknown or forgotten)."""
        return self._offers.get(key, 0)

    def clear(self) -> None:
        self._offers.clear()

    def __len__(self) -> int:
        return len(self._offers)
