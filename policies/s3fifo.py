"""S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

New keys enter the small queue S (about 10% of capacity). Most keys are never hit again, and
S lets them go quickly ("quick demotion"): at the tail of S a key that was hit at least
``promote_hits`` times moves to the main queue M, any other leaves for the ghost queue G (names
only). A key stored again while it is in G goes straight to M. M is a CLOCK-like FIFO: a key at
its tail with a non-zero hit counter is reinserted at the head with the counter decremented.
Hit counters saturate at 3. Everything is a FIFO, so each operation is O(1).

Pinned or protected keys reaching a tail are rotated to the head of their queue unchanged; a
queue whose every key is blocked is skipped until it changes, so eviction is linear in the keys
it steps over and never fails while an evictable key exists (it returns None otherwise, through
``EvictionPolicy.evict``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterator
from itertools import compress

from tiering.policies.base import EvictionPolicy, Key

_MAX_FREQ = 3


class S3FifoPolicy(EvictionPolicy[Key]):
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

    def _scan_order(self) -> Iterator[Key]:
        return itertools.chain(self.small, self.main)

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
        # Blocked (pinned or protected) keys met in a row at each tail. Once a queue's count
        # reaches its length, every key in it is blocked: it is skipped until a key enters or
        # leaves it. A step that makes progress elsewhere does not reset it, so a small queue
        # full of in-flight keys is rotated once per call, not once per main-queue step (that
        # was O(n^2) and ran out of its step budget).
        blocked = {"small": 0, "main": 0}
        budget = (len(self) + 1) * (_MAX_FREQ + 3) + 2 * n  # never reached: a safety net
        while len(victims) < n:
            small_open = bool(self.small) and blocked["small"] < len(self.small)
            main_open = bool(self.main) and blocked["main"] < len(self.main)
            budget -= 1
            if budget < 0 or not (small_open or main_open):
                break
            use_small = small_open and (len(self.small) >= self.small_target or not main_open)
            if use_small:
                outcome = self._step_small(victims, protected)
                if outcome == "blocked":
                    blocked["small"] += 1
                else:
                    blocked["small"] = 0
                    if outcome == "promoted":
                        blocked["main"] = 0  # a new key in main may be evictable
            else:
                blocked["main"] = blocked["main"] + 1 if self._step_main(
                    victims, protected) == "blocked" else 0
        if len(victims) < n:  # cannot happen (evict() counted the evictable keys): stay safe
            victims += self._any_unblocked(n - len(victims), protected)
        return victims

    def _any_unblocked(self, n: int, protected: Collection[Key]) -> list[Key]:
        """Oldest unblocked keys of S, then of M, regardless of hit counts (O(resident))."""
        out = [k for k in [*self.small, *self.main] if not self._blocked(k, protected)][:n]
        for key in out:
            self._discard(key)
        return out

    def _step_small(self, victims: list[Key], protected: Collection[Key]) -> str:
        """Process the tail of S: 'blocked' (rotated), 'promoted' (to M) or 'evicted'."""
        key, _ = self.small.popitem(last=False)
        if self._blocked(key, protected):
            self.small[key] = None
            return "blocked"
        if self.freq[key] >= self.promote_hits:
            self.freq[key] = 0
            self.main[key] = None
            return "promoted"
        del self.freq[key]
        self.ghost[key] = None
        if len(self.ghost) > self.ghost_capacity:
            self.ghost.popitem(last=False)
        victims.append(key)
        return "evicted"

    def _step_main(self, victims: list[Key], protected: Collection[Key]) -> str:
        """Process the tail of M: 'blocked' (rotated), 'decremented' or 'evicted'."""
        key, _ = self.main.popitem(last=False)
        if self._blocked(key, protected):
            self.main[key] = None
            return "blocked"
        f = self.freq[key]
        if f > 0:
            self.freq[key] = f - 1
            self.main[key] = None
            return "decremented"
        del self.freq[key]
        victims.append(key)
        return "evicted"

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
