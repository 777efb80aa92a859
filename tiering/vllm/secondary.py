"""Our file tier under vLLM's own ``TieringOffloadingSpec`` (a ``SecondaryTierManager``).

    "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                         "path": "/mnt/nvme/kv", "capacity": "1TiB", "policy": "arc",
                         "store_threshold": 2}]

Every key except ``type``/``module_path`` is a file-tier setting (``FileTierConfig``); a wrong
one fails the engine at start with the key's name. vLLM's tiering manager owns the CPU rows,
the cascade (write-through of every chunk stored to CPU) and promotions; this class adds what
vLLM's own ``fs`` tier lacks: a capacity bound with a real eviction policy, admission by
``store_threshold``, checksums, crash-safe group commits, and an index that survives restarts.
All methods run on vLLM's scheduler thread and return without waiting for I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiering.backends.file_config import FileTierConfig
from tiering.backends.file_tier import FileTier as _FileTier
from tiering.backends.file_tier import ReadResult, WriteDone
from tiering.vllm.compat import (
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
)
from tiering.vllm.namespace import facts_from_config

log = logging.getLogger(__name__)


@dataclass
class _Job:
    keys: set[bytes]
    ok: list[bytes] = field(default_factory=list)
    failed: bool = False
    is_promotion: bool = False
    nbytes: int = 0


class FileTier(SecondaryTierManager):
    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **tier_config: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        tier_config.pop("locality", None)
        cfg = FileTierConfig.from_dict(tier_config, where=f"secondary tier {tier_type!r}")
        row_bytes = self.block_size_bytes
        facts, info = facts_from_config(offloading_spec.config, row_bytes)
        self.tier = _FileTier(cfg, facts, info)
        self._rows = primary_kv_view.cast("B") if primary_kv_view.ndim > 1 else primary_kv_view
        self._row_bytes = row_bytes
        self._jobs: dict[int, _Job] = {}
        self._owner: dict[bytes, int] = {}  # key being written -> its store job
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []

    def _row(self, chunk_id: int) -> memoryview:
        return self._rows[chunk_id * self._row_bytes:(chunk_id + 1) * self._row_bytes]

    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.tier.lookup(bytes(key)) else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        accepted = self.tier.put(keys, self._rows_of(job_metadata.chunk_ids))
        if not accepted:  # nothing to write (present, not admitted, or full): done at once
            self._finished.append(JobResult(job_metadata.job_id, True))
            return
        self._jobs[job_metadata.job_id] = _Job(set(accepted))
        for k in accepted:
            self._owner[k] = job_metadata.job_id

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        items = [(bytes(k), row, job_id) for k, row in
                 zip(job_metadata.keys, self._rows_of(job_metadata.chunk_ids), strict=True)]
        started = self.tier.get_many(items)
        job = _Job({k for (k, _, _), s in zip(items, started, strict=True) if s},
                   is_promotion=True, failed=not all(started))
        if not job.keys:
            self._finished.append(JobResult(job_id, False, successful_keys=[]))
            return
        self._jobs[job_id] = job

    def _rows_of(self, chunk_ids: Any) -> list[memoryview]:
        """The primary rows of a job's chunks (views, no copies); one tolist, no per-row int."""
        rows, rb = self._rows, self._row_bytes
        ids = chunk_ids.tolist() if hasattr(chunk_ids, "tolist") else [int(c) for c in chunk_ids]
        return [rows[c * rb:(c + 1) * rb] for c in ids]

    def _poll(self, wait: float = 0.0) -> None:
        for r in self.tier.poll(wait=wait):
            if isinstance(r, WriteDone):
                job_id = self._owner.pop(r.key, None)
                if r.ok:
                    self._events.append(OffloadingEvent(keys=[r.key], medium=Medium.STORAGE,
                                                        removed=False))
            else:
                assert isinstance(r, ReadResult)
                job_id = r.token
            job = self._jobs.get(job_id)
            if job is None:
                continue
            job.keys.discard(r.key)
            if r.ok:
                job.ok.append(r.key)
                job.nbytes += r.nbytes
            else:
                job.failed = True
            if not job.keys:
                del self._jobs[job_id]
                partial = job.ok if (job.is_promotion and job.failed) else None
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

    def touch(self, keys: Collection, req_context: ReqContext) -> None:
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
