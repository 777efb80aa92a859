"""Does a queue of bulk host-to-GPU loads hold up the model's own small input copies? (issue 15)

    python3 docs/bench_copy_queue.py [--bulk-gib 0,1,4,8] [--piece-mib 2] [--wave-mib 256]
        [--job-mib 64] [--fed-limit-mib 1024] [--fed-wave-mib 256] [--probe-ms 10]
        [--alloc-after-ms 40]
        [--json OUT.json]

Why: the 8B step trace of a 100%-hit batch (docs/results/2026-12-05c) shows steps of a few
dozen tokens lasting as long as the loads in flight (a 29-token step took 243 ms while the copy
engine was busy 192 ms of it). vLLM's model runner copies each step's inputs (token ids,
positions, block tables) host to GPU with non-blocking copies on its compute stream. If those
share a hardware copy queue with our loads, a step waits for every load queued before it.

What it measures, on one GPU, with pinned host memory as the CPU tier's rows are:

* ``idle``: a 64 KiB pinned host-to-GPU copy on the current stream, then a tiny kernel; the
  wall time until both are done (nothing else queued).
* ``queued``: the same right after ``bulk`` GiB of loads were enqueued on another stream in
  ``piece`` MiB copies (one per KV block or chunk, as our copier issues them): how long the
  small copy waits, and how long the bulk takes.
* ``high-priority``: as ``queued``, with the small copy on a stream of the highest priority.
* ``waves``: the bulk enqueued ``wave`` MiB at a time by a host thread that waits for each wave
  to finish before it enqueues the next (a paced feeder): the small copy's wait and the bulk's
  rate, against ``queued``. The queue empties between waves.
* ``fed``: the bulk in jobs of ``job`` MiB (one per request, as ours: 64 MiB at 8B) by a host
  thread that keeps at most ``fed-limit`` MiB enqueued (1024: where our feeder's limit grows
  to) and enqueues the next job as soon as the
  oldest one ends (``backends/copy_feeder.py``'s pattern: the queue never empties while jobs
  wait). Meanwhile the main thread probes every ``probe`` ms, as vLLM's steps come: a small
  input copy, a kernel, and the result copied back to pinned memory on another stream (a
  step's sampled tokens), waited for on that stream's event. Reported: the probes' median and
  longest wait, when the longest began (ms after the bulk) and when the bulk ended. Why: on the
  H100 of 2026-12-07e one vLLM step a 100%-hit batch was held 62-272 ms, until ~10 ms after the
  last fed load landed, while steps before it, every 10-15 ms, were not
  (docs/benchmarks.md, "An H100, 2026-12-07e").
* ``fed-waves``: as ``fed``, but once the next job would take the bytes enqueued since the
  queue was last empty past a wave's size, the thread waits until every enqueued job is done
  (``backends/copy_feeder.py``'s ``waves``, the default since 2026-12-07g). Why: on the H100 of
  2026-12-07g a ``fed`` probe that began 10 ms into 8 GiB ended only with the bulk, 155 ms later.
  Its waves are ``--fed-wave-mib`` (256: where our feeder's waves start), ``fed-waves-1g``'s
  1024 (where they grow to): what each wave's boundary costs the bulk's rate.
* ``fed-pingpong``: waves of ``--fed-wave-mib`` on two streams in turn; a wave is enqueued once
  the wave before the last one, on the same stream, is done, so one wave waits queued while
  the other copies and the copy engine never waits for the host thread. Why: if the engine
  turns between streams that have work once a stream's queue is empty, a step's copy still
  waits at most about a wave, without ``fed-waves``' idle boundaries.
* ``fed+host-alloc``, ``fed+malloc``, ``fed+sync`` (the largest bulk only): as ``fed``, but the
  step probe that begins after ``--alloc-after-ms`` first makes PyTorch allocate memory of a
  size its caches do not hold, page-locked host memory (``cudaHostAlloc``, as vLLM's output
  copy does when the host cache has no free block of that size) or GPU memory (``cudaMalloc``),
  both implicit synchronizations, or waits for the whole device (``torch.cuda.synchronize``).
  Reported: whether the call was made (PyTorch's counts; none for a sync), how long it took,
  and when that step's copies ended against the bulk's end: a step that ends only with the
  bulk, although the feeder kept enqueuing after the call, is the held step of
  2026-12-07e's traces (docs/benchmarks.md, "Call O's trace read again").

Output: one line per case and bulk size, and a JSON record with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bulk-gib", default="0,1,4,8")
    ap.add_argument("--piece-mib", type=float, default=2.0)
    ap.add_argument("--wave-mib", type=float, default=256.0)
    ap.add_argument("--job-mib", type=float, default=64.0, help="fed: bytes a job")
    ap.add_argument("--fed-limit-mib", type=float, default=1024.0,
                    help="fed: the most bytes enqueued (our feeder grows to 1 GiB)")
    ap.add_argument("--fed-wave-mib", type=float, default=256.0,
                    help="fed-waves, fed-pingpong: bytes a wave (our feeder's first wave)")
    ap.add_argument("--probe-ms", type=float, default=10.0, help="fed: a probe this often")
    ap.add_argument("--alloc-after-ms", type=float, default=40.0,
                    help="fed+host-alloc, fed+malloc: the probe that allocates begins then")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import torch

    dev = torch.device("cuda", 0)
    sizes = [float(x) for x in a.bulk_gib.split(",") if x]
    top = max(sizes) if sizes else 0.0
    piece = int(a.piece_mib * 2**20)
    total = int(top * 2**30) // piece * piece
    host = torch.empty(max(total, piece), dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(max(total, piece), dtype=torch.uint8, device=dev)
    small_host = torch.ones(16384, dtype=torch.float32, pin_memory=True)
    small_gpu = torch.empty(16384, dtype=torch.float32, device=dev)
    bulk_stream = torch.cuda.Stream(dev)
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") \
        else (0, -1)
    urgent = torch.cuda.Stream(dev, priority=min(lo, hi))

    def enqueue(nbytes: int, stream: Any) -> Any:
        with torch.cuda.stream(stream):
            for off in range(0, nbytes, piece):
                gpu[off:off + piece].copy_(host[off:off + piece], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def small(stream: Any | None) -> float:
        """Wall seconds until a small input copy and a kernel reading it are done."""
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(
            torch.cuda.current_stream(dev))
        with ctx:
            small_gpu.copy_(small_host, non_blocking=True)
            small_gpu.add_(1.0)
            ev = torch.cuda.Event()
            ev.record()
        ev.synchronize()
        return time.perf_counter() - t0

    def paced(nbytes: int) -> tuple[threading.Thread, list[float]]:
        wave = max(piece, int(a.wave_mib * 2**20) // piece * piece)
        end: list[float] = []

        def feed() -> None:
            for off in range(0, nbytes, wave):
                n = min(wave, nbytes - off)
                with torch.cuda.stream(bulk_stream):
                    for o in range(off, off + n, piece):
                        gpu[o:o + piece].copy_(host[o:o + piece], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(bulk_stream)
                ev.synchronize()  # releases the GIL while the wave copies
            end.append(time.perf_counter())

        return threading.Thread(target=feed), end

    out_stream = torch.cuda.Stream(dev)
    small_out = torch.empty(16384, dtype=torch.float32, pin_memory=True)

    def step() -> float:
        """Wall seconds of a step's copies: a small input copy and a kernel on the current
        stream, the result copied back on another stream (vLLM's output copy), waited for."""
        t0 = time.perf_counter()
        small_gpu.copy_(small_host, non_blocking=True)
        small_gpu.add_(1.0)
        out_stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(out_stream):
            small_out.copy_(small_gpu, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(out_stream)
        ev.synchronize()
        return time.perf_counter() - t0

    second_stream = torch.cuda.Stream(dev)

    def fed(nbytes: int, case: str) -> tuple[threading.Thread, list[float]]:
        job = max(piece, int(a.job_mib * 2**20) // piece * piece)
        waves = case.startswith("fed-waves")
        wave_mib = 1024.0 if case == "fed-waves-1g" else a.fed_wave_mib
        limit = max(job, int((wave_mib if case != "fed" and not case.startswith("fed+")
                              else a.fed_limit_mib) * 2**20))
        end: list[float] = []

        def pingpong() -> None:
            streams = (bulk_stream, second_stream)
            last: list[Any] = [None, None]  # each stream's newest wave's end
            turn, wave, off = 0, 0, 0
            while off < nbytes:
                if last[turn] is not None:
                    last[turn].synchronize()  # this stream's last wave is done: its queue empty
                wave = 0
                with torch.cuda.stream(streams[turn]):
                    while off < nbytes and (wave == 0 or wave + min(job, nbytes - off) <= limit):
                        n = min(job, nbytes - off)
                        for o in range(off, off + n, piece):
                            gpu[o:o + piece].copy_(host[o:o + piece], non_blocking=True)
                        off += n
                        wave += n
                    ev = torch.cuda.Event()
                    ev.record(streams[turn])
                last[turn] = ev
                turn ^= 1
            for ev in last:
                if ev is not None:
                    ev.synchronize()
            end.append(time.perf_counter())

        def feed() -> None:
            inflight: list[tuple[int, Any]] = []
            queued = 0
            wave = 0  # waves: bytes enqueued since the queue was last empty
            for off in range(0, nbytes, job):
                n = min(job, nbytes - off)
                if waves and inflight and wave + n > limit:  # the wave is full: let it drain
                    inflight[-1][1].synchronize()
                    inflight, queued = [], 0
                if not inflight:
                    wave = 0
                while inflight and queued + n > limit:
                    size, ev = inflight.pop(0)
                    ev.synchronize()  # releases the GIL while the queued jobs copy
                    queued -= size
                wave += n
                with torch.cuda.stream(bulk_stream):
                    for o in range(off, off + n, piece):
                        gpu[o:o + piece].copy_(host[o:o + piece], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(bulk_stream)
                inflight.append((n, ev))
                queued += n
            for _, ev in inflight:
                ev.synchronize()
            end.append(time.perf_counter())

        return threading.Thread(target=pingpong if case == "fed-pingpong" else feed), end

    kept: list[Any] = []  # what the alloc cases allocated: never freed (a free may sync too)

    def implicit_sync(case: str) -> tuple[float, int]:
        """The case's call: memory of a size the allocator's caches do not hold, allocated
        and kept, or a device sync. Seconds it took, and the CUDA allocations PyTorch counted
        meanwhile (1: the allocation was made; a sync makes none)."""
        host_case = case == "fed+host-alloc"
        if case == "fed+sync":
            t = time.perf_counter()
            torch.cuda.synchronize(dev)
            return time.perf_counter() - t, 0

        def calls() -> int:
            if host_case:
                stats = torch.cuda.memory.host_memory_stats_as_nested_dict()
                return int(stats.get("num_host_alloc", -1))
            return int(torch.cuda.memory_stats_as_nested_dict(dev).get("num_device_alloc", -1))

        before = calls()
        # each a power of two larger than the last (the host cache keeps blocks by power of two)
        nbytes = (2 ** (25 + len(kept))) + 4096
        t = time.perf_counter()
        kept.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if host_case
                    else torch.empty(nbytes, dtype=torch.uint8, device=dev))
        took = time.perf_counter() - t
        return took, calls() - before

    small(None)  # warm the kernels and the copy path
    step()
    enqueue(piece, bulk_stream).synchronize()
    rows: list[dict[str, Any]] = []
    for gib in sizes:
        nbytes = int(gib * 2**30) // piece * piece
        for case in ("idle", "queued", "high-priority", "waves", "fed", "fed-waves",
                     "fed-waves-1g", "fed-pingpong", "fed+host-alloc", "fed+malloc", "fed+sync"):
            if case != "idle" and nbytes == 0:
                continue
            if case == "idle" and gib != sizes[0]:
                continue
            if case.startswith("fed+") and gib != top:
                continue
            for _ in range(a.repeat):
                if case.startswith("fed"):
                    torch.cuda.synchronize(dev)
                    feeder, end = fed(nbytes, case)
                    t0 = time.perf_counter()
                    feeder.start()
                    probes: list[tuple[float, float]] = []  # (began, seconds), from t0
                    alloc: dict[str, Any] = {}
                    while not probes or feeder.is_alive():  # one probe at least
                        began = time.perf_counter()
                        if (case.startswith("fed+") and not alloc
                                and began - t0 >= a.alloc_after_ms / 1e3):
                            took, made = implicit_sync(case)
                            alloc = {"alloc_began_ms": round((began - t0) * 1e3, 1),
                                     "alloc_ms": round(took * 1e3, 3), "alloc_calls": made}
                            wait = step()
                            alloc["alloc_step_ms"] = round(wait * 1e3, 3)
                            alloc["alloc_step_end_s"] = time.perf_counter() - t0
                            probes.append((began - t0, took + wait))
                        else:
                            probes.append((began - t0, step()))
                        time.sleep(max(0.0, a.probe_ms / 1e3 - (time.perf_counter() - began)))
                    feeder.join()
                    if not end:
                        raise RuntimeError("the feeder thread stopped before the bulk ended")
                    bulk_s = end[0] - t0
                    waits = sorted(w for _, w in probes)
                    worst = max(probes, key=lambda p: p[1])
                    rows.append({"case": case, "bulk_gib": gib, "job_mib": a.job_mib,
                                 "probes": len(probes),
                                 "probe_ms_median": round(waits[len(waits) // 2] * 1e3, 3),
                                 "probe_ms_max": round(worst[1] * 1e3, 3),
                                 "probe_max_began_ms": round(worst[0] * 1e3, 1),
                                 "bulk_ms": round(bulk_s * 1e3, 3),
                                 "bulk_gbps": round(nbytes / bulk_s / 1e9, 2)})
                    r = rows[-1]
                    line = (f"{case:<14} bulk {gib:5.1f} GiB  {r['probes']} steps: median "
                            f"{r['probe_ms_median']:.3f} ms, longest {r['probe_ms_max']:.1f} ms "
                            f"from {r['probe_max_began_ms']:.0f} ms; bulk {r['bulk_ms']:.1f} ms "
                            f"{r['bulk_gbps']:.1f} GB/s")
                    if alloc:
                        # > 0: that step's copies ended after the bulk (the feeder went on
                        # enqueuing after the call, and the step waited for all of it)
                        after = alloc.pop("alloc_step_end_s") - bulk_s
                        alloc["alloc_step_end_after_bulk_ms"] = round(after * 1e3, 3)
                        r.update(alloc)
                        line += (f"; at {alloc['alloc_began_ms']:.0f} ms the allocation "
                                 f"(CUDA allocations counted: {alloc['alloc_calls']}) took "
                                 f"{alloc['alloc_ms']:.2f} ms and its step "
                                 f"{alloc['alloc_step_ms']:.1f} ms, ending "
                                 f"{after * 1e3:+.1f} ms from the bulk's end")
                    elif case.startswith("fed+"):
                        line += "; the bulk ended before the allocation was due"
                    print(line, flush=True)
                    continue
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                thread: threading.Thread | None = None
                done = None
                if case in ("queued", "high-priority"):
                    done = enqueue(nbytes, bulk_stream)
                elif case == "waves":
                    thread, end = paced(nbytes)
                    thread.start()
                    time.sleep(0.002)  # the feeder's first wave is in
                t_enq = time.perf_counter() - t0
                wait = small(urgent if case == "high-priority" else None)
                if done is not None:
                    done.synchronize()
                    bulk_s = time.perf_counter() - t0
                elif thread is not None:
                    thread.join()
                    bulk_s = end[0] - t0
                else:
                    bulk_s = 0.0
                rows.append({"case": case, "bulk_gib": gib if case != "idle" else 0.0,
                             "small_copy_ms": round(wait * 1e3, 3),
                             "enqueue_ms": round(t_enq * 1e3, 3),
                             "bulk_ms": round(bulk_s * 1e3, 3),
                             "bulk_gbps": round(nbytes / bulk_s / 1e9, 2) if bulk_s else None})
                r = rows[-1]
                print(f"{case:<14} bulk {r['bulk_gib']:5.1f} GiB  small copy {r['small_copy_ms']:8.3f}"
                      f" ms  enqueue {r['enqueue_ms']:8.1f} ms  bulk {r['bulk_ms']:8.1f} ms"
                      f"  {r['bulk_gbps'] or 0:6.1f} GB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "piece_mib": a.piece_mib,
                       "wave_mib": a.wave_mib, "job_mib": a.job_mib,
                       "fed_limit_mib": a.fed_limit_mib, "fed_wave_mib": a.fed_wave_mib,
                       "probe_ms": a.probe_ms,
                       "alloc_after_ms": a.alloc_after_ms,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
