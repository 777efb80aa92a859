"""How fast ``CopyFeeder`` keeps a copy engine fed while another thread runs Python (issue 15).

    python docs/bench_feeder_gil.py [--jobs 1024] [--job-mib 16] [--gbps 51] [--queue-mib 256]
        [--switch-ms 5,0.5] [--baseline COMMIT] [--repeat 3] [--hold-ms 0] [--grow-mib 1024]

No GPU: a stand-in CUDA whose calls give the GIL up and take it back, as torch's and ctypes'
do (a ctypes call of ``getpid``), and a copy engine that works without the GIL: an end event
recorded on the load stream completes at max(now, the previous completion) + the bytes copied
since the last end event / rate, so the engine idles only when the feeder has not enqueued the
next bytes in time. The main thread meanwhile runs Python without a pause (as vLLM's
scheduler does for 20-30 ms of each step of a 1B hit burst on an H100). Each call that gives
the GIL up then waits up to the interpreter's switch interval to take it back. Reported per
feeder (this tree's ``backends/copy_feeder.py``, and ``--baseline``'s from git) and switch
interval: the time to copy every job against the engine's own time (bytes / rate); "+direct"
is this tree's feeder with ``direct`` (a job with room and none waiting enqueued by ``put``'s
caller, as ``load_direct`` makes it in the engine).
``--hold-ms H``: after every 2 ms of Python the main thread also keeps the GIL H ms in one C
call, which no switch interval cuts (on the H100 a fed job waited up to 34 ms for the GIL).

``--single N``: N requests one at a time, as a single CPU hit comes: the main thread puts one
job and runs Python until the job is enqueued (vLLM's engine loop spins, polling, while a
request loads), then the copy engine drains before the next. Reported per feeder mode (the
thread takes every job; ``direct``: the caller enqueues a job that finds room and none waiting)
and switch interval: put to enqueue, median, 90th percentile and longest, in ms.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiering.settings import LOAD_QUEUE_MAX_BYTES  # noqa: E402

_LIBC = ctypes.CDLL(None)


def _cuda_call() -> None:
    """A call into the driver: gives the GIL up and takes it back."""
    _LIBC.getpid()


class _Engine:
    """The copy engine: busy from each end event's enqueue until its bytes are copied."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.busy_until = 0.0
        self.pending = 0  # bytes copied since the last end event

    def end(self) -> float:
        with self.lock:
            self.busy_until = max(time.perf_counter(), self.busy_until) + self.pending / self.rate
            self.pending = 0
            return self.busy_until


ENGINE = _Engine(1.0)


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.t_done = 0.0
        self.blocking = blocking

    def record(self, stream: Any = None) -> None:
        _cuda_call()
        if self.blocking:  # the feeder's end events, on the load stream
            self.t_done = ENGINE.end()

    def query(self) -> bool:
        return time.perf_counter() >= self.t_done

    def synchronize(self) -> None:
        left = self.t_done - time.perf_counter()
        if left > 0:
            time.sleep(left)  # without the GIL, as cudaEventSynchronize
        _cuda_call()

    def elapsed_time(self, other: _Event) -> float:
        return 0.0


class _Stream:
    cuda_stream = 1

    def wait_event(self, ev: _Event) -> None:
        _cuda_call()

    def synchronize(self) -> None:
        pass


def _copy(job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray, handle: int) -> None:
    _cuda_call()
    with ENGINE.lock:
        ENGINE.pending += int(size.sum())


def _load(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(source, name, "exec"), mod.__dict__)  # noqa: S102 - our own file, from git
    return mod


def _busy_python_for(seconds: float) -> None:
    x, t = 0, time.perf_counter() + seconds
    while time.perf_counter() < t:
        for i in range(200):
            x ^= hash((i, x))


class _GilHolder:
    """One C call that keeps the GIL for about ``seconds`` (``sorted`` of a list of ints: no
    bytecode boundary inside, so the switch interval cannot cut it), as an engine's thread does
    in a long C routine (encoding a step's outputs, say)."""

    def __init__(self, seconds: float) -> None:
        self.items: list[int] = []
        if seconds <= 0:
            return
        n = 1 << 14
        while True:
            items = [hash((i, 7)) for i in range(n)]
            t = time.perf_counter()
            sorted(items)
            took = time.perf_counter() - t
            if took >= seconds or n >= 1 << 24:
                self.items = items[:max(1, int(n * seconds / took))]
                return
            n *= 2

    def hold(self) -> None:
        if self.items:
            sorted(self.items)


def _stand_in(rate: float, switch_s: float) -> tuple[float, types.SimpleNamespace]:
    """A fresh engine at ``rate`` and the switch interval set: (the interval before, the
    stand-in torch a feeder is given)."""
    global ENGINE
    ENGINE = _Engine(rate)
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    return old, types.SimpleNamespace(cuda=types.SimpleNamespace(Event=_Event,
                                                                 set_device=lambda d: None))


def run(mod: types.ModuleType, jobs: int, job_bytes: int, rate: float, queue: int,
        switch_s: float, holder: _GilHolder | None = None, grow_to: int = 0,
        direct: bool = False) -> tuple[float, float]:
    """Feed ``jobs`` loads through ``mod.CopyFeeder`` while this thread runs Python (and, with
    ``holder``, a C call that keeps the GIL after every 2 ms of it): (seconds until the last
    byte is copied, seconds the engine itself needs)."""
    old, torch = _stand_in(rate, switch_s)
    params = inspect.signature(mod.CopyFeeder).parameters
    kw: dict[str, Any] = {"grow_to": grow_to} if "grow_to" in params else {}
    if direct:
        kw["direct"] = True
    feeder = mod.CopyFeeder(torch, "cuda:0", _Stream(), queue, _copy, lambda *a: None, **kw)
    a = np.zeros(8, dtype=np.uint64)
    size = np.full(8, job_bytes // 8, dtype=np.uint64)
    try:
        t0 = time.perf_counter()
        for i in range(jobs):  # a burst, put at once as vLLM's worker does in a step or two
            feeder.put(mod.FeedJob(i, a, a, size, job_bytes, _Event()))
        while feeder.pending():  # vLLM's thread: Python, while the feeder works
            _busy_python_for(0.002)
            if holder is not None:
                holder.hold()
        end = ENGINE.busy_until
    finally:
        feeder.close()
        sys.setswitchinterval(old)
    return end - t0, jobs * job_bytes / rate


def single(mod: types.ModuleType, n: int, job_bytes: int, rate: float, switch_s: float,
           direct: bool) -> list[float]:
    """Seconds from ``put`` to the job's copies enqueued, for ``n`` jobs put one at a time while
    this thread runs Python until its job is enqueued."""
    old, torch = _stand_in(rate, switch_s)
    enqueued: list[float] = []
    feeder = mod.CopyFeeder(torch, "cuda:0", _Stream(), 256 << 20, _copy,
                            lambda *a: enqueued.append(time.perf_counter()), direct=direct)
    a = np.zeros(8, dtype=np.uint64)
    size = np.full(8, job_bytes // 8, dtype=np.uint64)
    waits = []
    try:
        for i in range(n):
            t = time.perf_counter()
            feeder.put(mod.FeedJob(i, a, a, size, job_bytes, _Event()))
            while len(enqueued) <= i:  # the engine loop: Python, polling for the load
                _busy_python_for(0.0002)
            waits.append(enqueued[i] - t)
            time.sleep(max(0.0, ENGINE.busy_until - time.perf_counter()) + 0.001)
    finally:
        feeder.close()
        sys.setswitchinterval(old)
    return waits


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1024)
    ap.add_argument("--job-mib", type=float, default=16.0, help="1B: 16, 8B: 64")
    ap.add_argument("--gbps", type=float, default=51.0)
    ap.add_argument("--queue-mib", type=float, default=256.0)
    ap.add_argument("--switch-ms", default="5,0.5")
    ap.add_argument("--baseline", default="", help="a commit whose backends/copy_feeder.py "
                                                  "to compare")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--grow-mib", type=float, default=LOAD_QUEUE_MAX_BYTES / 2**20,
                    help="the most the feeder's limit grows to (feeders that grow it; "
                         "0: a fixed limit)")
    ap.add_argument("--hold-ms", type=float, default=0.0,
                    help="after every 2 ms of Python, the main thread keeps the GIL this long "
                         "in one C call")
    ap.add_argument("--single", type=int, default=0,
                    help="N single requests, one job each: put-to-enqueue latency per mode")
    a = ap.parse_args()
    holder = _GilHolder(a.hold_ms / 1000) if a.hold_ms else None
    root = Path(__file__).resolve().parent.parent
    if a.single:
        mod = _load("feeder_single", (root / "backends" / "copy_feeder.py").read_text())
        print(f"{a.single} single jobs of {a.job_mib:g} MiB; the main thread runs Python until "
              "each is enqueued")
        print(f"{'mode':<8} {'switch':>7} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
        for _ in range(a.repeat):
            for switch_ms in (float(x) for x in a.switch_ms.split(",")):
                for direct in (False, True):
                    w = sorted(single(mod, a.single, int(a.job_mib * 2**20), a.gbps * 1e9,
                                      switch_ms / 1000, direct))
                    print(f"{'direct' if direct else 'thread':<8} {switch_ms:>5.1f}ms "
                          f"{w[len(w) // 2] * 1e3:>10.3f} {w[int(len(w) * 0.9)] * 1e3:>8.3f} "
                          f"{w[-1] * 1e3:>8.3f}", flush=True)
        return
    this = (root / "backends" / "copy_feeder.py").read_text()
    feeders = [("this tree", this, False)]
    if "direct: bool" in this:
        feeders.append(("+direct", this, True))
    if a.baseline:
        feeders.append((a.baseline, subprocess.run(
            ["git", "show", f"{a.baseline}:backends/copy_feeder.py"], check=True,
            capture_output=True, text=True, cwd=root).stdout, False))
    job_bytes = int(a.job_mib * 2**20)
    print(f"{a.jobs} jobs of {a.job_mib:g} MiB, engine {a.gbps:g} GB/s, queue {a.queue_mib:g} "
          "MiB; the main thread runs Python throughout"
          + (f", keeping the GIL {a.hold_ms:g} ms in C after every 2 ms" if holder else ""))
    print(f"{'feeder':<14} {'switch':>7} {'wall s':>8} {'engine s':>9} {'x engine':>9}")
    for r in range(a.repeat):
        for switch_ms in (float(x) for x in a.switch_ms.split(",")):
            for k, (name, source, direct) in enumerate(feeders):
                wall, ideal = run(_load(f"feeder_{r}_{k}_{switch_ms}", source), a.jobs,
                                  job_bytes, a.gbps * 1e9, int(a.queue_mib * 2**20),
                                  switch_ms / 1000, holder, int(a.grow_mib * 2**20), direct)
                print(f"{name:<14} {switch_ms:>5.1f}ms {wall:>8.3f} {ideal:>9.3f} "
                      f"{wall / ideal:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
