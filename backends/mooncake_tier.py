"""MooncakeTier: a tier in Mooncake Store, shared by every engine connected to the same master.

A chunk one engine stores is a hit for every other engine of the same namespace (the same
model, dtype, layout, chunk size and format: ``backends/mooncake_value.py`` names and checks the
values). The master decides where values live (the segments the clients lend) and evicts them
itself; this tier keeps no index of its own, only what the master recently said exists.

Threading contract (the one every tier keeps, ``tiering/tier.py``): every public method is
called from one thread, the owner (vLLM's scheduler thread), and none of them waits for
Mooncake: the calls run on the client's threads (``backends/mooncake_io.py``) and their results
are applied in ``poll``. ``wait_idle`` and ``close`` are the only blocking calls.

Lookups. A chunk the master was not asked about yet answers ``Lookup.RETRY`` and queues one
exists query (all queued ones go out in one batch call); vLLM keeps scanning the request and
asks again next step, when the answer is known: HIT (trusted ``MOONCAKE_PRESENT_TTL_S``) or MISS
(trusted ``MOONCAKE_ABSENT_TTL_S``). Only HIT and MISS are counted.

Link state, a record with asserted transitions:

    CONNECTING --(set up)--> UP --(a call finds the master gone, or overruns)--> DOWN
                                 <--(a probe or any call succeeds again)--------/

While not UP, lookups are misses and stores are rejected (``rejections{reason="error"}``),
each counted under ``remote_errors{reason="unavailable"}``, with one log line per change of
state; a probe every ``MOONCAKE_PROBE_S`` notices the master's return (the Mooncake client
re-mounts its segment on a restarted master by itself).

Failure rules: a store that fails is a rejection with its reason (full, error); a read that
fails (gone, transfer, checksum, header, short, unavailable, timeout) is a ``read`` completion
with ``ok=False`` — a miss, the key forgotten — never wrong KV. Nothing raises into the owner on
a Mooncake fault. Rows handed to ``put``/``get`` stay in use until their completion, which comes
only when Mooncake's call has returned (it may still be writing into the row before that).
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from tiering.backends.mooncake_config import MooncakeTierConfig, check_row
from tiering.backends.mooncake_io import (
    Batch,
    BatchDone,
    InFlight,
    Item,
    Kind,
    LinkUp,
    MooncakeClient,
)
from tiering.backends.mooncake_value import META_NAME, ValueCodec, namespace_prefix, object_name
from tiering.backends.namespace import NamespaceFacts
from tiering.policies import StoreThreshold
from tiering.settings import (
    MOONCAKE_ABSENT_TTL_S,
    MOONCAKE_LOG_EVERY_S,
    MOONCAKE_OVERRUN_FACTOR,
    MOONCAKE_PRESENT_MAX,
    MOONCAKE_PRESENT_TTL_S,
    MOONCAKE_PROBE_S,
)
from tiering.stats import TierStats
from tiering.tier import Completion, Lookup, PutOutcome, StoreTier, check_put

log = logging.getLogger(__name__)
MAX_KEY_BYTES = 256


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"


_LINK_MOVES = {LinkState.CONNECTING: {LinkState.UP},
               LinkState.UP: {LinkState.DOWN},
               LinkState.DOWN: {LinkState.UP}}


class IllegalLinkTransition(AssertionError):
    pass


class Link:
    """The tier's view of its connection to the master (owner thread only)."""

    def __init__(self) -> None:
        self.state = LinkState.CONNECTING
        self.since = time.monotonic()
        self.next_probe = 0.0
        self.probing = False

    def move(self, to: LinkState) -> None:
        if to not in _LINK_MOVES[self.state]:
            raise IllegalLinkTransition(f"mooncake link: {self.state.value} -> {to.value}")
        self.state, self.since = to, time.monotonic()

    @property
    def up(self) -> bool:
        return self.state is LinkState.UP


class MooncakeTier(StoreTier):
    """A store tier over a Mooncake Store that several engines share (``StoreTier``'s contract).

    Owner thread only, like every tier; no method blocks on the network: every Mooncake call
    (exists, put, get) runs on the client's threads (``mooncake_io``), bounded by
    ``timeout_s``, and its result is applied by ``poll``. ``lookup`` answers from what the
    master last said (HIT while fresh), RETRY while the master is being asked, MISS when it said
    absent or the link is down. Faults (master down, a peer gone with its segment, a timeout, a
    full store, a value whose header or checksum is wrong) are misses or rejections counted
    under ``remote_errors{reason}`` with one log line per reason and interval; the connector
    thread reconnects when the master comes back. The master evicts (its own watermarks):
    ``evict`` evicts nothing."""

    medium = "mooncake"
    policy_spec = "mooncake"  # the master evicts (its watermarks), not a policy of ours
    _removed_listener: Callable[[list[bytes]], None] | None = None

    def __init__(self, cfg: MooncakeTierConfig | dict[str, Any], facts: NamespaceFacts,
                 info: dict[str, Any] | None = None) -> None:
        cfg = MooncakeTierConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
        check_row(cfg, facts.row_bytes)  # before any thread starts
        self.cfg, self.facts = cfg, facts
        self.row_bytes = facts.row_bytes
        self.namespace_id = facts.namespace_id
        self.codec = ValueCodec(self.namespace_id, self.row_bytes)
        self.admission = StoreThreshold(cfg.store_threshold, cfg.tracker_size)
        self.stats = TierStats()
        self.link = Link()
        # what the master said (monotonic time of the answer), and what is being asked/written
        self._present: OrderedDict[bytes, float] = OrderedDict()
        self._absent: dict[bytes, float] = {}
        self._asking: set[bytes] = set()
        self._writing: set[bytes] = set()
        self._inflight = InFlight()
        self._logged: dict[str, float] = {}  # fault reason -> when it was last logged
        self._overrun_s = cfg.timeout_s * MOONCAKE_OVERRUN_FACTOR + 1.0
        self._results: queue.SimpleQueue[BatchDone | LinkUp] = queue.SimpleQueue()
        meta = {"namespace": self.namespace_id, **facts.identity(), **(info or {})}
        self.client = MooncakeClient(cfg, self.codec, meta, self._results)
        self.closed = False
        log.info("mooncake tier: namespace %s, master %s, metadata %s, %s, lending %d bytes",
                 self.namespace_id, cfg.master, cfg.metadata, cfg.protocol, cfg.segment_bytes)

    @property
    def demote(self) -> str:  # type: ignore[override]
        return self.cfg.demote

    def check(self) -> None:
        """Assert the tier's books agree: every key being asked about or written has its batch
        in flight, and no key is both known present and known absent."""
        kinds: dict[bytes, set[Kind]] = {}
        for b in self._inflight.batches.values():
            for item in b.items:
                kinds.setdefault(item.key, set()).add(b.kind)
        for k in self._asking:
            assert Kind.EXISTS in kinds.get(k, ()), ("asking without a batch", k.hex())
        for k in self._writing:
            assert Kind.STORE in kinds.get(k, ()), ("writing without a batch", k.hex())
        assert not (set(self._present) & set(self._absent)), "a key present and absent"

    # -- queries (owner thread) ---------------------------------------------------------------
    def on_removed(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """Call ``listener(keys)`` when keys this tier reported leave it (a failed read, drop)."""
        self._removed_listener = listener

    def _fresh(self, key: bytes, now: float) -> bool:
        t = self._present.get(key)
        if t is None:
            return False
        if now - t < MOONCAKE_PRESENT_TTL_S:
            return True
        del self._present[key]
        return False

    def contains(self, key: bytes) -> bool:
        return self._fresh(key, time.monotonic())

    def lookup(self, key: bytes, count: bool = True) -> Lookup:
        now = time.monotonic()
        if self._fresh(key, now):
            if count:
                self.stats.lookup(True, self.row_bytes)
            return Lookup.HIT
        if key in self._writing:
            return Lookup.PENDING
        if not self.link.up:
            if count:
                self.stats.lookup(False)
                self.stats.add("remote_errors:unavailable")
            return Lookup.MISS
        t = self._absent.get(key)
        if t is not None and now - t < MOONCAKE_ABSENT_TTL_S:
            if count:
                self.stats.lookup(False)
            return Lookup.MISS
        if key not in self._asking:
            self._check_key(key)
            self._asking.add(key)
            self._submit(Batch(Kind.EXISTS, [Item(key, object_name(self.namespace_id, key))]))
        return Lookup.RETRY

    def __len__(self) -> int:
        return len(self._present)

    def usage(self) -> tuple[int, int, int]:
        """(bytes of the chunks the master recently said exist, bytes this engine lends, their
        number). The store's total is the master's (``tiering inspect mooncake://...``)."""
        n = len(self._present)
        return n * self.row_bytes, self.cfg.segment_bytes, n

    @property
    def io_name(self) -> str:
        return f"mooncake-{self.cfg.protocol}"

    def has_pending_work(self) -> bool:
        return bool(self._inflight.batches)

    # -- stores (owner thread) --------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], rows: Sequence[memoryview] | None) -> PutOutcome:
        """Offer rows for storing; the admitted ones are written in the background. The caller
        keeps each admitted row unchanged until ``poll`` reports its ``store`` completion."""
        rows = check_put(keys, rows, self.row_bytes, self._check_key)
        out = PutOutcome()
        now = time.monotonic()
        items: list[Item] = []
        for key, row in zip(keys, rows, strict=True):
            if key in self._writing or self._fresh(key, now):
                continue  # stored already (here or by another engine)
            if not self.admission.offer(key):
                out.rejected[key] = "threshold"
                continue
            if not self.link.up:
                out.rejected[key] = "error"
                continue
            self._writing.add(key)
            items.append(Item(key, object_name(self.namespace_id, key), row))
            out.admitted.append(key)
        reasons = list(out.rejected.values())
        if reasons:
            self.stats.reject("threshold", reasons.count("threshold"))
            self.stats.reject("error", reasons.count("error"))
            self.stats.add("remote_errors:unavailable", reasons.count("error"))
        self._submit_rows(Kind.STORE, items)
        return out

    def _submit_rows(self, kind: Kind, items: list[Item]) -> None:
        n = self.cfg.batch_rows
        for i in range(0, len(items), n):
            self._submit(Batch(kind, items[i:i + n]))

    def _submit(self, batch: Batch) -> None:
        self.client.submit(self._inflight.add(batch))

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")

    # -- reads (owner thread) -------------------------------------------------------------------
    def get(self, items: Sequence[tuple[bytes, memoryview, Any]]) -> list[bool]:
        """Start reading keys the master said exist into their buffers; one bool per item
        (False: a miss now, counted as a failed promotion). Each started read ends with a
        ``read`` completion carrying the item's token."""
        now, answers, started = time.monotonic(), [], []
        for key, buf, token in items:
            if not self.link.up or not self._fresh(key, now):
                self.stats.add("promotion_failures")
                answers.append(False)
                continue
            if len(buf) != self.row_bytes:
                raise ValueError(f"get: buffer for key {key.hex()} has {len(buf)} bytes, "
                                 f"expected row_bytes={self.row_bytes}")
            started.append(Item(key, object_name(self.namespace_id, key), buf, token))
            answers.append(True)
        self._submit_rows(Kind.READ, started)
        return answers

    def touch(self, keys: Sequence[bytes]) -> None:
        """Nothing to record: the master keeps recency (a read renews a value's lease)."""

    # -- completions (owner thread) -------------------------------------------------------------
    def poll(self, wait: float = 0.0) -> list[Completion]:
        """Apply finished Mooncake calls; returns the stores and reads that finished. ``wait`` >
        0 blocks up to that long for the first result (tools and tests)."""
        done: list[Completion] = []
        block = wait > 0 and self.has_pending_work()
        while True:
            try:
                r = self._results.get(timeout=wait) if block else self._results.get_nowait()
            except queue.Empty:
                break
            block = False
            if isinstance(r, LinkUp):
                self._link_report(r)
                continue
            self._inflight.done(r.batch)
            self._link_seen(r)
            kind = r.batch.kind
            if kind is Kind.EXISTS:
                self._finish_exists(r)
            elif kind is Kind.STORE:
                done.extend(self._finish_stores(r))
            elif kind is Kind.READ:
                done.extend(self._finish_reads(r))
        self._watchdog()
        return done

    def _link_report(self, r: LinkUp) -> None:
        if r.ok:
            self.link.move(LinkState.UP)
            log.info("mooncake tier: connected to master %s as %s", self.cfg.master,
                     self.client.hostname)
        else:
            log.warning("mooncake tier: cannot connect to master %s (%s); chunks are misses "
                        "until it answers (retrying)", self.cfg.master, r.error)

    def _link_seen(self, r: BatchDone) -> None:
        """A batch's outcome says whether the master answers."""
        if r.batch.kind is Kind.EXISTS and r.batch.items and r.batch.items[0].key == b"":
            self.link.probing = False
        if r.fault == "not_set_up":
            return
        if r.fault and self.link.up:
            self._link_down()
            log.warning("mooncake tier: master %s did not answer (%s); chunks are misses until "
                        "it does", self.cfg.master, r.detail or r.fault)
        elif not r.fault and self.link.state is LinkState.DOWN and not r.batch.overran:
            self.link.move(LinkState.UP)
            log.warning("mooncake tier: master %s answers again", self.cfg.master)

    def _link_down(self) -> None:
        """The master stopped answering. What it said before is forgotten: a master that comes
        back may be a new one that lost every value (asking again costs one RPC a chunk)."""
        self.link.move(LinkState.DOWN)
        self.link.next_probe = time.monotonic() + MOONCAKE_PROBE_S
        forgotten = list(self._present)
        self._present.clear()
        self._absent.clear()
        if forgotten and self._removed_listener is not None:
            self._removed_listener(forgotten)

    def _watchdog(self) -> None:
        """Calls that overran: counted, logged once, the link marked down (no new work starts
        until a probe succeeds). Their completions still come when the calls return."""
        late = self._inflight.overrun(self._overrun_s)
        for b in late:
            self.stats.add("remote_errors:timeout", len(b.items))
        if late:
            self._log_fault("timeout", f"{len(late)} Mooncake call(s) running for more than "
                            f"{self._overrun_s:.0f}s")
            if self.link.up:
                self._link_down()
                # a line per change of the link, as a failed call gives (the fault line above
                # is rate-limited: a second overrun within MOONCAKE_LOG_EVERY_S said nothing)
                log.warning("mooncake tier: master %s did not answer (%d call(s) running for "
                            "more than %.1f s); chunks are misses until it does",
                            self.cfg.master, len(late), self._overrun_s)
        if (self.link.state is LinkState.DOWN and not self.link.probing
                and time.monotonic() >= self.link.next_probe):
            self.link.probing = True
            self.link.next_probe = time.monotonic() + MOONCAKE_PROBE_S
            probe = namespace_prefix(self.namespace_id) + META_NAME
            # not in flight as work: a probe is no reason for vLLM to keep stepping
            self.client.submit(Batch(Kind.EXISTS, [Item(b"", probe)], id=-1))

    def _log_fault(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(reason, -MOONCAKE_LOG_EVERY_S) >= MOONCAKE_LOG_EVERY_S:
            self._logged[reason] = now
            log.warning("mooncake tier: %s (%s); counted under remote_errors{reason=%r}, served "
                        "as misses", detail, self.cfg.master, reason)

    def _finish_exists(self, r: BatchDone) -> None:
        now = time.monotonic()
        for it, reason in zip(r.batch.items, r.reasons, strict=True):
            if not it.key:
                continue  # the probe
            self._asking.discard(it.key)
            if not reason:
                self._remember(it.key, now)
            elif reason == "gone":
                self._absent[it.key] = now
        if len(self._absent) > MOONCAKE_PRESENT_MAX // 16:
            self._absent = {k: t for k, t in self._absent.items()
                            if now - t < MOONCAKE_ABSENT_TTL_S}

    def _remember(self, key: bytes, now: float) -> None:
        self._present[key] = now
        self._present.move_to_end(key)
        self._absent.pop(key, None)
        while len(self._present) > MOONCAKE_PRESENT_MAX:
            self._present.popitem(last=False)

    def _finish_stores(self, r: BatchDone) -> list[Completion]:
        out, now, ok = [], time.monotonic(), 0
        for it, reason in zip(r.batch.items, r.reasons, strict=True):
            self._writing.discard(it.key)
            if not reason:
                self._remember(it.key, now)
                ok += 1
            else:
                self.stats.reject("full" if reason == "full" else "error")
                self.stats.add(f"remote_errors:{reason if reason != 'gone' else 'transfer'}")
                self.stats.add("io_errors")
                self._log_fault(reason, f"storing failed: {r.detail or reason}")
            out.append(Completion("store", it.key, not reason, reason,
                                  self.row_bytes if not reason else 0, r.seconds))
        self.stats.add("stores", ok)
        self.stats.add("store_bytes", ok * self.row_bytes)
        return out

    def _finish_reads(self, r: BatchDone) -> list[Completion]:
        out, ok, gone = [], 0, []
        for it, reason in zip(r.batch.items, r.reasons, strict=True):
            if not reason:
                ok += 1
            else:
                self.stats.add("promotion_failures")
                self.stats.add(f"remote_errors:{reason}")
                if reason == "checksum":
                    self.stats.add("checksum_failures")
                if reason != "gone":
                    self.stats.add("io_errors")
                    self._log_fault(reason, f"a read failed: {r.detail or reason}")
                if self._present.pop(it.key, None) is not None:
                    gone.append(it.key)
            out.append(Completion("read", it.key, not reason, reason,
                                  self.row_bytes if not reason else 0, r.seconds, it.token))
        self.stats.add("promotions", ok)
        self.stats.add("promotion_bytes", ok * self.row_bytes)
        if gone and self._removed_listener is not None:
            self._removed_listener(gone)
        return out

    # -- removal (owner thread) -----------------------------------------------------------------
    def drop(self, keys: Sequence[bytes]) -> int:
        """Forget keys here (they stay in the store for the other engines); returns how many."""
        gone = [k for k in keys if self._present.pop(k, None) is not None]
        if gone and self._removed_listener is not None:
            self._removed_listener(gone)
        return len(gone)

    def clear(self, last_access_before: float | None = None) -> int:
        """Forget every key known here (``last_access_before`` is not tracked: all of them);
        the store keeps them for the other engines."""
        return self.drop(list(self._present))

    def flush(self, timeout: float = 30.0) -> None:
        """Nothing to persist: the counters live in this process (its /metrics)."""

    def evict(self, n: int) -> list[bytes]:
        """Nothing: the master evicts by its own watermarks, for the whole cluster."""
        return []

    def describe(self) -> dict[str, Any]:
        used, cap, entries = self.usage()
        return {**self.stats.snapshot(), "entries": entries, "lent_bytes": cap,
                "usage_bytes": used, "link": self.link.state.value, "master": self.cfg.master,
                "client": self.client.hostname, "namespace": self.namespace_id,
                "io": self.io_name}

    # -- blocking helpers -------------------------------------------------------------------------
    def wait_connected(self, timeout: float = 30.0) -> bool:
        """Block until the link is up (tests, tools); False if it is not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.link.up and time.monotonic() < deadline:
            self.poll(wait=0.05)
            time.sleep(0.02)
        return self.link.up

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.wait_idle(timeout=self._overrun_s)
        except TimeoutError:
            log.warning("mooncake tier: closing with %d call(s) still in flight",
                        len(self._inflight.batches))
        finally:
            self.client.close(timeout=self._overrun_s)

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
