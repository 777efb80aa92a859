"""OwedRows: CPU-tier rows whose write down to a file tier is still due.

Owned by the ``TierChain`` (scheduler thread only). Two reasons a row is owed: a write-back tier
(``demote: on_evict``) gets a row only when it nears eviction; a write-through tier gets it at
once unless the demotion budget is spent (the disk is behind the stores), and then as soon as
the budget allows, oldest first (``behind``). A row evicted while owed never reaches that tier
(the chain counts it as ``writeback_misses``).
"""

from __future__ import annotations

from collections.abc import Collection


class OwedRows:
    """Keys owed to file tiers (by chain index), and the write-through ones in age order."""

    def __init__(self) -> None:
        self.tiers: dict[bytes, list[int]] = {}  # READY key -> chain indexes of tiers owed it
        self.behind: dict[bytes, None] = {}  # keys owed to a write-through tier, oldest first

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def add(self, key: bytes, tier: int, eager: bool) -> None:
        owed = self.tiers.setdefault(key, [])
        if tier not in owed:
            owed.append(tier)
        if eager:
            self.behind[key] = None

    def take(self, key: bytes, only: Collection[int] | None = None) -> list[int]:
        """Remove and return the tiers ``key`` is owed to (those in ``only``, if given)."""
        owed = self.tiers.get(key)
        if not owed:
            return []
        taken = owed if only is None else [i for i in owed if i in only]
        rest = [] if only is None else [i for i in owed if i not in only]
        if rest:
            self.tiers[key] = rest
        else:
            del self.tiers[key]
        # ``behind`` lists keys owed to a write-through tier; callers take all of those at once
        # (``only`` is None or every write-through tier), so none is left behind for this key
        self.behind.pop(key, None)
        return taken

    def oldest_behind(self, n: int) -> list[bytes]:
        out: list[bytes] = []
        for k in self.behind:
            if len(out) >= n:
                break
            out.append(k)
        return out
