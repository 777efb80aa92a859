"""S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

New keys enter the small queue S (about 10% of capacity). Most keys are never hit again, and
S lets them go quickly ("quick demotion"): at the tail of S a key that was hit at least
``promote_hits`` times moves to the main queue M, any other leaves for the ghost queue G (names
only). A key stored again while it is in G goes straight to M. M is a CLOCK-like FIFO: a key at
its tail with a non-zero hit counter is reinserted at the head with the counter decremented.
Hit counters saturate at 3. Everything is a FIFO, so each operation is O(1).

Pinned or protected keys reaching a tail are rotated to the head of their queue unchanged and
counted against a step budget, so a queue full of pinned keys cannot loop forever.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterator
from itertools import compress

from tiering.policies.base import EvictionPolicy, Key

_MAX_FREQ = 3


class S3FifoPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, promote_hits: int = 1) -> None:
        super().__init__(capacity)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio!r}")
        self.small_target = max(1, int(capacity * small_ratio))
        self.promote_hits = promote_hits
        self.small: OrderedDict[Key, None] = OrderedDict()  # head = last item
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.ghost_capacity = max(1, capacity - self.small_target)
        self.freq: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def __iter__(self) -> Iterator[Key]:
        return iter([*self.small, *self.main])

    def peek_victims(self, n: int) -> list[Key]:
        return list(itertools.islice(itertools.chain(self.small, self.main), n))

    def insert(self, key: Key) -> None:
        if key in self.freq:
            raise KeyError(f"{key!r} is already resident")
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def access(self, key: Key) -> None:
        f = self.freq.get(key)
        if f is not None and f < _MAX_FREQ:
            self.freq[key] = f + 1

    def refresh(self, key: Key) -> None:
        """Back to the head of its queue as if inserted now; the hit counter is unchanged."""
        for queue in (self.small, self.main):
            if key in queue:
                queue.move_to_end(key)
                return

    def _discard(self, key: Key) -> bool:
        if self.freq.pop(key, None) is None:
            return False
        if self.small.pop(key, 0) is not None:
            del self.main[key]
        return True

    def _pick_victims(self, n: int, protected: Collection[Key]) -> list[Key]:
        victims: list[Key] = []
        # Consecutive blocked keys seen at each tail: once a whole queue has rotated without
        # progress, the other queue is used even if the size rule points elsewhere.
        stuck = {"small": 0, "main": 0}
        budget = (len(self) + 1) * (_MAX_FREQ + 2) * n
        while len(victims) < n:
            budget -= 1
            if budget < 0:  # pragma: no cover - evict() checked the count beforehand
                raise RuntimeError("S3-FIFO could not find an evictable key")
            use_small = bool(self.small) and (len(self.small) >= self.small_target or not self.main)
            if use_small and stuck["small"] >= len(self.small) and self.main:
                use_small = False
            elif not use_small and self.small and stuck["main"] >= len(self.main):
                use_small = True
            queue = "small" if use_small else "main"
            step = self._step_small if use_small else self._step_main
            if step(victims, protected):
                stuck[queue] += 1
            else:
                stuck = {"small": 0, "main": 0}
        return victims

    def _step_small(self, victims: list[Key], protected: Collection[Key]) -> bool:
        """Process the tail of S; True when it was blocked and only rotated."""
        key, _ = self.small.popitem(last=False)
        if self._blocked(key, protected):
            self.small[key] = None
            return True
        if self.freq[key] >= self.promote_hits:
            self.freq[key] = 0
            self.main[key] = None
            return False
        del self.freq[key]
        self.ghost[key] = None
        if len(self.ghost) > self.ghost_capacity:
            self.ghost.popitem(last=False)
        victims.append(key)
        return False

    def _step_main(self, victims: list[Key], protected: Collection[Key]) -> bool:
        """Process the tail of M; True when it was blocked and only rotated."""
        key, _ = self.main.popitem(last=False)
        if self._blocked(key, protected):
            self.main[key] = None
            return True
        f = self.freq[key]
        if f > 0:
            self.freq[key] = f - 1
            self.main[key] = None
            return False
        del self.freq[key]
        victims.append(key)
        return False

    def bulk_load(self, keys: list[Key], reused: list[bool]) -> None:
        """Reused keys go to the main queue (freq 1), the others to the small queue."""
        if len(self):
            return super().bulk_load(keys, reused)
        self.freq = dict.fromkeys(keys, 0)
        cold = [not hot for hot in reused]
        self.small = OrderedDict.fromkeys(compress(keys, cold))
        self.main = OrderedDict.fromkeys(compress(keys, reused))
        for k in self.main:
            self.freq[k] = 1

    def clear(self) -> None:
        super().clear()
        self.ghost.clear()

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "small": len(self.small), "main": len(self.main),
                "ghost": len(self.ghost)}
