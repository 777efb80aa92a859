"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

Resident keys live in T1 (seen once since they entered) or T2 (hit at least once more). Keys
evicted from T1/T2 leave their name in the ghost lists B1/B2. A key that comes back while it is
a ghost tells which list was too short, and the target size ``p`` of T1 moves towards it:
back from B1 → grow T1 (recency was under-served), back from B2 → shrink T1 (frequency was).

Ghost lists are real and bounded: |T1| + |B1| <= capacity and |T1|+|T2|+|B1|+|B2| <= 2*capacity,
as in the paper. A one-off scan therefore fills T1/B1 and leaves T2, the frequent set, alone.

When the list that ``p`` points at has nothing evictable (all pinned or protected), the victim
comes from the other list, so eviction never fails while any evictable key exists.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterator
from itertools import compress

from tiering.policies.base import EvictionPolicy, Key


class ArcPolicy(EvictionPolicy[Key]):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0  # target size of T1

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._scan_order()))

    def _scan_order(self) -> Iterator[Key]:
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        return itertools.chain(first, second)

    def peek_victims(self, n: int) -> list[Key]:
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        return list(itertools.islice(itertools.chain(first, second), n))

    def on_miss(self, key: Key) -> None:
        """Adapt ``p`` when a lookup misses a ghost (the key is about to be stored again)."""
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(self.b2) / len(self.b1)))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))

    def insert(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            raise KeyError(f"{key!r} is already resident")
        if key in self.b1 or key in self.b2:
            # A ghost coming back was seen before: it belongs to the frequent side.
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def access(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def refresh(self, key: Key) -> None:
        """Most recent within its own list: T1 stays T1 (a store is not a second use)."""
        for lst in (self.t1, self.t2):
            if key in lst:
                lst.move_to_end(key)
                return

    def _discard(self, key: Key) -> bool:
        if key in self.t1:
            del self.t1[key]
            return True
        if key in self.t2:
            del self.t2[key]
            return True
        return False

    def _first_evictable(self, lst: OrderedDict[Key, None], protected: Collection[Key]
                         ) -> Key | None:
        for key in lst:
            if not self._blocked(key, protected):
                return key
        return None

    def _pick_victims(self, n: int, protected: Collection[Key]) -> list[Key]:
        victims: list[Key] = []
        while len(victims) < n:
            prefer_t1 = len(self.t1) > 0 and len(self.t1) >= max(1, int(self.p))
            order = (self.t1, self.t2) if prefer_t1 else (self.t2, self.t1)
            for lst in order:
                key = self._first_evictable(lst, protected)
                if key is not None:
                    del lst[key]
                    (self.b1 if lst is self.t1 else self.b2)[key] = None
                    victims.append(key)
                    break
            else:  # pragma: no cover - evict() checked the count beforehand
                raise RuntimeError("ARC ran out of evictable keys")
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)
        while self.b1 and len(self) + len(self.b1) + len(self.b2) > 2 * c:
            self.b1.popitem(last=False)

    def bulk_load(self, keys: list[Key], reused: list[bool]) -> None:
        """Reused keys go to T2, the others to T1, each list oldest first."""
        if len(self):
            return super().bulk_load(keys, reused)
        cold = [not hot for hot in reused]
        self.t1 = OrderedDict.fromkeys(compress(keys, cold))
        self.t2 = OrderedDict.fromkeys(compress(keys, reused))

    def clear(self) -> None:
        super().clear()
        self.b1.clear()
        self.b2.clear()
        self.p = 0.0

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "t1": len(self.t1), "t2": len(self.t2),
                "b1": len(self.b1), "b2": len(self.b2), "p": self.p}
