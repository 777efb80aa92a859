"""The eviction-policy interface shared by every tier.

A policy only orders keys; it never owns bytes. The tier that owns it decides *when* to evict
(no free slot left) and asks the policy *which* keys to give up.

Invariants every policy keeps (and the tests check on random operation sequences):

* ``len(policy)`` is the number of resident keys; ghost entries (ARC's B1/B2, S3-FIFO's ghost
  queue) are metadata only and never count, never appear in ``__contains__`` or iteration.
* A pinned key (``pin`` called more often than ``unpin``) is never returned by ``evict``.
* ``evict(n, protected)`` is all-or-nothing: it returns exactly ``n`` distinct resident keys,
  none pinned and none in ``protected``, and removes them; or it returns ``None`` and leaves the
  resident set unchanged.
* Every operation is O(1) amortized in the number of resident keys (``evict`` is O(n) in the
  number of victims plus the pinned/protected entries it has to step over).

Threading: policies are not thread-safe. The owning tier calls them from its owner thread only
(vLLM's scheduler thread in a server); I/O and committer threads never touch a policy.

Batches and the suffix-before-prefix rule: ``insert_many`` and ``access_many`` take the keys
of one request in prefix order and apply them from the *last* key to the first. The prefix
chunks therefore end up more recently used than their suffixes, so when ranks would otherwise
tie, a request's tail is evicted before its head (a missing prefix chunk makes every chunk
after it useless, while a missing suffix chunk costs only itself).
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Iterable, Iterator
from typing import ClassVar, Generic, TypeVar

#: a policy's key type: bytes in the tiers (chunk hashes), anything hashable in the simulator
Key = TypeVar("Key", bound=Hashable)
log = logging.getLogger(__name__)


class EvictionPolicy(ABC, Generic[Key]):
    """Orders the resident keys of one tier and chooses eviction victims.

    ``capacity`` is the number of keys the tier can hold; policies use it to size internal
    queues and ghost lists. The policy never evicts on its own: ``insert`` may push the
    resident count above ``capacity`` if the tier asks it to, and the tier is expected to call
    ``evict`` first when it is full.
    """

    name: ClassVar[str] = "base"

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"policy capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._pins: dict[Key, int] = {}

    # -- membership -----------------------------------------------------------------------
    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Key]:
        """Resident keys, next victim first (pinned keys included, in place)."""

    def peek_victims(self, n: int) -> list[Key]:
        """About the next ``n`` victims, in order, without changing anything (write-back
        cleaning looks ahead with it). Policies override it to avoid walking every key."""
        return list(itertools.islice(iter(self), n))

    # -- mutation -------------------------------------------------------------------------
    @abstractmethod
    def insert(self, key: Key) -> None:
        """Add a key that is not resident. Raises ``KeyError`` if it already is."""

    @abstractmethod
    def access(self, key: Key) -> None:
        """Record a hit on a resident key. Unknown keys are ignored."""

    @abstractmethod
    def _discard(self, key: Key) -> bool:
        """Drop a resident key from the ordering (no ghost entry). True if it was there."""

    @abstractmethod
    def _pick_victims(self, n: int, protected: Collection[Key]) -> list[Key]:
        """Remove and return ``n`` evictable keys. Called only when ``n`` of them exist."""

    def remove(self, key: Key) -> bool:
        """Forget a resident key (deleted by the tier, not evicted). True if it was resident."""
        self._pins.pop(key, None)
        return self._discard(key)

    def evict(self, n: int, protected: Collection[Key] = ()) -> list[Key] | None:
        """Choose, remove and return ``n`` victims, or ``None`` (and change nothing)."""
        if n <= 0:
            return []
        victims = self._try_pick_victims(n, protected)
        if victims is None:
            return None
        for key in victims:
            self._pins.pop(key, None)
        return victims

    def _try_pick_victims(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        """Remove and return ``n`` evictable keys, or ``None`` with nothing changed.

        This default first looks for ``n`` evictable keys from the eviction end
        (``_scan_order``, read only) and stops at the ``n``-th, then picks them. Counting every
        pinned and protected key instead (``evictable_count``) made each eviction O(pins +
        protected), and a long prompt's promotions (each pinned, each protected for its
        request, one eviction apiece) O(chunks^2): 1.2 s of the scheduler thread for a 32k
        prompt's 2048 chunks (docs/benchmarks.md). A policy whose victims come straight off
        one end may override this with a single pass (``LruPolicy``)."""
        pins = self._pins
        found = 0
        for key in self._scan_order():
            if key not in pins and key not in protected:
                found += 1
                if found == n:
                    return self._pick_victims(n, protected)
        return None

    def _scan_order(self) -> Iterator[Key]:
        """Resident keys, next victim first, without copying them (a read-only pass that may
        stop early; nothing may change the policy meanwhile). Default: ``iter(self)``."""
        return iter(self)

    def clear(self) -> None:
        for key in list(self):
            self._discard(key)
        self._pins.clear()

    # -- pinning --------------------------------------------------------------------------
    def pin(self, key: Key) -> None:
        """Protect a resident key from eviction (counted; each pin needs one unpin)."""
        if key not in self:
            raise KeyError(f"cannot pin {key!r}: not resident")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        count = self._pins.get(key, 0)
        if count <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count - 1

    def pin_many(self, keys: Iterable[Key]) -> None:
        """``pin`` each key (a load job's keys in one call: the scheduler pins per block)."""
        pins, order = self._pins, self
        for key in keys:
            if key not in order:
                raise KeyError(f"cannot pin {key!r}: not resident")
            pins[key] = pins.get(key, 0) + 1

    def unpin_many(self, keys: Iterable[Key]) -> None:
        """``unpin`` each key."""
        pins = self._pins
        for key in keys:
            count = pins.get(key, 0)
            if count <= 1:
                pins.pop(key, None)
            else:
                pins[key] = count - 1

    def is_pinned(self, key: Key) -> bool:
        return key in self._pins

    def pin_counts(self) -> dict[Key, int]:
        """Every pinned key and its pin count (a copy): tiers whose own records count pins
        check in ``check()`` that this mirror agrees with them."""
        return dict(self._pins)

    def _blocked(self, key: Key, protected: Collection[Key]) -> bool:
        return key in self._pins or key in protected

    def evictable_count(self, protected: Collection[Key] = ()) -> int:
        """Resident keys that are neither pinned nor protected."""
        blocked = sum(1 for k in self._pins if k in self)
        blocked += sum(1 for k in set(protected) if k in self and k not in self._pins)
        return len(self) - blocked

    # -- batches (suffix-before-prefix) ----------------------------------------------------
    def insert_many(self, keys: Iterable[Key]) -> None:
        """Insert one request's keys, given in prefix order (applied last to first)."""
        for key in reversed(list(keys)):
            self.insert(key)

    def access_many(self, keys: Iterable[Key]) -> None:
        """Record hits on one request's keys, given in prefix order (applied last to first)."""
        for key in reversed(list(keys)):
            self.access(key)

    def refresh(self, key: Key) -> None:
        """Re-stamp a resident key as stored just now, without counting a hit (unknown keys are
        ignored). Lets a request stored over several batches be ordered as one batch. Policies
        without an insertion order (this default) do nothing."""

    def refresh_many(self, keys: Iterable[Key]) -> None:
        """``refresh`` one request's keys, given in prefix order (applied last to first)."""
        for key in reversed(list(keys)):
            self.refresh(key)

    def bulk_load(self, keys: list[Key], reused: list[bool]) -> None:
        """Rebuild state after a restart: ``keys`` oldest access first, ``reused[i]`` true if
        key i was hit at least once. Policies override this with a faster construction."""
        for key, hot in zip(keys, reused, strict=True):
            self.insert(key)
            if hot:
                self.access(key)

    # -- hooks ----------------------------------------------------------------------------
    def on_miss(self, key: Key) -> None:
        """A lookup missed ``key`` (lets ghost-based policies adapt before the re-insert)."""

    def stats(self) -> dict[str, float]:
        """Policy-internal numbers for inspection (queue sizes, adaptation target)."""
        return {"resident": len(self), "pinned": len(self._pins)}


def evict_or_none(policy: EvictionPolicy[Key], n: int, protected: Collection[Key] = ()
                  ) -> list[Key] | None:
    """``policy.evict`` for code running on vLLM's scheduler thread: a policy that raises (an
    out-of-tree one, a bug) is logged and treated as "no victim", which the tier counts as a
    rejection. Nothing a policy does may raise into the engine."""
    try:
        return policy.evict(n, protected)
    except Exception:
        log.exception("eviction policy %s failed; treating it as no victim", policy.name)
        return None
