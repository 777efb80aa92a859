"""CopyFeeder: at most so many bytes of loads queued on the GPU's copy engine at once.

Why: a host-to-GPU copy runs on a copy engine that takes its work in order. vLLM's model runner
copies each step's inputs (token ids, positions, block tables) host to GPU too, with small
non-blocking copies on its compute stream. Where every load of a burst of cache hits is
enqueued at once (gigabytes: a 100%-hit batch of 256 8B prompts loads 15 GB), a step's input
copies can wait behind all of them, and so does the step: the 8B step trace showed 29-token
steps lasting as long as the loads in flight (docs/benchmarks.md; ``docs/bench_copy_queue.py``
measures the wait on its own). Keeping only ``limit`` bytes enqueued bounds that wait to about
``limit`` / PCIe rate, while the copy engine stays busy as long as loads wait here. Unless
this thread comes back later than the queued loads last: Python's other threads can keep the GIL
longer than any switch interval (in C code), and on an H100 a fed job waited up to 34 ms for it
while 256 MiB of loads last 5 ms. So each time the feeder finds every enqueued load done while
another waited (``ran_dry``), the limit doubles, up to ``grow_to`` (``LOAD_QUEUE_MAX_BYTES``).

How: ``CudaCopier`` builds a load's descriptors on vLLM's worker thread and records there an
event on the compute stream (the work the load must come after: the blocks it overwrites may
have been read by the step before); it hands both to ``put``. Jobs are enqueued in submission
order: a job's copies, between a start and an end event, on the load stream, after the job's
event. One feeder thread enqueues them; before it enqueues a job it waits
(``Event.synchronize``, without the GIL) until the bytes enqueued and not yet copied leave room
for it; a job larger than ``limit`` is enqueued alone. An enqueued job is handed to the copier
(``started``), which reports it finished by its end event, as any other job.

``waves``: room opens only once the queue is empty. A wave is the jobs enqueued from an empty
queue until the next one would take the wave past ``limit`` bytes; after that nothing more is
enqueued until every job of the wave is done. Why: on an H100 the copy engine did not turn to
another stream's copy while the load stream had copies queued. There (docs/benchmarks.md, "An H100,
2026-12-07g") a step's 64 KiB input copy, enqueued 10 ms into 8 GiB of loads fed one 64 MiB job
as each one ended (at most 1 GiB enqueued, the queue never empty), finished only with the last
load, 155 ms later; with the loads enqueued 256 MiB at a time and the queue let empty between
waves it waited 3.2 ms, at 98.5% of the rate. vLLM's steps copy inputs host to GPU too, and in
11 of the 12 traced 8B 100%-hit batches on H100s one step was held until the last load landed
(62-272 ms). A wave bounds that wait to one wave's time. Growth (below) applies to waves too:
the feeder is late when it comes back, without having waited, to a queue already empty while
loads waited; a wave it waited for empties the queue on purpose and does not count. Its return
from that wait (the GIL taken back) is not seen: waves grow only where the feeder came back
late by other ways.

``direct``: a job that finds no job waiting before it and room in the queue is enqueued by the
caller, in ``put``, as vLLM's own spec enqueues its loads. Why: the hop to the feeder thread
costs the GIL each time the thread takes it back (about six times a job), and while a request
loads, vLLM's engine loop runs Python without a pause, so each take waits up to the switch
interval: in a model of it a single load waited 0.61 ms (median) to 5.7 ms to be enqueued,
0.02 ms direct (docs/benchmarks.md, "The build machine, 2026-12-07f: the hop to the feeder").
Only one thread enqueues at a time (``_enqueuing``), so the order on the stream is the order
of ``started``, and both paths count the same queue (``_inflight``). A job put while another
waits keeps its place behind it.

Contract: ``put`` never waits for room or for the feeder thread, and raises only once closed;
with ``direct`` it may make the job's CUDA calls itself (tens of microseconds). An error of the
copier's ``started`` is logged, never raised, on either path. A job whose copy API call failed
(``CopyFailed``), or that met any other error of the CUDA calls around it (a wait, an event),
is waited for, on the feeder thread, until nothing of it is in flight, and listed by
``take_failed`` (the copier reports it as a failed job; the vLLM worker turns that into a miss);
the thread goes on with the next job, so no waiter hangs. ``wait_fed(ids)`` returns once none
of ``ids`` is still waiting here. ``close`` enqueues what is queued, then stops the thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiering.backends.block_copy import CopyFailed
from tiering.thread_names import name_os_thread

log = logging.getLogger(__name__)

# (job id, sources, destinations, sizes, stream handle): enqueue a job's copies
CopyFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray, int], None]
# (job id, bytes, start event, end event): the job is enqueued
StartedFn = Callable[[int, int, Any, Any], None]


@dataclass
class FeedJob:
    job_id: int
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    nbytes: int
    after: Any  # a torch.cuda.Event on the submitting thread's stream
    # its enqueue by the caller (direct) failed: the feeder thread waits until nothing of it
    # is in flight and lists it, as it does for a job of its own
    enqueue_failed: bool = False


class CopyFeeder:
    def __init__(self, torch: Any, device: Any, stream: Any, limit: int, copy: CopyFn,
                 started: StartedFn, name: str = "load", grow_to: int = 0,
                 direct: bool = False, waves: bool = False) -> None:
        if limit <= 0:
            raise ValueError(f"limit: expected a positive byte count, got {limit}")
        self.torch, self.device, self.stream, self.limit = torch, device, stream, limit
        # the limit doubles, up to grow_to, each time the queue ran dry while loads waited
        # (the feeder came back later than the queued loads lasted); 0: a fixed limit
        self.grow_to = grow_to
        self.direct = direct  # a job with room and none before it is enqueued in put
        # room only from an empty queue, up to limit bytes a wave (see the module's docstring)
        self.waves = waves
        self.waves_started = 0  # waves begun (with ``waves``): each one ended with the queue empty
        self.ran_dry = 0  # times the copy engine had done every enqueued load while one waited
        self.waits = 0  # times the feeder waited for room (a measure of the limit binding)
        self.enqueued_direct = 0  # jobs enqueued by put's caller
        self._copy, self._started = copy, started
        self._cond = threading.Condition()
        # under _cond: jobs not yet enqueued; failed job ids; (bytes, end event) of the jobs
        # enqueued and maybe still copying, in enqueue order, and their bytes; whether a
        # thread is enqueuing a job now (the feeder, or put's caller)
        self._pending: deque[FeedJob] = deque()
        self._failed: list[int] = []
        self._inflight: deque[tuple[int, Any]] = deque()
        self._queued = 0
        # with waves: bytes enqueued since the queue was last empty. A wave closes by itself when
        # a job does not fit: that job stays first in line (put's caller enqueues only where none
        # waits), so nothing is enqueued before it, and it fits only once the queue is empty
        self._wave_bytes = 0
        self._enqueuing = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"tier-feed-{name}",
                                        daemon=True)
        self._thread.start()

    def put(self, job: FeedJob) -> None:
        with self._cond:
            if self._stop:
                raise RuntimeError("the copy feeder is closed")
            if not (self.direct and not self._pending and not self._enqueuing
                    and self._room_checked(job.nbytes)):
                self._pending.append(job)
                self._cond.notify_all()
                return
            self._enqueuing = True
        try:
            start, end = self._enqueue(job)
        except Exception as exc:  # the feeder thread makes it a failed job, as one of its own
            if not isinstance(exc, CopyFailed):
                log.exception("copy feeder: job %d failed", job.job_id)
            job.enqueue_failed = True
            with self._cond:
                self._enqueuing = False
                # first: jobs put meanwhile are not enqueued behind its copies before the
                # stream is drained
                self._pending.appendleft(job)
                self._cond.notify_all()
            return
        self._hand_over(job, start, end)  # before another job is enqueued
        with self._cond:
            self._add_inflight(job.nbytes, end)
            self._enqueuing = False
            self.enqueued_direct += 1
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def take_failed(self) -> list[int]:
        with self._cond:
            failed, self._failed = self._failed, []
        return failed

    def wait_fed(self, job_ids: set[int]) -> None:
        with self._cond:
            while any(j.job_id in job_ids for j in self._pending):
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    # -- under _cond ------------------------------------------------------------------------
    def _forget_done(self) -> None:
        """Drop the enqueued jobs the copy engine has finished (they end in order)."""
        while self._inflight and self._inflight[0][1].query():
            self._queued -= self._inflight.popleft()[0]

    def _room_for(self, nbytes: int) -> bool:
        """Whether a job of ``nbytes`` may be enqueued now: the queue is empty, or it fits
        (with ``waves``: into the bytes of the wave in flight)."""
        self._forget_done()
        if not self._inflight:
            return True
        if not self.waves:
            return self._queued + nbytes <= self.limit
        return self._wave_bytes + nbytes <= self.limit

    def _add_inflight(self, nbytes: int, end: Any) -> None:
        """A job is enqueued: counted against the queue (and its wave)."""
        if not self._inflight:  # enqueued into an empty queue: a new wave
            self._wave_bytes = 0
            self.waves_started += self.waves
        self._inflight.append((nbytes, end))
        self._queued += nbytes
        self._wave_bytes += nbytes

    def _room_checked(self, nbytes: int) -> bool:
        """``_room_for`` on put's caller: an error of an event's query is no room, so the job
        waits for the feeder thread, which meets the same error and lists the job as failed
        (put never raises it)."""
        try:
            return self._room_for(nbytes)
        except Exception:
            return False

    # -- both paths ---------------------------------------------------------------------------
    def _hand_over(self, job: FeedJob, start: Any, end: Any) -> None:
        """The copier's ``started``; an error there is logged, never raised: the job's copies
        are enqueued and counted either way, and no thread is left holding the turn."""
        try:
            self._started(job.job_id, job.nbytes, start, end)
        except Exception:
            log.exception("copy feeder: handing job %d over to the copier failed", job.job_id)

    def _enqueue(self, job: FeedJob) -> tuple[Any, Any]:
        """The job's copies between a start and an end event, on the load stream, after the
        work it waits for. The caller holds ``_enqueuing``."""
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True, blocking=True)
        self.stream.wait_event(job.after)
        start.record(self.stream)
        self._copy(job.job_id, job.src, job.dst, job.size, self.stream.cuda_stream)
        end.record(self.stream)
        return start, end

    # -- the feeder thread -------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(threading.current_thread().name)
        torch = self.torch
        try:
            torch.cuda.set_device(self.device)
        except Exception:  # the copies below then fail, job by job, and are listed
            log.exception("copy feeder: cannot use %s", self.device)
        waited_behind = False  # another load waited when the last one was enqueued
        while True:
            with self._cond:
                if not self._pending:
                    waited_behind = False  # the burst ended: an idle engine is not a late feeder
                while (not self._pending or self._enqueuing) and not self._stop:
                    self._cond.wait()
                while self._enqueuing:  # closing: put's caller is still enqueuing its job
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._pending[0]
                self._enqueuing = True
            try:
                if job.enqueue_failed:
                    raise CopyFailed(f"job {job.job_id}: its enqueue by put's caller failed")
                waited, behind = self._wait_for_room(job.nbytes)
                # the engine ran dry if loads it still had when this thread last left it were
                # all done when it came back: behind the load it waited for, or, without a
                # wait, behind the last one it enqueued. Waiting for the last load in flight
                # (a job that needs all the room) empties the queue on purpose: not late.
                with self._cond:
                    self._forget_done()
                    dry = not self._inflight and bool(behind if waited else waited_behind)
                if dry:
                    self._ran_dry()
                start, end = self._enqueue(job)
            except Exception as exc:  # CopyFailed, or any CUDA error: this job is a miss
                if not isinstance(exc, CopyFailed):
                    log.exception("copy feeder: job %d failed", job.job_id)
                try:
                    self.stream.synchronize()  # nothing of the job in flight any more
                except Exception:  # a broken stream: what was enqueued is not waited for
                    log.exception("copy feeder: the load stream cannot be synchronized")
                waited_behind = False  # drained on purpose: not a queue that ran dry
                with self._cond:
                    # their events are the copier's to report; room is not counted against a
                    # stream that was drained or is broken
                    self._inflight.clear()
                    self._queued = 0
                    self._pending.popleft()
                    self._failed.append(job.job_id)
                    self._enqueuing = False
                    self._cond.notify_all()
                continue
            # handed to the copier before it leaves the queue: wait_fed then finds it there
            self._hand_over(job, start, end)
            with self._cond:
                self._add_inflight(job.nbytes, end)
                self._pending.popleft()
                waited_behind = bool(self._pending)
                self._enqueuing = False
                self._cond.notify_all()

    def _wait_for_room(self, nbytes: int) -> tuple[bool, int]:
        """Wait (without the GIL) for the oldest enqueued jobs until ``nbytes`` fit (with
        ``waves``: for the newest, until the queue is empty); whether it waited, and how many
        loads were queued behind the last one it waited for."""
        waited, behind = False, 0
        while True:
            with self._cond:
                if self._room_for(nbytes):
                    return waited, behind
                if self.waves:  # the wave drains on purpose: nothing queued behind its end
                    end, behind = self._inflight[-1][1], 0
                else:
                    end = self._inflight[0][1]
                    behind = len(self._inflight) - 1  # still queued behind the one waited for
            self.waits += 1
            end.synchronize()  # the GIL is released while the copy engine works
            waited = True
    def _ran_dry(self) -> None:
        """Every enqueued load was done while the next one waited here: the copy engine idled
        for as long as this thread was late (waiting for the GIL: on the H100 of 2026-12-06b up
        to 34 ms, while 256 MiB of loads last 5 ms). Double the limit, up to ``grow_to``: a
        queue that outlasts the waits keeps the engine busy, and still bounds how long a step's
        input copies wait behind it."""
        self.ran_dry += 1
        if self.limit < self.grow_to:
            self.limit = min(self.grow_to, self.limit * 2)
            log.info("vllm-tiering: the loads' queue ran dry %d time(s) while loads waited for "
                     "the feeder thread; up to %d MiB of loads are enqueued at once from now on",
                     self.ran_dry, self.limit >> 20)
