"""Hits first: waiting requests whose prefix is in our CPU tier are admitted before those that
compute, so that their loads start in the step they arrive.

Why: vLLM's scheduler walks its waiting queue in order until the step's token budget is spent.
A cache hit queued behind prompts that compute is not looked up until those are scheduled, so
its load (copy-engine work, one token of GPU compute) starts steps late, and a batch with mixed
hits ends in a tail of loads: on the H200's prefill sweep at 50% hits (8B shape, 256 prompts of
512 tokens) the loaded requests were served last (2.72 s against 2.08 s for the computed ones,
docs/benchmarks.md), where their 8 GiB of loads take ~0.2 s of PCIe time and could have run
beside the first compute step.

What it does: at the start of each ``schedule()``, the waiting requests (first-come-first-served
policy, never scheduled yet) whose first chunk is READY in the CPU tier are moved to the head of
the queue, in their own order, at most as many as the load gate (``max_loading_requests``,
``max_load_starts_per_step``) admits. vLLM then admits their asynchronous loads first; the
requests behind them are scheduled as before.

What it never does: pass a request without bound. A moved hit needs one token of a step's
budget once its load has landed, but also its GPU blocks from the moment it is admitted; where
the GPU KV cache, not the token budget, is what binds, a stream of hits passing the same
request every step would keep it waiting for as long as the stream lasts (a hostile test found
it: tests/test_hits_first_hostile.py). So a waiting request may be passed at most
``HITS_FIRST_MAX_PASSES`` times; after that it is a barrier, and so is every request that is not
a new one (a preempted request, which vLLM puts back at the head to resume first): the scan
stops there, and no hit behind a barrier moves ahead of it. Under the priority policy, for a
connector that is not our spec's, or where ``hits_first`` is false in the spec's config,
nothing is reordered.

Contract: runs on vLLM's scheduler thread inside ``schedule()``, before vLLM's own code; reads
the queue's requests and the CPU tier's row map (no I/O, nothing counted or pinned) and reorders
the queue with its own methods. It never raises into vLLM: on any error it logs once and stops
reordering for the engine's life.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from tiering.settings import HITS_FIRST_MAX_PASSES, HITS_FIRST_SCAN_MAX

log = logging.getLogger(__name__)


class HitProbe:
    """Which waiting requests would load from the CPU tier, and the queue put in that order.

    Built from vLLM's offloading connector (scheduler side) once; holds our manager and the
    geometry of the first full-attention KV group's chunks (where its first chunk's key is)."""

    def __init__(self, manager: Any, hashes_per_chunk: int, group_idx: int,
                 make_key: Callable[[bytes, int], bytes], waiting_status: Any,
                 scan_max: int = HITS_FIRST_SCAN_MAX,
                 max_passes: int = HITS_FIRST_MAX_PASSES) -> None:
        """``waiting_status``: vLLM's ``RequestStatus.WAITING`` (only requests in it move)."""
        if hashes_per_chunk < 1:
            raise ValueError(f"hashes_per_chunk: expected >= 1, got {hashes_per_chunk}")
        self.manager = manager
        self.hashes_per_chunk = hashes_per_chunk
        self.group_idx = group_idx
        self.make_key = make_key
        self.waiting_status = waiting_status
        self.scan_max = scan_max
        self.max_passes = max_passes
        self.moved = 0  # requests moved ahead, over the engine's life
        self._passed: dict[str, int] = {}  # waiting request -> times hits were moved past it

    @classmethod
    def from_scheduler(cls, scheduler: Any) -> HitProbe | None:
        """The probe for a vLLM scheduler whose connector is the offloading connector over our
        spec with ``hits_first`` on, under the FCFS policy; else None (and why, at INFO)."""
        from tiering.vllm.manager import TieredManager

        manager = TieredManager.of_scheduler(scheduler)
        if manager is None:
            return None  # no connector, or not our spec: nothing of ours to ask
        side: Any = scheduler.connector.connector_scheduler
        if not manager.hits_first:
            log.info("hits first: off (\"hits_first\": false in the spec's config)")
            return None
        policy = getattr(getattr(scheduler, "policy", None), "name", None)
        if policy != "FCFS" or not isinstance(getattr(scheduler, "waiting", None), deque):
            log.info("hits first: off (scheduling policy %s keeps its own order)", policy)
            return None
        try:
            from vllm.v1.kv_offload.base import make_offload_key
            from vllm.v1.request import RequestStatus

            groups = side.config.kv_group_configs
            full = [g for g in groups if g.sliding_window_size_in_chunks is None
                    and not getattr(g, "is_eagle_group", False)]
            first = full[0]
            probe = cls(manager, int(first.hashes_per_chunk), int(first.group_idx),
                        make_offload_key, RequestStatus.WAITING)
        except (ImportError, AttributeError, IndexError, TypeError, ValueError) as exc:
            log.info("hits first: off (this vLLM's connector does not say where a request's "
                     "first chunk is: %s)", exc)
            return None
        log.info("hits first: on (requests whose first chunk is in the CPU tier are admitted "
                 "before those that compute; %d block hashes a chunk, KV group %d)",
                 probe.hashes_per_chunk, probe.group_idx)
        return probe

    def first_key(self, request: Any) -> bytes | None:
        """The key of the request's first chunk, or None while its prompt has no full chunk."""
        hashes = request.block_hashes
        if len(hashes) < self.hashes_per_chunk:
            return None
        return self.make_key(hashes[self.hashes_per_chunk - 1], self.group_idx)

    def passes(self, request_id: str) -> int:
        """How often hits were moved ahead of this waiting request."""
        return self._passed.get(request_id, 0)

    def _fresh(self, req: Any) -> bool:
        return bool(req.num_computed_tokens == 0 and req.status == self.waiting_status)

    def reorder(self, queue: deque[Any]) -> int:
        """Move the hits among the first ``scan_max`` waiting requests, up to the first barrier
        (module doc), to the queue's head in their order; returns how many moved (0 where they
        were at the head already). Every request they passed counts one pass more."""
        if len(queue) < 2:
            return 0
        free = self.manager.load_slots_free()
        if free == 0:
            return 0
        limit = len(queue) if free is None else free
        resident = self.manager.resident
        hits: list[Any] = []
        others: list[tuple[int, Any]] = []  # (position, request) of the scanned non-hits
        last_hit = -1
        in_place = 0  # hits already at the head, before any request that computes
        for i, req in enumerate(queue):
            if i >= self.scan_max or len(hits) >= limit or not self._fresh(req):
                break
            key = (None if getattr(req, "skip_reading_prefix_cache", False)
                   else self.first_key(req))
            if key is not None and resident(key):
                if in_place == i:
                    in_place += 1
                hits.append(req)
                last_hit = i
            elif self._passed.get(req.request_id, 0) >= self.max_passes:
                break  # passed often enough: nothing behind it goes first any more
            else:
                others.append((i, req))
        if len(hits) == in_place:
            return 0
        passed = [r for i, r in others if i < last_hit]
        chosen = {id(r) for r in hits}
        rest = [r for r in queue if id(r) not in chosen]
        queue.clear()
        queue.extend(hits)
        queue.extend(rest)
        for r in passed:
            self._passed[r.request_id] = self._passed.get(r.request_id, 0) + 1
        if len(self._passed) > 2 * len(queue) + 64:  # forget requests no longer waiting
            waiting = {r.request_id for r in queue}
            self._passed = {k: v for k, v in self._passed.items() if k in waiting}
        moved = len(hits) - in_place
        self.moved += moved
        return moved


class HitsFirst:
    """Scheduler mixin (before vLLM's ``Scheduler`` in the bases): reorders the waiting queue
    with a ``HitProbe`` before each ``schedule()``. Owns ``_tiering_hits`` only."""

    _tiering_hits: HitProbe | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._tiering_hits = HitProbe.from_scheduler(self)
        except Exception:  # never into vLLM's scheduler
            log.exception("hits first: could not be set up; off")
            self._tiering_hits = None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        probe = self._tiering_hits
        if probe is not None:
            try:
                moved = probe.reorder(self.waiting)  # type: ignore[attr-defined]
                if moved:
                    log.debug("hits first: %d waiting request(s) moved ahead", moved)
            except Exception:  # never into vLLM's scheduler: its own order from here on
                self._tiering_hits = None
                log.exception("hits first: reordering failed; vLLM's queue order from now on")
        return super().schedule(*args, **kwargs)  # type: ignore[misc]
