"""A vLLM scheduler for engines that load many prefixes at once: vLLM's own scheduler with one
quadratic admission cost made linear, GPU blocks handed out in the order our staging rows hold
them so that offloading copies are few and large (``tiering/vllm/block_order.py``; the spec's ``sort_gpu_blocks``,
on by default), and cache hits admitted before prompts that compute
(``tiering/vllm/hits_first.py``; the spec's ``hits_first``, off by default). Selected with vLLM's
``--scheduler-cls`` option:

    vllm serve MODEL --kv-transfer-config '{...}' \\
        --scheduler-cls tiering.vllm.scheduler.TieringScheduler

Why: vLLM 0.33 admits an asynchronously loading request only if it fits beside the blocks every
prefill already in flight still needs (``Scheduler._inflight_prefill_reserved_blocks``). It sums
``_request_remaining_blocks`` over all of them at each such admission, a call through the KV
cache coordinator per in-flight request, so admitting N hits in one step costs O(N^2) of those
calls. Profiled on the H200 (docs/benchmarks.md, "The floor in vLLM"): 2.27 s of the scheduler's
3.27 s for a batch of 1024 CPU hits of 512 tokens, 0.31 of 0.54 s at 256 hits of the 8B shape.

What changes: each in-flight request's term is remembered with everything it is computed from
(the request's token and computed-token counts, and per KV cache group the number of blocks it
holds and whether its blocks were cached). A term is recomputed, by vLLM's own
``_request_remaining_blocks``, only when one of those changed. The first ask of a
``schedule()`` pass checks every request's inputs (O(in flight), in C loops); the later asks of
the same pass touch only the requests that pass can have changed (below, ``_PassSum``), so
admitting N loads in one step costs O(N) in all, not O(N^2) even in C. That is exact only where the term
depends on nothing else, which holds for plain full attention (``FullAttentionManager`` itself,
not its subclasses: sliding windows, Mamba, cross-attention, sparse attention each compute it
from more). For any other KV cache layout, the class behaves exactly as vLLM's scheduler.
The remembered sum changes no scheduling decision: same admissions, same order, same blocks
(held in another order where block_order sorts them)
(``tests/test_vllm_sched_reserve.py`` checks it against vLLM's scheduler step by step, with
hits first off). Hits first does change the order, on purpose: its module says how.
One default differs under this class: our spec's cap on requests loading at once
(``max_loading_requests``, tiering.vllm.load_gate), which only bounded the quadratic sum, is
lifted unless the spec's config names one.

Contract: the override runs on vLLM's scheduler thread inside ``schedule()``; it does no I/O and
never raises: on any error it logs once and returns vLLM's own sum. With
``TIERING_SCHEDULER_CHECK=1`` in the environment every call also computes vLLM's sum and logs an
error (once) where the two differ, returning vLLM's (a debugging aid: that is the quadratic cost
again).

The upstream change that makes this class unnecessary: keep a running total of the in-flight
reservations, updated where a request enters or leaves ``_inflight_prefills`` and where its
blocks or computed tokens change, instead of re-summing at each admission.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import repeat
from operator import attrgetter
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from tiering.step_trace import TRACE
from tiering.vllm.block_order import SortedBlocks
from tiering.vllm.compat import share_vllm_logging
from tiering.vllm.hits_first import HitsFirst
from tiering.vllm.manager import TieredManager

__all__ = ["TieringScheduler", "TieringAsyncScheduler", "TieringSyncScheduler"]

log = logging.getLogger(__name__)

CHECK_ENV = "TIERING_SCHEDULER_CHECK"

# (request id, tokens, computed tokens, then per KV cache group: blocks held, blocks cached?)
_Key = tuple[Any, ...]
_request_id = attrgetter("request_id")
_num_tokens = attrgetter("num_tokens")
_computed = attrgetter("num_computed_tokens")
# per KV cache group, its manager's request -> blocks and request -> cached-block-count maps
_Groups = tuple[tuple[dict[str, Any], dict[str, Any]], ...]


class _InflightSet(set):  # type: ignore[type-arg]
    """vLLM's set of in-flight prefills (``Scheduler._inflight_prefills``), noting the requests
    added or discarded since the notes were last taken, so that the pass sum finds who joined
    or left without comparing whole sets. vLLM 0.33 changes the set only with ``add`` and
    ``discard``; any other change is not noted one by one: it marks the notes incomplete, and
    the reader compares the sets instead."""

    __slots__ = ("_noted", "_complete")

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self._noted: set[Any] = set()
        self._complete = True

    def add(self, item: Any) -> None:
        self._noted.add(item)
        super().add(item)

    def discard(self, item: Any) -> None:
        self._noted.add(item)
        super().discard(item)

    def remove(self, item: Any) -> None:
        self._noted.add(item)
        super().remove(item)

    def take_notes(self) -> set[Any] | None:
        """The requests added or discarded since the last take (None where a change was not
        noted), and a fresh start of the notes."""
        noted, complete = self._noted, self._complete
        self._noted, self._complete = set(), True
        return noted if complete else None


def _unnoted(name: str) -> Any:
    method = getattr(set, name)

    def change(self: _InflightSet, *args: Any) -> Any:
        self._complete = False
        out = method(self, *args)
        if out is NotImplemented or not name.startswith("__i"):
            return out  # an operand set's operators do not take: Python tries the other side
        return self  # in-place operators return the set

    change.__name__ = name
    return change


for _name in ("pop", "clear", "update", "difference_update", "intersection_update",
              "symmetric_difference_update", "__ior__", "__iand__", "__isub__", "__ixor__"):
    setattr(_InflightSet, _name, _unnoted(_name))


class _PassSum:
    """The reservation total within one ``schedule()`` pass, kept up to date between asks.

    Why it is exact: vLLM asks for the total only in its waiting loop, which runs after the
    running loop (the only place in a pass that preempts or grows a running request). Within
    the waiting loop an in-flight request's inputs change only where the loop processes it:
    a load that finished is taken in by ``_update_waiting_for_remote_kv`` (the scheduler marks
    the request here, ``touched``), and a request the loop schedules is appended to
    ``running`` after its blocks and computed tokens are set. A request admitted to the
    in-flight set during the pass is not processed again in it. So between two asks the terms
    that can change are those of: requests that joined or left the set, requests appended to
    ``running`` since the last ask, and requests marked touched. Anything else (``running``
    replaced or shortened) ends the pass's sum: the next ask checks everything again."""

    __slots__ = ("terms", "total", "running", "running_seen", "touched")

    def __init__(self, terms: dict[Any, int], running: list[Any]) -> None:
        self.terms = terms                  # request -> its term, for every request counted
        self.total = sum(terms.values())
        self.running = running              # vLLM's running list, by identity
        self.running_seen = len(running)    # its length at the last ask
        self.touched: set[Any] = set()      # requests whose finished load was taken in

    def valid_for(self, running: list[Any]) -> bool:
        return running is self.running and len(running) >= self.running_seen

    def update(self, inflight: set[Any], term: Any) -> int:
        """The total now: ``term(request)`` is called for the requests that may have changed."""
        changed = set(self.running[self.running_seen:])
        self.running_seen = len(self.running)
        changed |= self.touched
        self.touched.clear()
        noted = inflight.take_notes() if type(inflight) is _InflightSet else None
        if noted is None:  # compare the sets
            changed |= self.terms.keys() - inflight   # left the set
            changed |= inflight - self.terms.keys()   # joined it
        else:  # who was added or discarded since the last ask
            changed |= noted
        for req in changed:
            old = self.terms.pop(req, None)
            if old is not None:
                self.total -= old
            if req in inflight:
                self.terms[req] = new = term(req)
                self.total += new
        return self.total


class _ReservationMemo:
    """The in-flight reservation total, with each request's term remembered against its inputs.

    Mixed in before vLLM's ``Scheduler``/``AsyncScheduler``; owns ``_tiering_terms`` (a
    request's id and inputs -> its term) and nothing else of the scheduler's state. Reads
    vLLM's state only."""

    _tiering_terms: dict[_Key, int]
    _tiering_groups: _Groups | None
    _tiering_check: bool
    _tiering_failed: bool
    _tiering_pass: _PassSum | None  # set only inside schedule(), after its first ask
    _tiering_scheduling: bool  # inside schedule()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        share_vllm_logging()  # also where no connector of ours did it already
        self._tiering_terms = {}
        # vLLM's in-flight set, the same members, noting who joins and leaves (_InflightSet);
        # where it is not the plain set of 0.32/0.33, it is left alone (the sets are compared)
        inflight = getattr(self, "_inflight_prefills", None)
        if type(inflight) is set:
            self._inflight_prefills = _InflightSet(inflight)
        self._tiering_check = os.environ.get(CHECK_ENV, "") not in ("", "0")
        self._tiering_failed = False
        self._tiering_pass = None
        self._tiering_scheduling = False
        self._tiering_groups = self._full_attention_groups()
        if self._tiering_groups is None:
            log.info("TieringScheduler: this KV cache layout is not plain full attention; "
                     "in-flight reservations are summed as vLLM does")
            return
        log.info("%s: in-flight reservations remembered per request "
                 "(%d KV cache group(s)%s)", type(self).__name__, len(self._tiering_groups),
                 ", checked against vLLM's sum" if self._tiering_check else "")
        # the sum is linear now: the default load cap, which only bounded it, is lifted
        manager = TieredManager.of_scheduler(self)
        if manager is not None and manager.load_gate.scheduler_sums_linearly():
            log.info("%s: no cap on requests loading at once (max_loading_requests: the "
                     "default; set it in the spec's config to keep one)", type(self).__name__)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._tiering_pass = None  # the pass's first ask checks every request
        self._tiering_scheduling = True
        self._take_inflight_notes()  # notes from before the pass are not needed
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._tiering_scheduling = False
            self._tiering_pass = None  # between passes anything may change

    def _take_inflight_notes(self) -> None:
        inflight = self._inflight_prefills
        if type(inflight) is _InflightSet:
            inflight.take_notes()

    def _update_waiting_for_remote_kv(self, request: Any) -> Any:
        passed = self._tiering_pass
        if passed is not None:
            passed.touched.add(request)
        return super()._update_waiting_for_remote_kv(request)  # type: ignore[misc]

    def _full_attention_groups(self) -> _Groups | None:
        """Per KV cache group, the manager's (request -> blocks, request -> cached blocks)
        maps, where every group is plain full attention; else None."""
        try:
            managers = self.kv_cache_manager.coordinator.single_type_managers  # type: ignore[attr-defined]
            if not managers or any(type(m) is not FullAttentionManager for m in managers):
                return None
            return tuple((m.req_to_blocks, m.num_cached_block) for m in managers)
        except AttributeError:  # a release that keeps these elsewhere: vLLM's sum
            return None

    def _vllm_sum(self) -> int:
        """vLLM's own sum over the in-flight prefills (the quadratic one)."""
        return int(super()._inflight_prefill_reserved_blocks())  # type: ignore[misc]

    def _inflight_prefill_reserved_blocks(self) -> int:
        if self._tiering_groups is None or self._tiering_failed:
            return self._vllm_sum()
        try:
            total = self._remembered_total()
        except Exception:  # never into vLLM's scheduler: its own sum from here on
            log.exception("TieringScheduler: remembering reservations failed; summing as vLLM "
                          "does from now on")
            self._fall_back_to_vllms_sum()
            return self._vllm_sum()
        if self._tiering_check:
            exact = self._vllm_sum()
            if exact != total:
                log.error("TieringScheduler: remembered reservations %d != vLLM's %d; summing "
                          "as vLLM does from now on", total, exact)
                self._fall_back_to_vllms_sum()
                return exact
        return total

    def _fall_back_to_vllms_sum(self) -> None:
        """From now on vLLM's own (quadratic) sum: the default load cap that bounds it is back."""
        self._tiering_failed = True
        try:
            manager = TieredManager.of_scheduler(self)
            if manager is not None and manager.load_gate.scheduler_sums_linearly(False):
                log.info("%s: requests loading at once capped at the default again",
                         type(self).__name__)
        except Exception:  # never into vLLM's scheduler
            log.exception("TieringScheduler: could not restore the load cap")

    def _remembered_total(self) -> int:
        """Within a ``schedule()`` pass after its first ask: the pass's running sum, updated
        for the requests that can have changed (``_PassSum``). Otherwise every request's
        inputs are checked (``_checked_total``), and inside a pass that starts its sum."""
        passed = self._tiering_pass
        running = self.running  # type: ignore[attr-defined]
        inflight = self._inflight_prefills
        if passed is not None and passed.valid_for(running):
            return passed.update(inflight, self._term_of)
        reqs = list(inflight)
        total, terms = self._checked_total(reqs)
        if self._tiering_scheduling:  # a sum kept for the pass's later asks
            self._take_inflight_notes()
            self._tiering_pass = _PassSum(dict(zip(reqs, terms, strict=True)), running)
        return total

    def _term_of(self, req: Any) -> int:
        """One request's term, through the memo of (request, inputs) -> term."""
        key = self._key_of(req)
        terms = self._tiering_terms
        term = terms.get(key)
        if term is None:
            term = terms[key] = self._request_remaining_blocks(req)  # type: ignore[attr-defined]
        return term

    def _key_of(self, req: Any) -> _Key:
        groups = self._tiering_groups
        assert groups is not None
        rid = req.request_id
        key: list[Any] = [rid, req.num_tokens, req.num_computed_tokens]
        for blocks, cached in groups:
            key.append(len(blocks.get(rid, ())))
            key.append(rid in cached)
        return tuple(key)

    def _checked_total(self, reqs: list[Any]) -> tuple[int, list[int]]:
        """The sum and each request's term, with a term computed only for a (request, inputs)
        not seen before. The inputs of every request in flight are gathered column by column
        with ``map`` (C loops, no Python frame per request): O(in flight), but about a tenth
        of what one coordinator walk per request costs, and the walks happen once per
        change."""
        groups = self._tiering_groups
        assert groups is not None
        if not reqs:
            return 0, []
        rids = list(map(_request_id, reqs))
        columns: list[list[Any]] = [rids, list(map(_num_tokens, reqs)),
                                    list(map(_computed, reqs))]
        for blocks, cached in groups:
            columns.append(list(map(len, map(blocks.get, rids, repeat((), len(rids))))))
            columns.append(list(map(cached.__contains__, rids)))
        keys = list(zip(*columns, strict=True))
        terms = self._tiering_terms
        remaining = self._request_remaining_blocks  # type: ignore[attr-defined]
        for i in [i for i, k in enumerate(keys) if k not in terms]:
            terms[keys[i]] = remaining(reqs[i])
        each = list(map(terms.__getitem__, keys))
        if len(terms) > 2 * len(keys) + 64:  # forget inputs no request in flight has now
            self._tiering_terms = {k: terms[k] for k in keys}
        return sum(each), each


class _StepTimes:
    """Scheduler mixin (outermost): with ``TIERING_STEP_TRACE`` set, each ``schedule`` and
    ``update_from_output`` call is a row of the step trace (``tiering/step_trace.py``); else
    one attribute read per call."""

    _trace_adds = 0  # requests added since the last traced schedule, and the seconds it took
    _trace_add_s = 0.0

    def add_request(self, request: Any) -> Any:
        if not TRACE.on:
            return super().add_request(request)  # type: ignore[misc]
        t0 = time.perf_counter()
        try:
            return super().add_request(request)  # type: ignore[misc]
        finally:
            self._trace_adds += 1
            self._trace_add_s += time.perf_counter() - t0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if not TRACE.on:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        TRACE.watch_scheduler_thread()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        t1, cpu = time.perf_counter(), time.thread_time() - c0
        meta = getattr(out, "kv_connector_metadata", None)
        TRACE.add("schedule", t0=t0, t1=t1, t=t0, cpu=cpu,
                  tokens=int(sum(out.num_scheduled_tokens.values())),
                  reqs=len(out.num_scheduled_tokens),
                  loads=len(getattr(meta, "load_jobs", None) or ()),
                  stores=len(getattr(meta, "store_jobs", None) or ()),
                  waiting=len(self.waiting),  # type: ignore[attr-defined]
                  adds=self._trace_adds, add_s=self._trace_add_s)
        self._trace_adds, self._trace_add_s = 0, 0.0
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not TRACE.on:
            return super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output)
        t0 = time.perf_counter()
        out = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)
        kvo = getattr(model_runner_output, "kv_connector_output", None)
        TRACE.add("update", t0=t0, t1=time.perf_counter(), t=t0,
                  recv=len(getattr(kvo, "finished_recving", None) or ()))
        return out


class TieringSyncScheduler(_StepTimes, HitsFirst, SortedBlocks, _ReservationMemo, Scheduler):
    """vLLM's ``Scheduler`` (no async scheduling) with the linear reservation sum, hits first
    and GPU blocks sorted for our copies."""


class TieringAsyncScheduler(_StepTimes, HitsFirst, SortedBlocks, _ReservationMemo,
                            AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the linear reservation sum, hits first and GPU blocks in
    the order our copies want."""


class TieringScheduler(TieringSyncScheduler):
    """The name to give ``--scheduler-cls``: vLLM builds the scheduler it names whatever its
    async-scheduling setting, so this class builds ``TieringAsyncScheduler`` where
    ``scheduler_config.async_scheduling`` is on (vLLM 0.33's default) and
    ``TieringSyncScheduler`` otherwise, as vLLM's own choice between its two would."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        sched = getattr(vllm_config, "scheduler_config", None)
        if cls is TieringScheduler and getattr(sched, "async_scheduling", False):
            # not an instance of cls, so Python runs no __init__ on it a second time
            return TieringAsyncScheduler(*args, **kwargs)
        return super().__new__(cls)
