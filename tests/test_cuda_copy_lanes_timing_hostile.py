"""Hostile test: what ``CudaCopier`` reports of fed loads on two wave streams
(``load_wave_streams`` 2), over a virtual-clock stand-in for torch and the CUDA runtime.

The stand-in engine is the one the feeder's docstring describes for the H100: one copy engine
that takes the host-to-GPU copies in the order they were enqueued, whatever their stream (it
does not turn to another stream's copy while one has copies queued). An event completes when
the work before it on its stream has; ``elapsed_time`` is the difference of those times. Host
enqueues take no virtual time; a host wait (``synchronize``) moves the clock to the event.

Every load's time (``Finished.seconds``, which the worker hands to vLLM as the transfer's time)
and its trace span (``copy`` rows: ``step_trace._late`` counts a job that spans beyond its bytes
as "late", the feeder having left the engine idle inside it) should be its own copy's time
where the engine never idled. On one stream that holds; on two, the first job of a wave on the
second stream has its start event recorded on an idle stream, so its span begins while the
other stream's wave still copies: it reports the time it sat queued behind that wave.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types

import numpy as np
import pytest
from test_copy_segments_hostile import FakeCuda, install_fake_cuda

JOB_BYTES = 4096
JOB_MS = 5.0  # one job's copy on the engine (256 MiB at ~50 GB/s)


class Clock:
    """Virtual time in ms; one copy engine, first enqueued first served."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.now = 0.0
        self.engine_free = 0.0
        self.tail: dict[int, float] = {}  # stream handle -> when its work so far completes

    def copy(self, handle: int, nbytes: int) -> None:
        with self.lock:
            begin = max(self.now, self.engine_free, self.tail.get(handle, 0.0))
            end = begin + JOB_MS * nbytes / JOB_BYTES
            self.engine_free = end
            self.tail[handle] = end


CLOCK = Clock()


class VStream:
    n = 0

    def __init__(self, device=None) -> None:
        VStream.n += 1
        self.cuda_stream = 0x5000 + VStream.n

    def _tail(self) -> float:
        return CLOCK.tail.get(self.cuda_stream, 0.0)

    def wait_event(self, ev) -> None:
        with CLOCK.lock:
            if ev is not None and ev.t is not None:
                CLOCK.tail[self.cuda_stream] = max(self._tail(), ev.t)

    def wait_stream(self, other) -> None:
        with CLOCK.lock:
            CLOCK.tail[self.cuda_stream] = max(self._tail(), other._tail())

    def synchronize(self) -> None:
        with CLOCK.lock:
            CLOCK.now = max(CLOCK.now, self._tail())


COMPUTE = VStream()


class VEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.t: float | None = None

    def record(self, stream=None) -> None:
        stream = stream or COMPUTE
        with CLOCK.lock:
            self.t = max(CLOCK.now, stream._tail())

    def query(self) -> bool:
        with CLOCK.lock:
            return self.t is None or self.t <= CLOCK.now

    def synchronize(self) -> None:
        with CLOCK.lock:
            CLOCK.now = max(CLOCK.now, self.t or 0.0)

    def elapsed_time(self, other) -> float:
        return other.t - self.t


def _virtual_torch() -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.device = lambda d=None: d
    torch.version = types.SimpleNamespace(cuda="12.8")

    def sync_all(device=None) -> None:
        with CLOCK.lock:
            CLOCK.now = max([CLOCK.now, *CLOCK.tail.values()])

    torch.cuda = types.SimpleNamespace(
        Stream=VStream, Event=VEvent, current_stream=lambda device=None: COMPUTE,
        synchronize=sync_all, stream=lambda s: contextlib.nullcontext(),
        set_device=lambda device: None)
    return torch


@pytest.fixture
def virtual_copier(monkeypatch):
    """``make(**kw)``: a real ``CudaCopier`` over the virtual engine, with host rows and a
    device arena of numpy memory; the copies' bytes move (memmove) as they are enqueued."""
    from tiering.backends import cuda_copy

    global CLOCK
    CLOCK = Clock()
    made = []

    def make(**kw):
        host = np.arange(1 << 15, dtype=np.uint8)
        dev = np.zeros(1 << 15, dtype=np.uint8)
        fake = FakeCuda(batch_api=True)
        fake.arenas.append((dev.ctypes.data, dev.ctypes.data + dev.nbytes))
        batch = fake.rt.cudaMemcpyBatchAsync

        def timed(d, s, n, count, attrs, idx, n_attrs, stream):
            CLOCK.copy(stream, int(sum(n[:count])))
            return batch(d, s, n, count, attrs, idx, n_attrs, stream)

        fake.rt.cudaMemcpyBatchAsync = timed
        install_fake_cuda(monkeypatch, fake, _virtual_torch())
        copier = cuda_copy.CudaCopier(host.ctypes.data, host.nbytes, copy="dma", api="bindings",
                                      **kw)
        made.append(copier)
        return copier, host, dev

    yield make
    for c in made:
        c.shutdown()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_fed_loads_time_and_trace_span_are_its_own_copy_on_two_wave_streams(
        virtual_copier, monkeypatch, lanes):
    """Four 5 ms loads submitted at once, waves of two (the limit), the engine busy without a
    gap from 0 to 20 ms: each load copied for 5 ms and none was late. On one load stream each
    reports 5 ms and ``_late`` finds nothing. On two, load 3 (the second wave's first job, on
    the second stream) begins its span at 0 ms, while wave one still copies, and reports 15 ms:
    vLLM's transfer-time counter gets 30 ms for 20 ms of copies, and the step trace calls the
    job 10 ms late, the symptom the trace reads as a feeder that left the engine idle, in the
    very mode built so that it never does."""
    from tiering import step_trace
    from tiering.step_trace import _late

    rows: list[dict] = []
    monkeypatch.setattr(step_trace.TRACE, "on", True)
    monkeypatch.setattr(step_trace.TRACE, "add", lambda kind, **f: rows.append({"k": kind, **f}))
    copier, host, dev = virtual_copier(load_queue_bytes=2 * JOB_BYTES, load_direct=True,
                                       load_waves=True, load_wave_streams=lanes)
    ids = [1, 2, 3, 4]
    for k, job_id in enumerate(ids):
        copier.submit(job_id, np.array([host.ctypes.data + JOB_BYTES * k], dtype=np.uint64),
                      np.array([dev.ctypes.data + JOB_BYTES * k], dtype=np.uint64),
                      np.array([JOB_BYTES], dtype=np.uint64), "load")
    copier._feeder.wait_fed(set(ids))
    done: list = []
    deadline = time.monotonic() + 5
    while len(done) < len(ids) and time.monotonic() < deadline:
        with CLOCK.lock:
            CLOCK.now += 1.0
        done += copier.get_finished()
        time.sleep(0.001)
    assert sorted(f.job_id for f in done) == ids and all(f.ok for f in done)
    assert bytes(dev[:4 * JOB_BYTES]) == bytes(host[:4 * JOB_BYTES])
    assert CLOCK.engine_free == pytest.approx(4 * JOB_MS), "the engine idled: not this case"
    seconds = {f.job_id: round(f.seconds * 1e3, 3) for f in done}
    copies = [r for r in rows if r["k"] == "copy" and r["dir"] == "load"]
    late_s, late_n = _late(copies)
    assert (seconds, late_n) == ({j: JOB_MS for j in ids}, 0), (
        f"reported ms per load {seconds} (a load's time includes the other stream's wave); "
        f"step trace: {late_s * 1e3:.1f} ms late over {late_n} job(s) of a never-idle engine")
