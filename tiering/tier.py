"""The two tier contracts, and the typed outcomes their calls return.

A tier is one of two kinds, and the chain (``tiering.chain.TierChain``) treats them differently:

* a **row tier** (``RowTier``) is tier 0, the rows of the shared staging region
  (``tiering.cpu_tier.CpuTier``). It holds no bytes of its own making: vLLM's GPU jobs fill and
  drain its rows, and store tiers read and write them in place. Its calls *reserve* rows and
  *finish* what others did with them: ``reserve_store``/``finish_store`` around a GPU store
  job, ``reserve_promotion``/``finish_promotion`` around a store tier's read,
  ``prepare_load``/``complete_load`` around a GPU load job.
* a **store tier** (``StoreTier``) is a tier below it that keeps copies of rows on a medium of
  its own (``tiering.backends.file_tier.FileTier``: slots in slab files; the Mooncake Store
  tier, ``tiering.backends.mooncake_tier.MooncakeTier``, a store that several engines share;
  its ``lookup`` may answer ``RETRY`` while it asks the master). Its calls *copy* bytes in the
  background: ``put`` rows in, ``get`` them back into
  rows, and ``poll`` the completions. Every store tier passes the same contract tests
  (``tests/store_tier_contract.py``).

Both kinds share this module's outcomes (``Lookup``, ``PutOutcome``, ``Completion``), their
counters (``tiering.stats.TierStats``, each tier counting its own) and ``Tier.count_lookup``,
the one place a lookup is counted.

Threads. Every method of a tier is called from one thread, its *owner*: vLLM's scheduler thread
inside a server, the main thread in tools and tests. No method blocks on I/O except a store
tier's ``wait_idle`` and ``close``; a store tier runs its I/O on its own threads and hands the
results back through ``poll``, and only ``poll`` (and the owner's own calls) change what
``lookup`` answers.

Failures. Nothing raises into the owner on an I/O fault, a full medium or a policy that finds
no victim: a chunk that cannot be stored comes back in ``PutOutcome.rejected`` with a reason
(counted under ``rejections{reason}``), or as ``None`` from a row tier's ``reserve_*``; a read
that fails comes back from ``poll`` as a ``Completion`` with ``ok=False`` (a miss; the tier has
already dropped the key). Programming errors (a row of the wrong size, a key of the wrong type)
raise ``ValueError`` before anything changes; a state machine asked for a move its life cycle
does not have raises (a bug, never a fault).
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiering.stats import TierStats

if TYPE_CHECKING:
    from tiering.backends.staging import StagingRegion
    from tiering.policies import EvictionPolicy


class IllegalTransition(RuntimeError):
    """A record (a CPU row, a disk slot) was asked to move between states that its life cycle
    does not connect: a bug in the tier, never an I/O fault."""


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
    """What a tier did with the chunks offered to it (``StoreTier.put``,
    ``RowTier.reserve_store``)."""

    admitted: list[bytes] = field(default_factory=list)  # being stored, in offer order
    rejected: dict[bytes, str] = field(default_factory=dict)  # key -> reason (REJECT_REASONS)
    evicted: list[bytes] = field(default_factory=list)  # keys it evicted to make room


@dataclass
class Completion:
    """A finished background store or read of a store tier, returned by ``poll``."""

    kind: str  # "store" | "read"
    key: bytes
    ok: bool
    reason: str = ""  # why not ok: "error", "full", "checksum", "short_read", "corrupt", ...
    nbytes: int = 0
    seconds: float = 0.0  # submit to completion
    token: Any = None  # the caller's token of a read


class Tier(ABC):
    """What every tier has: fixed-size rows keyed by chunk hash, its own counters, lookups.

    Each tier owns its keys' state, its eviction policy and admission rule, and its counters
    (``stats``); the chain and a request's scan add only what they decide about the tier
    (``promotions_declined``, ``disk_runs_*``, ``writeback_misses``, ``demotions_deferred``). Readers of every tier (vLLM's metrics, the
    exporter) use only what this class declares.
    """

    #: what the tier keeps rows in: "cpu" (the staging region), "file" (a file tier) or
    #: "mooncake" (the shared store); the same word as the config's ``medium``. Its metrics
    #: label is its tier id's (``chain.tier_label``: "cpu", "disk", "disk2", …, "mooncake").
    medium: str
    row_bytes: int
    stats: TierStats
    #: the tier's eviction order; None for a tier whose medium evicts on its own
    policy: EvictionPolicy[bytes] | None = None

    def count_lookup(self, key: bytes, hit: bool) -> None:
        """Count one lookup of ``key`` (the first ask of a request: repeated asks pass
        ``count=False`` to ``lookup`` and never get here). A miss also reaches the policy's
        miss hook, so ghost-based policies adapt once per request and chunk."""
        if hit:
            self.stats.lookup(True, self.row_bytes)
            return
        self.stats.lookup(False)
        if self.policy is not None:
            self.policy.on_miss(key)

    @abstractmethod
    def lookup(self, key: bytes, count: bool = True) -> Lookup:
        """Is ``key`` readable here?

        Args:
            key: the chunk's key.
            count: False for vLLM's repeated asks about a chunk the same request already
                asked about: neither the counters nor the policy's miss hook see those again
                (``count_lookup`` does the counting).

        Returns:
            HIT if readable now, PENDING if known but not readable yet (being written or
            filled: ask again after the next poll), MISS otherwise. Never blocks, never raises.
        """

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """``lookup`` without counting or touching the policy (tools, tests, routing)."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a use of resident keys, one request's chunks in prefix order (recency for
        the policy); unknown keys are ignored."""

    @abstractmethod
    def usage(self) -> tuple[int, int, int]:
        """(used bytes, capacity bytes, entries)."""

    @abstractmethod
    def close(self) -> None:
        """Finish or abandon in-flight work safely and release every resource. Idempotent;
        may block (shutdown only)."""

    @property
    def policy_name(self) -> str:
        return getattr(self, "policy_spec", "")

    @property
    def io_name(self) -> str:
        return ""


class RowTier(Tier):
    """Tier 0: rows of the staging region (``region``) that GPU jobs and store tiers fill.

    A row is reserved for a key before anyone writes it and stays pinned while a GPU job or a
    store tier's I/O uses it; a pinned row is never evicted or reused. The row tier only keeps
    the books: it never copies a row itself, so none of its methods blocks or does I/O, and
    there is nothing to poll. Every method is called on the owner thread.

    Failures: a reservation that finds no row (every candidate pinned or protected, or the
    admission threshold not reached) returns ``None`` or a rejection reason and changes
    nothing; a job that failed is reported with ``ok=False`` and its key is dropped (a miss).
    """

    region: StagingRegion
    num_rows: int

    @abstractmethod
    def lookup(self, key: bytes, count: bool = True, per_request: bool = False) -> Lookup:
        """As ``Tier.lookup``. ``per_request``: the caller counts once per request (the
        request that promoted a row counted its store-tier hit when it found it), so a
        promoted row's first hit counts like any other."""

    # -- stores: a GPU job fills reserved rows --------------------------------------------
    @abstractmethod
    def reserve_store(self, keys: Sequence[bytes]) -> PutOutcome:
        """Reserve and pin a row for each key a GPU store job will write.

        Keys already here and keys under the admission threshold are skipped (threshold:
        in ``rejected``). All or none: if rows for every admitted key cannot be found, none is
        reserved and all are rejected with the reason (``full``/``pinned``). Evicts by policy
        (never a pinned row, never one of ``keys``); the victims are in ``evicted``.
        """

    @abstractmethod
    def finish_store(self, keys: Iterable[bytes], ok: bool = True) -> list[bytes]:
        """The GPU store job for these keys ended: unpin; on success the rows become
        readable, on failure their keys are dropped. Returns the keys now readable (keys
        dropped meanwhile and duplicate completions are ignored)."""

    # -- promotions: a store tier fills a reserved row ------------------------------------
    @abstractmethod
    def reserve_promotion(self, key: bytes, source: str, protected: Collection[bytes] = ()
                          ) -> tuple[int, list[bytes]] | None:
        """A row for ``key`` that the store tier labelled ``source`` will fill, pinned for
        that I/O: (row index, keys evicted for it, never one of ``protected``), or None when
        no row can be had now (counted as a rejection)."""

    @abstractmethod
    def finish_promotion(self, key: bytes, index: int, ok: bool) -> bool:
        """The read into row ``index`` ended (from ``poll`` of the store tier); releases
        its I/O pin. True if ``key`` is now readable there; a failed read drops the key."""

    # -- loads: a GPU job copies rows out --------------------------------------------------
    @abstractmethod
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the rows of readable keys for a GPU load job; returns their indexes."""

    @abstractmethod
    def complete_load(self, keys: Iterable[bytes]) -> None:
        """The GPU load job ended: unpin its rows."""

    # -- rows, pins and eviction order (for the chain's demotions) ------------------------
    @abstractmethod
    def row_of(self, key: bytes) -> int:
        """The row index of a resident key (KeyError if absent)."""

    @abstractmethod
    def view(self, key: bytes) -> memoryview:
        """The bytes of a resident key's row, in the shared region (no copy)."""

    @abstractmethod
    def pin(self, key: bytes, io: bool = False) -> None:
        """Pin a resident key's row (``io``: for a store tier's read of it)."""

    @abstractmethod
    def unpin_row(self, index: int, io: bool = False) -> None:
        """Release one pin of a row, by index (its key may have been dropped meanwhile)."""

    @abstractmethod
    def next_victims(self, n: int) -> list[bytes]:
        """About the next ``n`` keys the policy would evict (pinned ones included)."""

    @abstractmethod
    def free_count(self) -> int:
        """Rows free now (no key)."""

    @abstractmethod
    def reset(self) -> list[bytes]:
        """Drop every key (vLLM forgot its jobs): their GPU pins go, I/O pins stay until
        that I/O ends. Returns the keys dropped."""

    @abstractmethod
    def check(self) -> None:
        """Assert the row table's consistency (tests call it after every step)."""


def check_put(keys: Sequence[bytes], rows: Sequence[memoryview] | None, row_bytes: int,
              check_key: Callable[[bytes], None]) -> Sequence[memoryview]:
    """A store tier's ``put`` arguments, all checked before anything changes: one row of
    ``row_bytes`` per key, each key valid (``check_key`` raises ``ValueError`` naming it).
    Returns ``rows``; ``ValueError`` naming the key and what was expected otherwise."""
    if rows is None or len(keys) != len(rows):
        raise ValueError(f"put: {len(keys)} keys but {'no' if rows is None else len(rows)} rows")
    for key, row in zip(keys, rows, strict=True):
        check_key(key)
        if len(row) != row_bytes:
            raise ValueError(f"put: row for key {key.hex()} has {len(row)} bytes, "
                             f"expected row_bytes={row_bytes}")
    return rows


class StoreTier(Tier):
    """A tier below the row tier that keeps its own copy of rows (disk slots, a remote store).

    Bytes move in the background: ``put`` and ``get`` only decide and queue; the tier's own
    threads (or its client library's) do the I/O and leave their results for ``poll``, which
    applies them on the owner thread. Only the owner thread calls these methods, and none of
    them blocks except ``wait_idle`` and ``close``.

    Keys: a key is *writing* from its admission by ``put`` until ``poll`` reports its
    ``store`` completion (pinned; ``lookup`` says PENDING), then *readable* until evicted,
    dropped or found bad. A key being read is pinned until its ``read`` completion: it is never
    evicted or dropped under a read.

    Failures: a failed write is a ``store`` completion with ``ok=False`` and leaves no trace of
    the key (counted ``rejections{reason}``); a read that fails, comes back short or fails its
    checksum is a ``read`` completion with ``ok=False`` and a reason, and the key is dropped
    (counted) before the completion is returned: a miss, never wrong bytes, never an exception.
    """

    #: when the chain offers rows: "on_store" (write-through) or "on_evict" (write-back)
    demote: str

    # -- writes ---------------------------------------------------------------------------
    @abstractmethod
    def put(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> PutOutcome:
        """Offer rows for storing; admission and eviction happen here, the write in the
        background.

        Args:
            keys: one request's chunks in prefix order (the policy orders them so).
            rows: one buffer of ``row_bytes`` per key. The caller keeps each admitted row's
                memory unchanged until ``poll`` reports that key's ``store`` completion.

        Returns:
            The admitted keys (each ends with one ``store`` completion), the rejected ones
            with their reason, and the keys evicted for room. Keys already held are skipped.

        Raises:
            ValueError: a key or row of the wrong size or type, before anything changes.
        """

    # -- reads ----------------------------------------------------------------------------
    @abstractmethod
    def get(self, items: Sequence[tuple[bytes, memoryview, Any]]) -> list[bool]:
        """Start reading readable keys into buffers.

        Args:
            items: (key, buffer of ``row_bytes``, the caller's token) per read.

        Returns:
            One bool per item: True if its read started (it ends with one ``read``
            completion carrying the token), False for a miss now (counted as a failed
            promotion: the key went since the caller's lookup).
        """

    @abstractmethod
    def poll(self, wait: float = 0.0) -> list[Completion]:
        """Apply finished background work to the tier's state and return it, in the order it
        finished. ``wait`` > 0 blocks up to that long for the first completion (tools and
        tests only; the scheduler always polls with 0)."""

    @abstractmethod
    def has_pending_work(self) -> bool:
        """True while writes or reads are in flight (their completions still due)."""

    def wait_idle(self, timeout: float = 30.0) -> list[Completion]:
        """Block until every admitted write and started read has completed; returns their
        completions (tests, tools, shutdown). Raises ``TimeoutError`` past ``timeout``."""
        deadline = time.monotonic() + timeout
        done = self.poll()
        while self.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.medium} tier: I/O still in flight after {timeout}s")
            done += self.poll(wait=0.05)
        return done

    # -- removal --------------------------------------------------------------------------
    @abstractmethod
    def drop(self, keys: Sequence[bytes]) -> int:
        """Remove readable keys that no read uses (others are skipped); returns how many.
        The listener of ``on_removed`` hears of them."""

    @abstractmethod
    def evict(self, n: int) -> list[bytes]:
        """Evict up to ``n`` unpinned keys by policy (counted); returns them."""

    @abstractmethod
    def on_removed(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """Call ``listener(keys)`` on the owner thread whenever stored keys leave the tier
        (evicted by ``put``/``evict``, dropped after a bad read or by ``drop``), e.g. for
        KV events. ``None`` removes it."""

    # -- consistency ----------------------------------------------------------------------
    @abstractmethod
    def check(self) -> None:
        """Assert that the tier's books agree with themselves (every known key in one legal
        state, pins and in-flight counts consistent); tests call it after every scenario,
        faults included. O(entries): never on the scheduler's path."""

    # -- the promotion advisor's measurements across restarts ----------------------------
    def calibration_keys(self, limit: int) -> list[bytes]:
        """Up to ``limit`` readable keys the tier held when the chain was built (rows an
        earlier engine wrote), for a calibration read of its rate before the first request
        is decided. Called once, on the owner thread, at engine start. Default: a tier that
        cannot list its keys (the first disk hits are then decided unmeasured)."""
        return []

    def load_advisor_state(self) -> dict[str, Any] | None:
        """What ``save_advisor_state`` kept at the last engine's shutdown, or None (nothing
        kept, or not readable as ours: logged). Called once, when the chain is built, before
        serving; may block on the tier's storage. Default: a tier that keeps nothing."""
        return None

    def offer_advisor_state(self, state: dict[str, Any]) -> None:
        """Keep ``state`` for the next engine soon, without blocking: called on the scheduler
        thread (``ADVISOR_OFFER_EVERY_S``), the tier writes the latest one from its own
        thread (vLLM's server stops its engine core without a shutdown call on SIGTERM).
        Default: a tier that keeps nothing."""

    def save_advisor_state(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (JSON values) for the next engine; called at shutdown, before
        ``close``, never on the scheduler's path. A failure is logged, never raised."""
