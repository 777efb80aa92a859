"""A timeline of the engine core's steps and of the copy jobs on the GPU, for finding where a
batch's time goes. Off unless the environment names a file:

    TIERING_STEP_TRACE=trace/run vllm serve ... --scheduler-cls tiering.vllm.scheduler.TieringScheduler
    python -m tiering.step_trace trace/run.*.jsonl [--from T0 --to T1]

What is recorded, each row with ``time.perf_counter()`` seconds (the system's monotonic clock,
the same in every process of the machine):

* ``schedule`` — one per ``Scheduler.schedule`` call under ``TieringScheduler``: when it began
  and ended, the thread's CPU time in it, the tokens and requests it scheduled, the load and
  store jobs it issued, the requests still waiting;
* ``update`` — ``update_from_output``: when, and how many loads it was told had landed;
* ``submit`` — our worker handing a job to its copier: when, how long, the thread's CPU time in
  it, direction, blocks;
* ``copy`` — a copy job seen finished: its span on the GPU (from its CUDA events, put on the host
  clock through an event recorded when the copier started), direction and bytes;
* ``mark`` — once a step, when our worker is asked for finished jobs (vLLM asks after it
  enqueued the step's forward pass): the host time (``t``) and, from a CUDA event recorded then
  on the compute stream, when the GPU got there (``g``); the summary times each pass from the
  later of its ``t`` and the pass before's ``g`` (a one-token step's pass held for tens of ms
  waited on the GPU for something else); and PyTorch's running counts of the CUDA calls its
  allocators made (``malloc``, ``free``, ``host_alloc``, ``sync_all``, ``retries``), each an
  implicit synchronization that can hold a pass behind every stream's queued work, loads too;
* ``gc`` — a collection of Python's garbage collector in the process: its span, generation and
  objects freed (a full collection stops every thread, the scheduler's too);
* ``sample`` — every ``SAMPLE_S`` what the scheduler's thread was running: the innermost function
  of vLLM's engine core loop (``vllm/v1/engine/core.py``, e.g. ``_process_input_queue`` taking
  requests in, ``step_with_batch_queue``) with the call it is in there, and the innermost frame
  (``file:function``); every
  ``THREAD_CPU_EVERY`` samples, the CPU nanoseconds each thread used since the previous reading
  (the kernel's per-thread CPU clocks; threads that used none left out), so
  that a gap between two steps shows which thread had the CPU (vLLM's input thread hashes each
  request's blocks when a connector is loaded).

``schedule`` rows under ``TieringScheduler`` also carry the requests added since the previous
one (``adds``) and the scheduler thread's seconds in ``add_request`` (``add_s``).

The rows are kept in memory and written by a daemon thread every half second (never by the
thread that recorded them: vLLM's scheduler thread does no I/O) to ``PATH.<pid>.jsonl``; rows of
the last half second before a process is killed may be lost. With the variable unset, each hook
costs one attribute read.

Why CPU time beside the wall time: a call whose wall time is far above its thread's CPU time
waited, for the GIL (another thread of the engine core, such as the one taking requests in, ran
Python meanwhile: each call that releases the GIL may wait up to the switch interval to get it
back) or in a blocking driver call. The summary prints both.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import logging
import os
import sys
import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

from tiering.thread_names import name_os_thread

log = logging.getLogger(__name__)

ENV = "TIERING_STEP_TRACE"
FLUSH_S = 0.5
SAMPLE_S = 0.005  # how often the sampler looks at the scheduler's thread
THREAD_CPU_EVERY = 4  # every this many samples, every thread's CPU time
_ENGINE_LOOP_FILE = os.path.join("vllm", "v1", "engine", "core.py")


class StepTrace:
    """The process's trace (``TRACE``). ``add`` may be called from any thread."""

    def __init__(self, path: str | None) -> None:
        self._open(path)

    def _open(self, path: str | None) -> None:
        self.path = path
        self.on = bool(path)
        # rows wait here for the writer thread: append and popleft are atomic, so no lock is
        # held while a row is added. A garbage collection can start on any allocation, on any
        # thread, even while another row is being added or the writer thread is starting, and
        # its row (``_on_gc``) is added right there: a lock would make it wait for itself.
        self._rows: deque[dict[str, Any]] = deque()
        self._start_lock = threading.Lock()  # one writer thread; never held by ``_on_gc``
        self._flush_lock = threading.Lock()  # one flush at a time; never taken by ``_on_gc``
        self._writer: threading.Thread | None = None
        self.scheduler_ident: int | None = None  # the thread the sampler looks at
        self._gc_t0: float | None = None

    def reopen_from_env(self) -> None:
        """A forked child starts a trace of its own, from the environment it has now: vLLM
        forks its engine core from a process that imported this module before the variable
        was set (gpu-bench), and the parent's writer thread and rows are not the child's."""
        self._open(os.environ.get(ENV) or None)

    def add(self, kind: str, **fields: Any) -> None:
        if not self.on:  # off, or turned off by a writer that failed: nothing writes rows
            return
        fields["k"] = kind
        fields.setdefault("t", time.perf_counter())
        self._rows.append(fields)
        if self._writer is None:
            self._start_writer()

    def _start_writer(self) -> None:
        with self._start_lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop,
                                                name="tiering-step-trace", daemon=True)
                self._writer.start()

    def watch_scheduler_thread(self) -> None:
        """Called on vLLM's scheduler thread (each traced ``schedule``): the first call starts
        the sampler and the garbage collector's rows in this process (once, also in a forked
        child that inherited the parent's callback list)."""
        if self.scheduler_ident is not None:
            return
        self.scheduler_ident = threading.get_ident()
        self._start_writer()  # before the callback, which only appends
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        threading.Thread(target=self._sample_loop, name="tiering-step-sample",
                         daemon=True).start()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        """Python's collector, on whichever thread it runs: a row per collection, appended
        and nothing else (no lock, no thread started; see ``_open``)."""
        if not self.on:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            t0, self._gc_t0 = self._gc_t0, None
            self._rows.append({"k": "gc", "t": t0, "t0": t0, "t1": time.perf_counter(),
                               "gen": info.get("generation"),
                               "collected": info.get("collected")})

    def _sample_loop(self) -> None:
        name_os_thread("tiering-sample")
        try:
            self._sample()
        except Exception:  # a diagnostic: it stops, the engine goes on
            log.exception("step trace: the sampler stopped")

    def _sample(self) -> None:
        n = 0
        last = thread_cpu_ns()
        while self.on:
            time.sleep(SAMPLE_S)
            frame = sys._current_frames().get(self.scheduler_ident or 0)
            row: dict[str, Any] = {"t": time.perf_counter()}
            if frame is not None:
                row["core"], row["leaf"] = _where(frame)
            n += 1
            if n % THREAD_CPU_EVERY == 0:
                now = thread_cpu_ns()
                row["threads"] = {k: v - last.get(k, 0) for k, v in now.items()
                                  if v != last.get(k, 0)}
                last = now
            self.add("sample", **row)

    def _write_loop(self) -> None:
        name_os_thread("tiering-trace")
        while True:
            time.sleep(FLUSH_S)
            try:
                self.flush()
            except OSError as e:  # rows would pile up in memory with nobody writing them
                self.on = False
                self._rows.clear()
                log.error("step trace: cannot write %s.%d.jsonl (%s); the trace is off",
                          self.path, os.getpid(), e)
                return

    def flush(self) -> None:
        """Write the rows recorded so far (the writer thread does this every FLUSH_S)."""
        with self._flush_lock:  # one writer of the file at a time: lines never interleave
            q = self._rows
            rows = [q.popleft() for _ in range(len(q))]  # a row added meanwhile waits its turn
            if not rows or not self.path:
                return
            with open(f"{self.path}.{os.getpid()}.jsonl", "a") as f:
                f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


TRACE = StepTrace(os.environ.get(ENV) or None)
os.register_at_fork(after_in_child=TRACE.reopen_from_env)


def _where(frame: Any) -> tuple[str, str]:
    """A thread's stack in two words: where it is in vLLM's engine-core loop (the innermost
    function of that file, and ``>`` the function it called there, if any; "-" outside it) and
    the innermost frame, both as ``file:function``."""
    leaf = _name(frame)
    core, callee, f = "-", None, frame
    while f is not None:
        if f.f_code.co_filename.endswith(_ENGINE_LOOP_FILE):
            core = f.f_code.co_name + (f">{_name(callee)}" if callee is not None else "")
            break
        callee, f = f, f.f_back
    return core, leaf


def _name(frame: Any) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


_thread_names: dict[int, str] = {}  # tid -> the name its readings go under, fixed at first sight


def thread_cpu_ns() -> dict[str, int]:
    """Every thread of this process: ``name/tid`` -> CPU nanoseconds so far. A Python thread
    goes by its ``threading`` name, any other by its OS name; a thread keeps the name it had at
    its first reading. The clock is the kernel's per-thread CPU clock read by its clock id
    (Linux's encoding of a thread id), which keeps the GIL: one read of ``/proc`` per call and
    one per new thread, where reading every thread's ``/proc`` file gave the GIL away each time
    (hundreds of ms under a busy scheduler thread). A thread gone meanwhile is left out."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return {}
    out: dict[str, int] = {}
    for gone in set(_thread_names).difference(tids):  # a later thread may reuse the id
        _thread_names.pop(gone, None)  # (another trace's sampler may have dropped it first)
    new = [tid for tid in tids if tid not in _thread_names]
    if new:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in new:
            name = names.get(tid)
            if name is None:
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    continue
            _thread_names[tid] = name
    for tid in tids:
        name = _thread_names.get(tid)
        if name is None:
            continue
        try:
            out[f"{name}/{tid}"] = time.clock_gettime_ns(_thread_clock(tid))
        except OSError:  # gone since the listing
            continue
    return out


def _thread_clock(tid: int) -> int:
    """The clock id of thread ``tid``'s CPU time (Linux: ``MAKE_THREAD_CPUCLOCK(tid,
    CPUCLOCK_SCHED)``, the id ``pthread_getcpuclockid`` returns for it)."""
    return ((~tid) << 3) | 6


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every row of the trace files, by time; a file ending in ``.gz`` is read gzipped (the
    form results are kept in, docs/results)."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        with (gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return sorted(rows, key=lambda r: float(r.get("t0", r["t"])))


def _busy(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of ``spans``."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _late(copies: Sequence[dict[str, Any]]) -> tuple[float, int]:
    """Seconds the jobs spanned beyond their bytes at the median job's rate, and the jobs over
    1 ms late. A job spans from its start event to its end event: a feeder that recorded the
    start and took the GIL back only later leaves the copy engine idle inside the job."""
    rates = sorted(r["bytes"] / (r["g1"] - r["g0"]) for r in copies if r["g1"] > r["g0"])
    if not rates:
        return 0.0, 0
    rate = rates[len(rates) // 2]
    late = [max(0.0, r["g1"] - r["g0"] - r["bytes"] / rate) for r in copies]
    return sum(late), sum(1 for x in late if x > 1e-3)


def _cpu_ms(rows: Iterable[dict[str, Any]]) -> str:
    """The rows' thread CPU time in ms, or "-" where a row has none (traces before it was
    recorded)."""
    total = 0.0
    for r in rows:
        if "cpu" not in r:
            return "-"
        total += float(r["cpu"])
    return f"{total * 1e3:.1f}"


def summarize(rows: list[dict[str, Any]], t0: float | None = None,
              t1: float | None = None) -> str:
    """One line per scheduler step in [t0, t1] (default: the whole trace): when it began (ms
    from t0), how long ``schedule`` took (wall, then the thread's CPU), what it scheduled and
    issued, the worker's submission time (wall and CPU) and the copy engines' busy time until
    the next step; then the totals, with how late the load jobs ran (``_late``)."""
    sched = [r for r in rows if r["k"] == "schedule"]
    if not sched:
        return "no schedule rows (the trace is taken under TieringScheduler)"
    t0 = sched[0]["t0"] if t0 is None else t0
    t1 = max(float(r.get("g1", r["t"])) for r in rows) if t1 is None else t1
    sched = [r for r in sched if t0 <= r["t0"] <= t1]
    copies = {d: [(r["g0"], r["g1"]) for r in rows if r["k"] == "copy" and r["dir"] == d
                  and r["g1"] >= t0 and r["g0"] <= t1] for d in ("load", "store", "expedited")}
    submits = [r for r in rows if r["k"] == "submit" and t0 <= r["t"] <= t1]
    lines = [f"{'ms':>8} {'sched ms':>8} {'cpu':>6} {'tokens':>7} {'reqs':>5} {'loads':>5} "
             f"{'stores':>6} {'waiting':>7} {'submit ms':>9} {'sub cpu':>7} {'load busy':>9} "
             f"{'store busy':>10} {'landed':>6} {'adds':>5} {'gc ms':>6}  scheduler thread until "
             "the next step (samples)"]
    updates = [r for r in rows if r["k"] == "update" and t0 <= r["t0"] <= t1]
    gcs = sorted((r for r in rows if r["k"] == "gc" and t0 <= r["t0"] <= t1),
                 key=lambda r: r["t0"])
    samples = sorted((r for r in rows if r["k"] == "sample" and t0 <= r["t"] <= t1),
                     key=lambda r: r["t"])
    gc_t = [g["t0"] for g in gcs]  # each step's share found by bisection: a long trace has
    sample_t = [x["t"] for x in samples]  # tens of thousands of samples
    for i, r in enumerate(sched):
        lo = r["t0"]
        hi = sched[i + 1]["t0"] if i + 1 < len(sched) else t1
        sub = sum(s["dt"] for s in submits if lo <= s["t"] < hi)
        sub_cpu = _cpu_ms(s for s in submits if lo <= s["t"] < hi)
        landed = sum(u.get("recv", 0) for u in updates if lo <= u["t0"] < hi)
        lines.append(f"{(lo - t0) * 1e3:8.1f} {(r['t1'] - r['t0']) * 1e3:8.1f} "
                     f"{_cpu_ms([r]):>6} {r['tokens']:7d} {r['reqs']:5d} {r['loads']:5d} "
                     f"{r['stores']:6d} {r['waiting']:7d} {sub * 1e3:9.1f} {sub_cpu:>7} "
                     f"{_busy(copies['load'] + copies['expedited'], lo, hi) * 1e3:9.1f} "
                     f"{_busy(copies['store'], lo, hi) * 1e3:10.1f} {landed:6d} "
                     f"{_adds(r):>5} {_gc_ms(gcs[bisect_left(gc_t, lo):bisect_left(gc_t, hi)]):6.1f}"
                     f"  {_loop_shares(samples[bisect_left(sample_t, lo):bisect_left(sample_t, hi)])}")
    loads = copies["load"] + copies["expedited"]
    late_s, late_n = _late([r for r in rows if r["k"] == "copy" and r["dir"] == "load"
                            and r["g1"] >= t0 and r["g0"] <= t1])
    span = t1 - t0
    if loads:
        lines.append(_load_queue(loads, updates, t0))
    lines.append(f"window {span * 1e3:.1f} ms, {len(sched)} steps; schedule "
                 f"{sum(r['t1'] - r['t0'] for r in sched) * 1e3:.1f} ms (CPU {_cpu_ms(sched)} ms); "
                 f"worker submits {sum(s['dt'] for s in submits) * 1e3:.1f} ms (CPU "
                 f"{_cpu_ms(submits)} ms, {len(submits)} jobs); loads on "
                 f"the GPU {_busy(loads, t0, t1) * 1e3:.1f} ms busy"
                 + (f", first from {(min(a for a, _ in loads) - t0) * 1e3:.1f} to "
                    f"{(max(b for _, b in loads) - t0) * 1e3:.1f} ms" if loads else "")
                 + f"; load jobs late {late_s * 1e3:.1f} ms ({late_n} of "
                 f"{len(copies['load'])} over 1 ms late)"
                 + f"; stores {_busy(copies['store'], t0, t1) * 1e3:.1f} ms busy")
    marks = [r for r in rows if r["k"] == "mark" and t0 <= r["t"] <= t1]
    if marks:
        lines.append(_forward_passes(marks, sched, t0))
    if gcs:
        full = [g for g in gcs if g.get("gen") == 2]
        lines.append(f"garbage collections {len(gcs)}, {sum(g['t1'] - g['t0'] for g in gcs) * 1e3:.1f}"
                     f" ms; full {len(full)}, longest "
                     f"{max((g['t1'] - g['t0'] for g in gcs), default=0) * 1e3:.1f} ms")
    busiest = _thread_cpu(samples)
    if busiest:
        lines.append("thread CPU ms in the window: " + ", ".join(
            f"{name} {ms:.1f}" for name, ms in busiest))
    return "\n".join(lines)


# A gap between load jobs on the GPU shorter than this is the copy engine's own switch from one
# job to the next, not a queue that ran empty
QUEUE_GAP_S = 0.0002


def _load_queue(loads: Sequence[tuple[float, float]], updates: Sequence[dict[str, Any]],
                t0: float) -> str:
    """When the load jobs' queue on the GPU ran empty (a job began after every one before it
    had ended): how often, for how long in all, the longest; from when it never ran empty again
    to the last load's end; and the first step output taken after that end (2026-12-07e: one
    step a batch came back only ~9 ms, one graph step, after the last load landed)."""
    spans = sorted(loads)
    gaps = []
    end = spans[0][1]
    for a, b in spans[1:]:
        if a - end > QUEUE_GAP_S:
            gaps.append((end, a - end))
        end = max(end, b)
    since = max(t0, gaps[-1][0] + gaps[-1][1] if gaps else spans[0][0])
    line = (f"load queue empty {len(gaps)} times, {sum(g for _, g in gaps) * 1e3:.1f} ms in all"
            + (f", longest {max(g for _, g in gaps) * 1e3:.1f} ms at "
               f"{(max(gaps, key=lambda x: x[1])[0] - t0) * 1e3:.1f}" if gaps else "")
            + f"; never empty from {(since - t0) * 1e3:.1f} to the last load's end at "
            f"{(end - t0) * 1e3:.1f} ms")
    after = [u["t0"] for u in updates if u["t0"] >= end]
    if after:
        line += f"; the first step output after it {(min(after) - end) * 1e3:.1f} ms later"
    return line


def _forward_passes(marks: Sequence[dict[str, Any]], sched: Sequence[dict[str, Any]],
                   t0: float, top: int = 3) -> str:
    """Each step's forward pass on the GPU (``mark`` rows), timed from the later of when the
    worker had enqueued it and when the GPU ended the pass before, to its end: what the GPU
    spent on that step, its own work and any wait it had for work on other streams. The median,
    and the ``top`` longest with when they were enqueued (ms from t0) and the tokens their step
    scheduled (a prefill step's pass is long by itself; a one-token step's is not)."""
    marks = sorted(marks, key=lambda m: m["t"])
    starts = [r["t0"] for r in sched]
    spans = []
    prev: dict[str, Any] | None = None
    for m in marks:
        begin = m["t"] if prev is None else max(m["t"], prev["g"])
        i = bisect_left(starts, m["t"]) - 1  # the step this pass belongs to
        calls = _allocator_calls(prev, m)
        notes = ([] if i < 0 else [f"{sched[i]['tokens']} tokens"]) + (
            [f"after {calls}"] if calls else [])
        spans.append((m["g"] - begin, m["t"], notes, calls))
        prev = m
    times = sorted(x for x, _, _, _ in spans)
    longest = ", ".join(f"{x * 1e3:.1f} ms at {(t - t0) * 1e3:.1f}"
                        + (f" ({', '.join(notes)})" if notes else "")
                        for x, t, notes, _ in sorted(spans, key=lambda s: s[0],
                                                     reverse=True)[:top])
    line = (f"forward passes on the GPU: {len(spans)}, median {times[len(times) // 2] * 1e3:.1f}"
            f" ms; longest {longest}")
    if any(f in m for m in marks for f in ALLOCATOR_FIELDS):
        after = [(t, calls) for _, t, _, calls in spans if calls]
        line += ("\nallocator CUDA calls (PyTorch's counts) before a pass: "
                 + (", ".join(f"{c} at {(t - t0) * 1e3:.1f}" for t, c in after[:top])
                    + (f", and before {len(after) - top} more passes" if len(after) > top
                       else "") if after else "none"))
    return line


# The fields of ``mark`` rows that count PyTorch's allocators' CUDA calls, each able to hold a
# step's forward pass behind the work queued on every stream (cudaMalloc, cudaFree and a
# page-locked host allocation synchronize implicitly: CUDA C Programming Guide, "Implicit
# Synchronization"): (field, name in the summary, allocator, PyTorch's statistic). The copier
# reads them (tiering/backends/cuda_copy.py, ``allocator_calls``).
ALLOCATOR_CALLS = (("malloc", "cudaMalloc", "device", "num_device_alloc"),
                   ("free", "cudaFree", "device", "num_device_free"),
                   ("sync_all", "allocator syncs", "device", "num_sync_all_streams"),
                   ("retries", "allocation retries", "device", "num_alloc_retries"),
                   ("host_alloc", "cudaHostAlloc", "host", "num_host_alloc"))
ALLOCATOR_FIELDS = {field: name for field, name, _, _ in ALLOCATOR_CALLS}


def _allocator_calls(prev: dict[str, Any] | None, mark: dict[str, Any]) -> str:
    """The allocators' CUDA calls between two marks (from the pass before's enqueue to this
    one's), e.g. "cudaMalloc 2, cudaHostAlloc 1"; "" where none, or not counted."""
    if prev is None:
        return ""
    made = [(name, int(mark[f]) - int(prev[f])) for f, name in ALLOCATOR_FIELDS.items()
            if f in mark and f in prev]
    return ", ".join(f"{name} {n}" for name, n in made if n > 0)


def _gc_ms(gcs: Sequence[dict[str, Any]]) -> float:
    return float(sum(g["t1"] - g["t0"] for g in gcs)) * 1e3


def _adds(row: dict[str, Any]) -> str:
    return str(row["adds"]) if "adds" in row else "-"


def _loop_shares(samples: Sequence[dict[str, Any]], top: int = 2) -> str:
    """The scheduler thread's most sampled places in the engine-core loop, as shares of the
    samples (with the innermost frame of the first), or "" without samples."""
    places = Counter(s["core"] for s in samples if "core" in s)
    n = sum(places.values())
    if not n:
        return ""
    out = []
    for core, k in places.most_common(top):
        leaf = Counter(s["leaf"] for s in samples if s.get("core") == core).most_common(1)[0][0]
        out.append(f"{core} {100 * k // n}% ({leaf})")
    return f"{n}: " + ", ".join(out)


def _thread_cpu(samples: Sequence[dict[str, Any]], top: int = 8) -> list[tuple[str, float]]:
    """The threads with the most CPU time in the thread readings of ``samples`` (each the
    nanoseconds used since the reading before): (name/tid, ms)."""
    used: Counter[str] = Counter()
    for s in samples:
        used.update(s.get("threads", {}))
    return [(k, v / 1e6) for k, v in used.most_common(top) if v > 0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Summarize a step trace (tiering/step_trace.py)")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--from", dest="t0", type=float, default=None,
                    help="window start, perf_counter seconds")
    ap.add_argument("--to", dest="t1", type=float, default=None)
    a = ap.parse_args(argv)
    print(summarize(load(a.files), a.t0, a.t1))


if __name__ == "__main__":
    main()
