"""Each step's forward pass timed on the worker, for the promotion advisor's prefill model.

The scheduler side cannot see when the GPU runs a step: vLLM launches a step's kernels on the
scheduler thread and takes its output a step later, so a step timed there holds launches held
up by a full launch queue and the steps queued around it (``tiering.step_clock.StepClock``).
The worker can: an event recorded on the compute stream before the step's kernels and one after
them span exactly that step on the GPU, from the moment the step before it was done.

How a time travels (all under our connector, ``TieredOffloadingConnector``):

1. scheduler side, ``build_connector_meta``: the advisor numbers the step it just scheduled
   (``PromotionAdvisor.forward_step``, which keeps the step's prompt tokens and attention
   term under that number) and the number rides in the step's connector metadata
   (``STEP_NUMBER_FIELD``);
2. worker, ``bind_connector_metadata`` (before the forward pass) and
   ``build_connector_worker_meta`` (after it, in the same step): ``ForwardTimer.begin`` and
   ``end`` record the two events; the same ``build_connector_worker_meta`` reports the steps
   whose end event has completed by then (``finished``: a query each, never a wait), so a step
   is reported one or two steps after its own, in a ``StepTimedWorkerMetadata``;
3. scheduler side, ``update_connector_output``: the times go to the advisor
   (``PromotionAdvisor.forward_times``), which fits a prompt step's time to its tokens.

On vLLM's CPU platform the forward pass runs on the worker thread itself, and the two times are
the thread's clock. Nothing here raises into vLLM: a timer that fails logs once and stops
timing (the advisor then stays on the outputs' clock), and a worker with several ranks reports
each rank's time, the slowest one kept (``StepTimedWorkerMetadata.aggregate``).

Worker thread only (``ForwardTimer``); the metadata is built there and read on the scheduler
thread after vLLM carried it across.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

from tiering.vllm.compat import is_cuda_platform

log = logging.getLogger(__name__)

# The attribute of vLLM's connector metadata that carries a step's number to the worker
STEP_NUMBER_FIELD = "tiering_step"
# Steps begun and not yet reported: a worker whose events never complete (a hung stream) stops
# keeping more than this many; the oldest are dropped untimed
PENDING_LIMIT = 64


@dataclass
class StepTimedWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata of the offloading connector (completed jobs, transfer stats)
    plus our forward-pass seconds by step number."""

    step_seconds: dict[int, float] = field(default_factory=dict)

    @classmethod
    def wrap(cls, meta: OffloadingWorkerMetadata | None,
             step_seconds: dict[int, float]) -> StepTimedWorkerMetadata:
        """``meta`` (vLLM's, or None: nothing completed) with ``step_seconds`` added."""
        if meta is None:
            return cls(step_seconds=dict(step_seconds))
        own = {f.name: getattr(meta, f.name) for f in fields(OffloadingWorkerMetadata)}
        return cls(**own, step_seconds=dict(step_seconds))

    def aggregate(self, other: Any) -> StepTimedWorkerMetadata:
        """Another rank's metadata added: vLLM's fields as vLLM adds them, each step's time
        the longest of the ranks' (the step ends when its slowest rank does)."""
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        seconds = dict(self.step_seconds)
        for number, s in getattr(other, "step_seconds", {}).items():
            seconds[number] = max(s, seconds.get(number, s))
        return StepTimedWorkerMetadata.wrap(merged, seconds)


class ForwardTimer:
    """The worker's forward passes, timed by events on the compute stream (CUDA) or the
    thread's clock (vLLM's CPU platform). ``begin`` before a step's forward pass, ``end``
    after it, ``finished`` for the steps done since the last call."""

    def __init__(self, cuda: bool | None = None) -> None:
        self._cuda = cuda  # decided at the first begin() unless given
        self._open: tuple[int, Any] | None = None  # (number, start mark) of the step begun
        self._pending: deque[tuple[int, Any, Any]] = deque()  # (number, start, end), oldest first
        self._failed = False
        self.timing = False  # has a step been begun (the scheduler side numbers steps)?

    def begin(self, number: int) -> None:
        """The step numbered ``number`` is about to launch its forward pass."""
        self.timing = True
        if self._failed:
            return
        try:
            if self._cuda is None:
                self._cuda = is_cuda_platform()
            self._open = (number, self._mark())
        except Exception:
            self._fail("begin")

    def end(self) -> None:
        """The forward pass of the step begun last has been launched (CUDA) or run (CPU)."""
        if self._open is None or self._failed:
            return
        number, start = self._open
        self._open = None
        try:
            self._pending.append((number, start, self._mark()))
        except Exception:
            self._fail("end")
            return
        while len(self._pending) > PENDING_LIMIT:
            self._pending.popleft()

    def finished(self) -> dict[int, float]:
        """Seconds of each step whose forward pass is done, by number, in step order; a step
        still running stops the scan (the ones after it are not done either)."""
        done: dict[int, float] = {}
        try:
            while self._pending:
                number, start, end = self._pending[0]
                if self._cuda:
                    if not end.query():
                        break
                    seconds = start.elapsed_time(end) / 1000.0
                else:
                    seconds = end - start
                self._pending.popleft()
                seconds = float(seconds)
                if 0.0 < seconds < math.inf:  # else no time: never a zero in its place
                    done[number] = seconds
        except Exception:
            self._fail("finished")
        return done

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current (compute) stream, after what it has queued
        return event

    def _fail(self, where: str) -> None:
        log.warning("vllm-tiering: timing the forward passes failed in %s; the promotion "
                    "advisor times the steps by their outputs from now on", where, exc_info=True)
        self._failed = True
        self._open = None
        self._pending.clear()
