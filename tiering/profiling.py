"""cProfile inside vLLM's engine-core process, switched on and off from the frontend, and a
summary that splits the time by who spends it (benchmarks only; issue 15).

With one GPU, vLLM runs the scheduler, our manager, the model runner and our worker in one
process (the engine core, ``UniProcExecutor``): ``LLM.collective_rpc(start_profile, args=(path,))``
runs ``start_profile`` there, on the thread that also runs the engine's steps, and
``stop_profile`` writes the stats to ``path``. ``summarize`` reads them back anywhere (the file
names the source files) and groups each function's own time by the part of the code it is in:
our scheduler side (manager, chain, CPU tier, metrics, request records, policies), our worker
side (descriptor building, copy submission, completion polling), vLLM's connector scheduler and
worker code, vLLM's scheduler, the model runner, and the rest.

Nothing here imports vLLM or torch; the functions take the worker vLLM passes as first argument
and ignore it.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Iterable

_active: cProfile.Profile | None = None

# (group, path fragments): the first group with a fragment in a function's file wins; the order
# matters (vLLM's offloading worker before its other offloading code).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ours: worker (descriptors, copy submission, completion polling)",
     ("backends/cuda_copy.py", "backends/block_copy.py", "backends/gpu_kernels.py",
      "tiering/vllm/worker.py", "tiering/backends/cuda_copy.py",
      "tiering/backends/block_copy.py")),
    ("ours: scheduler (manager, chain, CPU tier, records, metrics, policies)",
     ("tiering/vllm/", "tiering/chain.py", "tiering/cpu_tier.py", "tiering/request_scan.py",
      "tiering/owed_rows.py", "tiering/stats.py", "tiering/advisor.py", "policies/",
      "tiering/policies/", "tiering/backends/")),
    ("vLLM offloading: worker side",
     ("kv_connector/v1/offloading/worker.py", "kv_offload/cpu/gpu_worker.py",
      "kv_offload/worker", "kv_connector/v1/offloading/canonical_mapping.py")),
    ("vLLM offloading: scheduler side (connector, events, metrics, its CPU manager)",
     ("kv_connector/v1/offloading", "kv_offload/", "offloading_connector.py")),
    ("vLLM KV connector plumbing", ("kv_transfer/",)),
    ("vLLM scheduler and KV cache manager", ("vllm/v1/core/",)),
    ("vLLM model runner and worker", ("vllm/v1/worker/", "vllm/v1/attention", "vllm/forward_context",
                                      "vllm/model_executor/", "vllm/attention/")),
    ("vLLM engine core, executor, outputs", ("vllm/v1/engine/", "vllm/v1/executor/",
                                             "vllm/v1/outputs", "vllm/v1/serial_utils",
                                             "vllm/v1/request.py", "vllm/v1/metrics/")),
    ("torch", ("torch/",)),
    ("other vLLM", ("vllm/",)),
)
WAITING = ("{method 'acquire' of '_thread.lock'", "{built-in method select.", "{method 'poll'",
           "{built-in method time.sleep}", "{method 'recv", "{method 'get' of '_queue",
           "{built-in method posix.sched_yield}")
# a worker process waiting for the engine core's next call (vLLM's CPU platform, tensor
# parallelism: the scheduler runs in another process then)
WAITING_FILES = ("device_communicators/shm_broadcast.py", "vllm/distributed/utils.py")


def start_profile(worker: object = None, path: str = "") -> bool:
    """Start profiling this thread (the engine core's step thread when called through
    ``collective_rpc``). A profile already running is dropped first."""
    global _active
    if _active is not None:
        _active.disable()
    _active = cProfile.Profile()
    _active.enable()
    return True


def stop_profile(worker: object = None, path: str = "") -> bool:
    """Stop the running profile and write its stats to ``path``; False if none was running."""
    global _active
    prof, _active = _active, None
    if prof is None:
        return False
    prof.disable()
    prof.dump_stats(path)
    return True


def group_of(filename: str, funcname: str) -> str:
    name = filename.replace("\\", "/")
    if filename == "~":  # a C function: grouped by what it is
        if any(funcname.startswith(w) for w in WAITING):
            return "waiting (locks, queues, sockets, sleeps)"
        return "C functions called from Python"
    if any(f in name for f in WAITING_FILES):
        return "waiting (locks, queues, sockets, sleeps)"
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other Python"


def grouped(stats: pstats.Stats) -> dict[str, float]:
    """Own time (tottime, seconds) per group of ``GROUPS``."""
    out: dict[str, float] = {}
    for (filename, _line, funcname), row in stats.stats.items():  # type: ignore[attr-defined]
        tottime = row[2]
        g = group_of(filename, funcname)
        out[g] = out.get(g, 0.0) + tottime
    return out


def cumulative(stats: pstats.Stats, names: Iterable[str]) -> dict[str, tuple[int, float]]:
    """Calls and cumulative seconds of every function whose ``file:function`` ends with one of
    ``names`` (summed over matches)."""
    wanted = tuple(names)
    out: dict[str, tuple[int, float]] = {}
    for (filename, _line, funcname), row in stats.stats.items():  # type: ignore[attr-defined]
        label = f"{filename.replace(chr(92), '/')}:{funcname}"
        for w in wanted:
            if label.endswith(w):
                calls, cum = out.get(w, (0, 0.0))
                out[w] = (calls + row[1], cum + row[3])
    return out


# entry points whose cumulative time is the split the issue asks for
ENTRY_POINTS = (
    "v1/engine/core.py:step", "v1/engine/core.py:step_with_batch_queue",
    "v1/core/sched/scheduler.py:schedule", "v1/core/sched/scheduler.py:update_from_output",
    "v1/executor/uniproc_executor.py:execute_model",
    "offloading/scheduler.py:get_num_new_matched_tokens",
    "offloading/scheduler.py:update_state_after_alloc",
    "offloading/scheduler.py:build_connector_meta",
    "offloading/scheduler.py:update_connector_output",
    "offloading/scheduler.py:request_finished",
    "offloading/scheduler.py:take_events",
    "offloading/scheduler.py:get_stats",
    "offloading/worker.py:start_kv_transfers", "offloading/worker.py:start_load_kv",
    "offloading/worker.py:get_finished", "offloading/worker.py:handle_preemptions",
    "offloading/worker.py:prepare_store_kv",
    "tiering/vllm/manager.py:lookup", "tiering/vllm/manager.py:prepare_load",
    "tiering/vllm/manager.py:prepare_store", "tiering/vllm/manager.py:complete_load",
    "tiering/vllm/manager.py:complete_store", "tiering/vllm/manager.py:touch",
    "tiering/vllm/manager.py:take_events", "tiering/vllm/manager.py:get_stats",
    "tiering/vllm/manager.py:get_load_source", "tiering/vllm/manager.py:on_schedule_end",
    "tiering/vllm/manager.py:has_pending_work",
    "tiering/vllm/worker.py:submit_load", "tiering/vllm/worker.py:submit_store",
    "tiering/vllm/worker.py:get_finished",
    "block_copy.py:descriptors", "block_copy.py:merge_runs", "cuda_copy.py:submit",
    "cuda_copy.py:_copy", "cuda_copy.py:get_finished", "cuda_copy.py:submit_job",
    "cpu/manager.py:lookup", "cpu/manager.py:prepare_load", "cpu/manager.py:prepare_store",
    "cpu/manager.py:touch", "cpu/manager.py:complete_store",
    "cpu/gpu_worker.py:transfer_async", "cpu/gpu_worker.py:get_finished",
)


def summarize(path: str, blocks: float = 0.0, top: int = 35) -> str:
    """A text report of the stats at ``path``: own time per group (and µs per loaded block
    when ``blocks`` > 0), the entry points' calls and cumulative time, then the top functions
    by own and by cumulative time."""
    stats = pstats.Stats(path)
    total = stats.total_tt  # type: ignore[attr-defined]
    lines = [f"profile {path}: {total:.3f} s of profiled time"
             + (f", {blocks:.0f} blocks loaded" if blocks else "")]
    lines.append("\nown time per part of the code:")
    lines.append(f"{'part':<80} {'s':>8} {'share':>6}" + (f" {'us/block':>9}" if blocks else ""))
    for g, secs in sorted(grouped(stats).items(), key=lambda x: -x[1]):
        per = f" {1e6 * secs / blocks:9.1f}" if blocks else ""
        lines.append(f"{g:<80} {secs:8.4f} {100 * secs / max(total, 1e-9):5.1f}%{per}")
    lines.append("\nentry points (calls, cumulative s" + (", us per block" if blocks else "") + "):")
    for name, (calls, cum) in cumulative(stats, ENTRY_POINTS).items():
        per = f" {1e6 * cum / blocks:9.1f}" if blocks else ""
        lines.append(f"{name:<60} {calls:>9} {cum:9.4f}{per}")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(path, stream=buf).sort_stats(key).print_stats(top)
        lines.append(f"\ntop {top} by {key}:")
        lines.append(buf.getvalue().split("\n", 3)[-1] if "function calls" in buf.getvalue()
                     else buf.getvalue())
    return "\n".join(lines)
