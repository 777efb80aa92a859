"""The ``Tier`` contract every tier implements, and the typed outcomes its calls return.

Three tiers implement it: ``tiering.cpu_tier.CpuTier`` (rows of the shared staging region, filled
and drained by the GPU workers), ``tiering.backends.file_tier.FileTier`` (slots in slab files
on a filesystem) and ``tiering.backends.mooncake_tier.MooncakeTier`` (a Mooncake Store that
several engines share; its ``lookup`` may answer ``RETRY`` while it asks the master). ``tiering.chain.TierChain`` routes between them and applies every completion in
its one ``poll``.

Threads. Every method of a tier is called from one thread, its *owner*: vLLM's scheduler thread
inside a server, the main thread in tools and tests. No method blocks on I/O except ``wait_idle``
and ``close``; a tier that does I/O runs it on its own threads and hands the results back through
``poll``, and only ``poll`` changes what ``lookup`` answers.

Failures. Nothing raises into the owner on an I/O fault, a full disk or a policy that finds no
victim: a chunk that cannot be stored comes back in ``PutOutcome.rejected`` with a reason
(counted under ``rejections{reason}``), a read that fails comes back from ``poll`` as a
``Completion`` with ``ok=False`` (a miss; the tier has already dropped the key). Programming
errors (a row of the wrong size, a key of the wrong type) raise ``ValueError`` before anything
changes.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.stats import TierStats


class Lookup(enum.Enum):
    MISS = 0
    HIT = 1
    PENDING = 2  # known, not readable yet: ask again after the next poll
    # not known yet: the tier is asking a remote index in the background (a Mooncake master);
    # ask again after the next poll. The chain answers RETRY itself (vLLM keeps scanning the
    # request's chunks, so one step asks about all of them at once).
    RETRY = 3


@dataclass
class PutOutcome:
    """What a tier did with the chunks offered to ``put``."""

    admitted: list[bytes] = field(default_factory=list)  # being stored, in offer order
    rejected: dict[bytes, str] = field(default_factory=dict)  # key -> reason (REJECT_REASONS)
    evicted: list[bytes] = field(default_factory=list)  # keys it evicted to make room


@dataclass
class Completion:
    """A finished background store or read, returned by ``poll``."""

    kind: str  # "store" | "read"
    key: bytes
    ok: bool
    reason: str = ""  # why not ok: "error", "full", "checksum", "short_read", "corrupt", ...
    nbytes: int = 0
    seconds: float = 0.0  # submit to completion
    token: Any = None  # the caller's token of a read


class Tier(ABC):
    """A bounded store of fixed-size rows keyed by chunk hash.

    Each tier owns its keys' state, its eviction policy and admission rule, and its counters
    (``stats``): nobody else counts on its behalf.
    """

    #: "cpu", "file" or "mooncake"
    medium: str
    row_bytes: int
    stats: TierStats

    @abstractmethod
    def lookup(self, key: bytes, count: bool = True) -> Lookup:
        """Is ``key`` readable here? ``count=False`` for vLLM's repeated asks about a chunk it
        already asked about in this request: neither the counters nor the policy's miss hook
        see those again."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """``lookup`` without counting or touching the policy (tools, tests, routing)."""

    @abstractmethod
    def put(self, keys: Sequence[bytes], rows: Sequence[memoryview] | None) -> PutOutcome:
        """Offer chunks for storing; admission and eviction happen here, the write in the
        background (``poll`` reports each admitted key's ``store`` completion). The caller keeps
        each admitted row's memory unchanged until then."""

    @abstractmethod
    def get(self, items: Sequence[tuple[bytes, memoryview, Any]]) -> list[bool]:
        """Start reading ready keys into buffers; one bool per item (False: a miss now). Each
        started read ends with a ``read`` completion carrying the item's token."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a use of resident keys (recency for the policy)."""

    @abstractmethod
    def poll(self, wait: float = 0.0) -> list[Completion]:
        """Apply finished background work to the tier's state and return it. ``wait`` > 0
        blocks up to that long for the first completion (tools and tests only)."""

    @abstractmethod
    def evict(self, n: int) -> list[bytes]:
        """Evict up to ``n`` unpinned keys by policy; returns them."""

    @abstractmethod
    def usage(self) -> tuple[int, int, int]:
        """(used bytes, capacity bytes, entries)."""

    @abstractmethod
    def has_pending_work(self) -> bool:
        """True while stores or reads are in flight."""

    @abstractmethod
    def close(self) -> None:
        """Finish or abandon in-flight work safely and release every resource. Idempotent."""

    @property
    def policy_name(self) -> str:
        return getattr(self, "policy_spec", "")

    @property
    def engine_name(self) -> str:
        return ""
