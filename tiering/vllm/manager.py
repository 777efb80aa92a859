"""TieredManager: vLLM's ``OffloadingManager`` interface over a ``TierChain``.

Runs in the scheduler (EngineCore) process; every call comes from the scheduler thread and
returns without waiting for I/O (file-tier reads and writes complete in the background and are
applied when the chain polls). Hit sources are reported per key (HOST for chunks that were in
CPU staging, DISK for chunks promoted from a file tier) so that vLLM's
``prompt_tokens_cached_by_source`` splits correctly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from tiering.chain import Lookup, TierChain
from tiering.request_scan import RequestScan
from tiering.settings import (
    HITS_FIRST_DEFAULT,
    MAX_LOAD_STARTS_PER_STEP,
    SORT_GPU_BLOCKS_DEFAULT,
)
from tiering.vllm.compat import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    hit_source,
)
from tiering.vllm.load_gate import LoadGate
from tiering.vllm.metrics import TierMetrics
from tiering.vllm.worker import RowsSpec

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

log = logging.getLogger(__name__)

_LOOKUP = {Lookup.HIT: LookupResult.HIT, Lookup.MISS: LookupResult.MISS,
           Lookup.PENDING: LookupResult.HIT_PENDING, Lookup.RETRY: LookupResult.RETRY}
_SOURCE = {"cpu": hit_source("cpu"), "disk": hit_source("disk")}
_BYTES = frozenset({bytes})


def _as_bytes(keys: Iterable[bytes]) -> list[bytes]:
    """vLLM's keys as a list of bytes. Its ``OffloadKey`` already is ``bytes``: then the list
    is used as it is (one type check over the list in C, not a ``bytes()`` call per key)."""
    out = list(keys)
    return out if set(map(type, out)) <= _BYTES else [bytes(k) for k in out]


class TieredManager(OffloadingManager):
    def __init__(self, chain: TierChain, metrics: TierMetrics | None = None,
                 on_shutdown: Callable[[], object] | None = None,
                 max_loading_requests: int | None = None,
                 hits_first: bool = HITS_FIRST_DEFAULT,
                 max_load_starts_per_step: int = MAX_LOAD_STARTS_PER_STEP,
                 sort_gpu_blocks: bool = SORT_GPU_BLOCKS_DEFAULT) -> None:
        self.chain = chain
        # read by tiering.vllm.scheduler's hits-first pass (no effect without it)
        self.hits_first = hits_first
        # read by tiering.vllm.block_order under TieringScheduler (no effect without it)
        self.sort_gpu_blocks = sort_gpu_blocks
        self.metrics = metrics
        self._on_shutdown = on_shutdown
        # requests with a load to the GPU in flight, at most max_loading_requests (0: no cap;
        # None: the default, tiering.vllm.load_gate), and at most max_load_starts_per_step of
        # them started in one step (0: no limit)
        self.load_gate = LoadGate(max_loading_requests, chain.cpu.stats,
                                  max_load_starts_per_step)
        self._scans: dict[str, RequestScan] = {}  # live requests' scans (tiering.request_scan)

    @staticmethod
    def of_scheduler(scheduler: Any) -> TieredManager | None:
        """The manager behind a vLLM scheduler's connector (the offloading connector's
        scheduler side over our spec), or None (no connector, or not our spec)."""
        connector = getattr(scheduler, "connector", None)
        manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
        return manager if isinstance(manager, TieredManager) else None

    def live_requests(self) -> int:
        """Requests with a scan (dropped when vLLM reports them finished)."""
        return len(self._scans)

    def _scan(self, req_context: ReqContext) -> RequestScan:
        req_id = getattr(req_context, "req_id", "")
        scan = self._scans.get(req_id)
        if scan is None:
            scan = self._scans[req_id] = RequestScan(self.chain, req_id)
        return scan

    def _end_token(self, key: bytes, req_context: ReqContext) -> int | None:
        """Where chunk ``key`` ends in the request's prompt (vLLM records it), or None."""
        get = getattr(req_context, "get_offload_key_position", None)
        return get(key) if get is not None else None

    @staticmethod
    def _prompt_end(req_context: ReqContext) -> int | None:
        """Where the request's last chunk ends in its prompt, or None where vLLM does not say.

        vLLM 0.33's connector records every key's end position in the request's context
        before its first lookup, but offers them key by key (``get_offload_key_position``),
        not the last one; this reads its record, and falls back to None (the disk run is
        surveyed) wherever the record is not the dict it is in 0.33. Upstream, a
        ``ReqContext.num_prompt_tokens`` would do. Asked once per disk run."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not isinstance(positions, dict) or not positions:
            return None
        end = max(positions.values())
        return end if isinstance(end, int) else None

    @staticmethod
    def _asked_from_the_end(key: bytes, req_context: ReqContext) -> bool:
        """Is ``key``, the first chunk vLLM asks about for the request, its prompt's last of
        several? vLLM scans a full-attention group from the prompt's start (after its own GPU
        hits), so a miss there means the prompt computes; it scans a sliding-window group from
        the end, where the tail's miss says nothing of the hits before it. False where vLLM
        records no positions (0.32): the scan is taken as forward."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not isinstance(positions, dict) or len(positions) < 2:
            return False
        end = positions.get(key)
        return end is not None and end == max(positions.values())

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        gate = self.load_gate
        if gate.closed:  # the cap is reached: a request that would load waits a step
            deferred = gate.check(getattr(req_context, "req_id", ""), key,
                                  self.chain.cpu.contains)
            if deferred is not None:
                return deferred
        advisor = self.chain.advisor
        first = None
        if advisor is not None:  # only the advisor times runs by position (a call per chunk)
            end = self._end_token(key, req_context)
            first = end - advisor.chunk_tokens if end is not None else None
        scan = self._scan(req_context)
        found = scan.lookup(key if type(key) is bytes else bytes(key), first,
                            (lambda: self._prompt_end(req_context)) if advisor is not None
                            else None)
        if (found is Lookup.MISS and gate.limits and not gate.computing
                and scan.counted <= {key} and not self._asked_from_the_end(key, req_context)):
            gate.prompt_computes()  # its first chunk missed: vLLM computes it this step
        return _LOOKUP[found]

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop the request's scan (vLLM has issued every prepare_store of the request by now;
        its store completions need no scan) and its place among the loading requests."""
        req_id = getattr(req_context, "req_id", "")
        self.load_gate.forget(req_id)
        scan = self._scans.pop(req_id, None)
        if scan is not None:
            scan.finished()
        if not self._scans:
            self.chain.engine_idle()

    def resident(self, key: bytes) -> bool:
        """Would ``lookup(key)`` find the chunk in the CPU tier now? (A read, nothing counted or
        pinned: the hits-first scheduler asks it for waiting requests' first chunks.)"""
        return self.chain.cpu.contains(key)

    def load_slots_free(self) -> int | None:
        """How many more requests may start a load now (the load gate's cap less the requests
        loading, and this step's share of starts), or None where the gate has no limits."""
        return self.load_gate.slots_free()

    def get_load_source(self, key: bytes, req_context: ReqContext) -> Any:
        return _SOURCE[self.chain.hit_source(key if type(key) is bytes else bytes(key))]

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> RowsSpec:
        rows = self.chain.prepare_load(_as_bytes(keys))
        self.load_gate.started(getattr(req_context, "req_id", ""))
        return RowsSpec(rows)

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        self.chain.touch(_as_bytes(keys))

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        self.chain.complete_load(_as_bytes(keys))
        req_id = getattr(req_context, "req_id", "")
        self.load_gate.ended(req_id)
        scan = self._scans.get(req_id)
        if scan is not None:
            scan.load_completed(alone=len(self._scans) == 1)

    def first_token(self, req_id: str) -> None:
        """Our connector (``TieredOffloadingConnector``) saw the first token of a request that
        loaded hits: its scan times it from the load's landing (``RequestScan.first_token``)."""
        scan = self._scans.get(req_id)
        if scan is not None:
            scan.first_token(alone=len(self._scans) == 1)

    def prepare_store(self, keys: Collection[bytes], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        if keys and self.chain.advisor is not None:
            # vLLM offers a step's chunks for storing when it schedules their compute: this
            # step computes them (the advisor's step clock times it)
            ends = [self._end_token(k, req_context) for k in keys]
            known = [e for e in ends if e is not None]
            if len(known) == len(ends):
                self._scan(req_context).offered(known)
        if keys:
            self.load_gate.chunks_offered()
        out = self.chain.prepare_store(_as_bytes(keys))
        if out is None:
            return None
        to_store, rows, evicted = out
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=RowsSpec(rows),
                                  evicted_keys=evicted)

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext,
                       success: bool = True) -> None:
        self.chain.complete_store(_as_bytes(keys), success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request arrived: its scan starts now, counted among the requests waiting to be
        scheduled (the advisor's engine backlog) until vLLM first asks about it."""
        if self.chain.advisor is not None:
            self._scan(req_context).arrived()
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for e in self.chain.take_events():
            medium = Medium.CPU if e.medium == "cpu" else Medium.STORAGE
            yield OffloadingEvent(keys=e.keys, medium=medium, removed=e.removed)

    def on_schedule_end(self, context: object) -> None:
        # vLLM's ScheduleEndContext: the requests scheduled for the first time in this step
        # (reached, whether or not they had a chunk to look up)
        for req_id in getattr(context, "new_req_ids", None) or ():
            scan = self._scans.get(req_id)
            if scan is not None:
                scan.reached()
        self.load_gate.end_step()
        self.chain.on_schedule_end()

    def has_pending_work(self) -> bool:
        self.chain.poll()
        return self.chain.has_pending_work()

    def reset_cache(self) -> None:
        self.chain.reset()
        self.load_gate.reset()  # vLLM drops its in-flight jobs: their completions never come

    def forward_step(self) -> int | None:
        """Our connector (``TieredOffloadingConnector``), after vLLM built a step's metadata: a
        number under which the worker times the step's forward pass, or None when the advisor
        does not time steps so (``tiering/vllm/forward_timer.py``)."""
        advisor = self.chain.advisor
        return advisor.forward_step() if advisor is not None else None

    def forward_times(self, times: dict[int, float]) -> None:
        """Our connector, as a step's output comes back: the worker's forward-pass seconds of
        the steps numbered by ``forward_step``."""
        if self.chain.advisor is not None:
            self.chain.advisor.forward_times(times)

    def get_stats(self) -> OffloadingConnectorStats | None:
        # vLLM asks once per update_from_output, after the step's output came back: the one
        # hook the manager has that says a step is done (the step clock times steps by it)
        self.chain.on_step_output()
        return self.metrics.collect(self.chain) if self.metrics is not None else None

    def shutdown(self) -> None:
        try:
            self.chain.close()
        finally:
            if self._on_shutdown is not None:
                self._on_shutdown()
