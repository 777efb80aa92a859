"""Our file tier under vLLM's own ``TieringOffloadingSpec`` (a ``SecondaryTierManager``).

    "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                         "path": "/mnt/nvme/kv", "capacity": "1TiB", "policy": "arc",
                         "store_threshold": 2}]

Every key except ``type``/``module_path``/``locality``/``enable_kv_events``/
``switch_interval_ms`` is a file-tier setting (``FileTierConfig``); a wrong one fails the engine
at start with the key's name. ``switch_interval_ms`` is our spec's option of that name
(tiering.switch_interval): the engine process's switch interval while the tier's I/O threads
read, 0.5 ms unless set, 0 to leave Python's own.
``locality`` (``"LOCAL"``/``"REMOTE"``, as for vLLM's ``fs`` tier) lets requests that name the
tiers they may load from (``kv_load_tiers``) skip this one. KV events (a chunk stored, evicted
or dropped) are emitted only while vLLM's KV events are on, unless ``enable_kv_events`` is
false.

vLLM's tiering manager owns the CPU rows, the cascade (write-through of every chunk stored to
CPU) and promotions; this class adds what vLLM's own ``fs`` tier lacks: a capacity bound with a
real eviction policy, admission by ``store_threshold``, checksums, crash-safe group commits, and
an index that survives restarts. All methods run on vLLM's scheduler thread and return without
waiting for I/O; a bad job (chunk ids outside the primary tier) fails, it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiering.backends.file_config import FileTierConfig
from tiering.backends.file_tier import FileTier as _FileTier
from tiering.backends.mooncake_config import MooncakeTierConfig
from tiering.backends.mooncake_tier import MooncakeTier as MooncakeStoreTier
from tiering.backends.namespace import NamespaceFacts
from tiering.switch_interval import parse_switch_interval_ms, shorten_switch_interval
from tiering.tier import Lookup
from tiering.vllm.compat import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    share_vllm_logging,
)
from tiering.vllm.engine_facts import facts_from_config

log = logging.getLogger(__name__)


@dataclass
class _Job:
    keys: set[bytes]  # still in flight
    order: dict[bytes, int]  # the job's keys, as vLLM listed them
    ok: list[bytes] = field(default_factory=list)
    failed: bool = False
    is_promotion: bool = False
    nbytes: int = 0

    def ok_in_order(self) -> list[bytes]:
        return sorted(self.ok, key=self.order.__getitem__)


class FileSecondaryTier(SecondaryTierManager):
    """Our file tier (``tiering.backends.file_tier.FileTier``) as vLLM's
    ``SecondaryTierManager``; configs name it ``"type": "FileTier"`` (an alias in
    ``tiering.vllm``)."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **tier_config: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        share_vllm_logging()
        where = f"secondary tier {tier_type!r}"
        self.locality = _parse_locality(tier_config.pop("locality", None), where)
        events = tier_config.pop("enable_kv_events", True)
        if not isinstance(events, bool):
            raise ValueError(f"{where}: enable_kv_events: expected true or false, got {events!r}")
        try:
            switch_ms = parse_switch_interval_ms(tier_config.pop("switch_interval_ms", None))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        row_bytes = self.block_size_bytes
        # vLLM lays these rows out: in its canonical page format when the config asks for it
        facts, info = facts_from_config(
            offloading_spec.config, row_bytes,
            canonical=bool(getattr(offloading_spec.config, "canonical_layout", False)))
        self.tier = self._open_tier(tier_config, facts, info, where)
        shorten_switch_interval(switch_ms)  # its I/O threads read while the scheduler runs
        self._rows = primary_kv_view.cast("B") if primary_kv_view.ndim > 1 else primary_kv_view
        self._row_bytes = row_bytes
        self._jobs: dict[int, _Job] = {}
        self._owner: dict[bytes, int] = {}  # key being written -> its store job
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._events_on = events and bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        if self._events_on:
            self.tier.on_removed(self._removed)

    def _open_tier(self, tier_config: dict[str, Any], facts: NamespaceFacts,
                   info: dict[str, Any], where: str) -> _FileTier | MooncakeStoreTier:
        """Our tier behind this manager (a subclass opens another kind)."""
        return _FileTier(FileTierConfig.from_dict(tier_config, where=where), facts, info)

    def _bad_chunk_ids(self, job_metadata: TransferJob) -> bool:
        """Chunk ids outside the primary tier: the job fails (logged), nothing raises."""
        n = len(self._rows) // self._row_bytes
        bad = [int(c) for c in job_metadata.chunk_ids if not 0 <= int(c) < n]
        if bad or len(job_metadata.chunk_ids) != len(job_metadata.keys):
            log.error("file tier %s: job %d names chunk(s) %s outside the primary tier's %d "
                      "rows (or keys and chunks differ in number); failing it", self.tier_type,
                      job_metadata.job_id, bad[:4], n)
            self._finished.append(JobResult(job_metadata.job_id, False))
            return True
        return False

    def _removed(self, keys: list[bytes]) -> None:
        self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=True,
                                            locality=self.locality))

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        # vLLM's tiering manager already skips tiers a request excludes; kept here too so the
        # tier never serves a request that asked for other tiers, whoever calls it.
        tier_filter = getattr(req_context, "load_tier_filter", None)
        if tier_filter is not None and not tier_filter.allows(self.medium, self.locality):
            return LookupResult.MISS
        hit = self.tier.lookup(bytes(key)) is Lookup.HIT
        return LookupResult.HIT if hit else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        if self._bad_chunk_ids(job_metadata):
            return
        keys = [bytes(k) for k in job_metadata.keys]
        accepted = self.tier.put(keys, self._rows_of(job_metadata.chunk_ids)).admitted
        if not accepted:  # nothing to write (present, not admitted, or full): done at once
            self._finished.append(JobResult(job_metadata.job_id, True))
            return
        self._jobs[job_metadata.job_id] = _Job(set(accepted), {k: i for i, k in enumerate(keys)})
        for k in accepted:
            self._owner[k] = job_metadata.job_id

    def submit_load(self, job_metadata: TransferJob) -> None:
        if self._bad_chunk_ids(job_metadata):
            return
        job_id = job_metadata.job_id
        items = [(bytes(k), row, job_id) for k, row in
                 zip(job_metadata.keys, self._rows_of(job_metadata.chunk_ids), strict=True)]
        if not items:  # nothing asked, nothing failed
            self._finished.append(JobResult(job_id, True))
            return
        started = self.tier.get(items)
        job = _Job({k for (k, _, _), s in zip(items, started, strict=True) if s},
                   {k: i for i, (k, _, _) in enumerate(items)},
                   is_promotion=True, failed=not all(started))
        if not job.keys:  # none of them readable: all failed
            self._finished.append(JobResult(job_id, False))
            return
        self._jobs[job_id] = job

    def _rows_of(self, chunk_ids: Any) -> list[memoryview]:
        """The primary rows of a job's chunks (views, no copies); one tolist, no per-row int."""
        rows, rb = self._rows, self._row_bytes
        ids = chunk_ids.tolist() if hasattr(chunk_ids, "tolist") else [int(c) for c in chunk_ids]
        return [rows[c * rb:(c + 1) * rb] for c in ids]

    def _poll(self, wait: float = 0.0) -> None:
        for r in self.tier.poll(wait=wait):
            job_id = self._owner.pop(r.key, None) if r.kind == "store" else r.token
            job = self._jobs.get(job_id) if job_id is not None else None
            if job is None or job_id is None:
                continue
            job.keys.discard(r.key)
            if r.ok:
                job.ok.append(r.key)
                job.nbytes += r.nbytes
            else:
                job.failed = True
            if not job.keys:
                del self._jobs[job_id]
                if self._events_on and job.ok and not job.is_promotion:
                    # one event per store job, for the chunks now on disk (a failed write
                    # left no entry and is not announced)
                    self._events.append(OffloadingEvent(keys=job.ok_in_order(),
                                                        medium=Medium.STORAGE, removed=False,
                                                        locality=self.locality))
                # a failed promotion names the chunks that did arrive (None: none did)
                partial = (job.ok_in_order() or None) if (job.is_promotion and job.failed) \
                    else None
                self._finished.append(JobResult(job_id, not job.failed, successful_keys=partial,
                                                transfer_bytes=job.nbytes))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._poll()
        done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self.tier.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        self.tier.touch([bytes(k) for k in keys])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        while self.has_pending_work():
            self._poll(wait=0.01)

    def shutdown(self) -> None:
        self.drain_jobs()
        self.tier.close()
        self._rows.release()  # vLLM closes the primary mmap next: no view may remain


def _parse_locality(value: Any, where: str) -> Locality | None:
    if value is None:
        return None
    try:
        return Locality(value)
    except ValueError:
        names = " or ".join(repr(m.value) for m in Locality)
        raise ValueError(f"{where}: locality: expected a vLLM Locality ({names}), "
                         f"got {value!r}") from None


class MooncakeTier(FileSecondaryTier):
    """Our Mooncake Store tier under vLLM's ``TieringOffloadingSpec``::

        "secondary_tiers": [{"type": "MooncakeTier", "module_path": "tiering.vllm",
                             "master": "10.0.0.5:50051",
                             "metadata": "http://10.0.0.5:8080/metadata", "segment": "8GiB"}]

    Every key except ``type``/``module_path``/``locality``/``enable_kv_events`` is a Mooncake-tier
    setting (``MooncakeTierConfig``). ``locality`` defaults to ``"REMOTE"``: the chunks live in
    a store other engines share. A chunk the master was not asked about yet answers RETRY (vLLM
    keeps scanning and asks again next step); jobs run and complete like the file tier's."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **tier_config: Any) -> None:
        tier_config.setdefault("locality", Locality.REMOTE.value)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector,
                         **tier_config)

    def _open_tier(self, tier_config: dict[str, Any], facts: NamespaceFacts,
                   info: dict[str, Any], where: str) -> MooncakeStoreTier:
        return MooncakeStoreTier(MooncakeTierConfig.from_dict(tier_config, where=where), facts,
                                 info)

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        tier_filter = getattr(req_context, "load_tier_filter", None)
        if tier_filter is not None and not tier_filter.allows(self.medium, self.locality):
            return LookupResult.MISS
        self.tier.poll()  # answers of the master that arrived since the last step
        found = self.tier.lookup(bytes(key))
        if found is Lookup.HIT:
            return LookupResult.HIT
        return LookupResult.RETRY if found in (Lookup.RETRY, Lookup.PENDING) else LookupResult.MISS
