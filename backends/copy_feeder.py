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

``wave_streams`` (lanes): waves take several load streams in turn, one wave a stream at most.
Why: on one stream the copy engine idles at each wave's end until this thread has the GIL back
and enqueues the next wave. Inside vLLM (8B, 100% CPU hits, an H100) waves grew to 1 GiB (the
feeder came back late), steps were held 20 ms at most (70 ms without waves), but the loads took
about 10% longer: some 20 such boundaries a batch. In ``docs/bench_copy_queue.py`` on an H100
(8 GiB of loads in 64 MiB jobs, a step's copies every 10 ms) a step waited 1.8-2.1 ms (median;
5.1 ms at most) behind 256 MiB waves on one stream, at 50.6-50.9 GB/s, 10.3-10.6 ms (20.6 ms)
behind 1 GiB waves, at 51.2-51.4 GB/s, and 10.2 ms (10.3-10.8 ms) behind 256 MiB waves on two
streams in turn, a wave queued on one stream while the other one's wave copies: 51.8 GB/s, the
rate of a queue never let empty (behind which the step waited 155 ms). The rule: a job joins the
open wave (the newest one) on its stream while that wave's bytes and its own stay within
``limit``, or it begins a new wave on a stream with nothing in flight, the streams taken in turn
(the open wave closes; a job over the limit is a wave of its own). With one stream that is
``waves`` above; with two, at most two waves are in flight and a step's copies wait about two
waves. With no stream free this thread waits for the oldest wave's end; it ran dry if, back from
that wait, the open wave had ended too (the engine had nothing to copy). Not yet run in vLLM on
a GPU: one stream by default (tiering.settings ``LOAD_WAVE_STREAMS``).

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
from collections.abc import Callable, Sequence
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


class _Lane:
    """A load stream and the jobs enqueued on it and maybe still copying: (bytes, end event) in
    enqueue order, which is the order they end in (one stream)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.inflight: deque[tuple[int, Any]] = deque()
        self.wave = 0  # with waves: the number (waves_started) of the wave its jobs belong to


class CopyFeeder:
    def __init__(self, torch: Any, device: Any, stream: Any, limit: int, copy: CopyFn,
                 started: StartedFn, name: str = "load", grow_to: int = 0,
                 direct: bool = False, waves: bool = False,
                 wave_streams: Sequence[Any] = ()) -> None:
        if limit <= 0:
            raise ValueError(f"limit: expected a positive byte count, got {limit}")
        if len(wave_streams) > 1 and not waves:
            raise ValueError("wave_streams: several load streams take turns by waves only "
                             "(waves=True)")
        self.torch, self.device, self.limit = torch, device, limit
        # the load streams jobs go on, each with its jobs in flight: ``stream`` alone, or, with
        # waves, ``wave_streams`` in its place, in turn, a wave each at most (module docstring)
        self._lanes = [_Lane(s) for s in (wave_streams or [stream])]
        # the limit doubles, up to grow_to, each time the queue ran dry while loads waited
        # (the feeder came back later than the queued loads lasted); 0: a fixed limit
        self.grow_to = grow_to
        self.direct = direct  # a job with room and none before it is enqueued in put
        # room only from an empty queue, up to limit bytes a wave (see the module's docstring)
        self.waves = waves
        self.waves_started = 0  # waves begun (with ``waves``), each on a load stream then empty
        self.ran_dry = 0  # times the copy engine had done every enqueued load while one waited
        self.waits = 0  # times the feeder waited for room (a measure of the limit binding)
        self.enqueued_direct = 0  # jobs enqueued by put's caller
        self._copy, self._started = copy, started
        self._cond = threading.Condition()
        # under _cond: jobs not yet enqueued; failed job ids; the lanes' jobs in flight (above)
        # and their bytes; whether a thread is enqueuing a job now (the feeder, or put's caller)
        self._pending: deque[FeedJob] = deque()
        self._failed: list[int] = []
        self._queued = 0
        # with waves: the lane of the open wave (the newest; the first wave goes on lane 0) and
        # the bytes enqueued in it since its lane was last empty. A wave closes by itself when
        # a job does not fit: that job stays first in line (put's caller enqueues only where none
        # waits), so nothing is enqueued before it, and it fits only on an empty lane
        self._open = len(self._lanes) - 1
        self._wave_bytes = 0
        self._enqueuing = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"tier-feed-{name}",
                                        daemon=True)
        self._thread.start()

    @property
    def stream(self) -> Any:
        """The first load stream (the only one without ``wave_streams``)."""
        return self._lanes[0].stream

    @stream.setter
    def stream(self, stream: Any) -> None:
        self._lanes[0].stream = stream

    def put(self, job: FeedJob) -> None:
        with self._cond:
            if self._stop:
                raise RuntimeError("the copy feeder is closed")
            lane = None
            if self.direct and not self._pending and not self._enqueuing:
                lane = self._room_checked(job.nbytes)
            if lane is None:
                self._pending.append(job)
                self._cond.notify_all()
                return
            self._enqueuing = True  # the lane stays as checked: only this thread enqueues
        try:
            start, end = self._enqueue(job, lane)
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
            self._add_inflight(lane, job.nbytes, end)
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
        """Drop the enqueued jobs the copy engine has finished (in order, lane by lane)."""
        for lane in self._lanes:
            while lane.inflight and lane.inflight[0][1].query():
                self._queued -= lane.inflight.popleft()[0]

    def _room_for(self, nbytes: int) -> int | None:
        """The lane a job of ``nbytes`` may be enqueued on now, or None. Without ``waves``: the
        queue is empty, or the job fits. With ``waves``: it joins the open wave, in flight on
        its lane, if it fits the bytes of that wave; else a new wave starts on a lane with
        nothing in flight, the lanes taken in turn after the open wave's."""
        self._forget_done()
        if not self.waves:
            first = self._lanes[0]
            return 0 if not first.inflight or self._queued + nbytes <= self.limit else None
        if self._lanes[self._open].inflight and self._wave_bytes + nbytes <= self.limit:
            return self._open
        n = len(self._lanes)
        for k in range(1, n + 1):
            i = (self._open + k) % n
            if not self._lanes[i].inflight:
                return i
        return None

    def _add_inflight(self, i: int, nbytes: int, end: Any) -> None:
        """A job is enqueued on lane ``i``: counted against the queue (and its wave). Enqueued
        on an empty lane it began a wave there, which is the open one from now on."""
        lane = self._lanes[i]
        if not lane.inflight:
            self._open, self._wave_bytes = i, 0
            self.waves_started += self.waves
            lane.wave = self.waves_started
        lane.inflight.append((nbytes, end))
        self._queued += nbytes
        self._wave_bytes += nbytes

    def _room_checked(self, nbytes: int) -> int | None:
        """``_room_for`` on put's caller: an error of an event's query is no room, so the job
        waits for the feeder thread, which meets the same error and lists the job as failed
        (put never raises it)."""
        try:
            return self._room_for(nbytes)
        except Exception:
            return None

    # -- both paths ---------------------------------------------------------------------------
    def _hand_over(self, job: FeedJob, start: Any, end: Any) -> None:
        """The copier's ``started``; an error there is logged, never raised: the job's copies
        are enqueued and counted either way, and no thread is left holding the turn."""
        try:
            self._started(job.job_id, job.nbytes, start, end)
        except Exception:
            log.exception("copy feeder: handing job %d over to the copier failed", job.job_id)

    def _enqueue(self, job: FeedJob, lane: int) -> tuple[Any, Any]:
        """The job's copies between a start and an end event, on its lane's load stream, after
        the work it waits for. The caller holds ``_enqueuing``."""
        stream = self._lanes[lane].stream
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True, blocking=True)
        stream.wait_event(job.after)
        start.record(stream)
        self._copy(job.job_id, job.src, job.dst, job.size, stream.cuda_stream)
        end.record(stream)
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
                lane, waited, behind = self._wait_for_room(job.nbytes)
                # the engine ran dry if loads it still had when this thread last left it were
                # all done when it came back: behind the load it waited for, or, without a
                # wait, behind the last one it enqueued. Waiting for the last load in flight
                # (a job that needs all the room, a wave on the only lane) empties the queue on
                # purpose: not late. With lanes, the open wave was behind the one waited for.
                with self._cond:
                    self._forget_done()
                    dry = (not any(ln.inflight for ln in self._lanes)
                           and bool(behind if waited else waited_behind))
                # (an engine that serves two streams side by side may have ended the open wave
                # first, while this thread waited: counted too; growth stops at grow_to)
                if dry:  # every lane empty: the job begins a wave, never grows one mid-way
                    self._ran_dry()
                start, end = self._enqueue(job, lane)
            except Exception as exc:  # CopyFailed, or any CUDA error: this job is a miss
                if not isinstance(exc, CopyFailed):
                    log.exception("copy feeder: job %d failed", job.job_id)
                for ln in self._lanes:  # the job's copies may be on any lane: drain them all
                    try:
                        ln.stream.synchronize()  # nothing of the job in flight any more
                    except Exception:  # a broken stream: what was enqueued is not waited for
                        log.exception("copy feeder: a load stream cannot be synchronized")
                waited_behind = False  # drained on purpose: not a queue that ran dry
                with self._cond:
                    # their events are the copier's to report; room is not counted against
                    # streams that were drained or are broken: the next job begins a wave
                    for ln in self._lanes:
                        ln.inflight.clear()
                    self._queued = 0
                    self._pending.popleft()
                    self._failed.append(job.job_id)
                    self._enqueuing = False
                    self._cond.notify_all()
                continue
            # handed to the copier before it leaves the queue: wait_fed then finds it there
            self._hand_over(job, start, end)
            with self._cond:
                self._add_inflight(lane, job.nbytes, end)
                self._pending.popleft()
                waited_behind = bool(self._pending)
                self._enqueuing = False
                self._cond.notify_all()

    def _wait_for_room(self, nbytes: int) -> tuple[int, bool, int]:
        """Wait (without the GIL) for the oldest enqueued jobs until ``nbytes`` fit (with
        ``waves``: for the oldest wave's last job, until its lane is empty); the lane the job
        may go on, whether it waited, and how many loads were queued behind the last one it
        waited for (with waves: the other lanes' waves, none with one lane)."""
        waited, behind = False, 0
        while True:
            with self._cond:
                lane = self._room_for(nbytes)
                if lane is not None:
                    return lane, waited, behind
                if self.waves:  # no lane free: the oldest wave (a closed one) drains on purpose
                    oldest = min((ln for ln in self._lanes if ln.inflight),
                                 key=lambda ln: ln.wave)
                    end = oldest.inflight[-1][1]
                    behind = sum(len(ln.inflight) for ln in self._lanes if ln is not oldest)
                else:
                    first = self._lanes[0].inflight
                    end = first[0][1]
                    behind = len(first) - 1  # still queued behind the one waited for
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
