"""The prefill sweep's mixed hit rates in a real vLLM Scheduler, step by step (issue 15).

    .venv033/bin/python docs/bench_mixed_hits.py [--prompts 96] [--hit-rates 0,20,50,80,100]
        [--configs cpu,ours,ours@0,ours-sched] [--chunk 16] [--delay 1] [--token-us 114]
        [--step-ms 30] [--trace 50,80]

The H200 sweep's workload without a model (``benchmarks/gpu_bench.py``, ``sweep_batches``): N
unique 512-token prompts a batch, max_tokens 1, GPU prefix caching off, 16-token GPU blocks and
chunks, 16384 tokens and 1024 sequences a step (vLLM's defaults for an H200), a CPU tier of 1.5
batches; a fill batch, then one batch per hit rate whose seen prompts are the previous batch's
last ones, the rest new, shuffled (``--chunk 64``: the chunk our spec takes on CUDA). Per batch
also ``schedule()``'s wall and CPU time, with the heap built so far frozen as the engine core
freezes it (``--no-freeze``: not). The simulated worker of ``tests/vllm_harness.py`` completes
every load and store job ``--delay`` steps after it was issued. Per batch and config: the steps
until every request finished, a modeled time (``--step-ms`` per step plus ``--token-us`` per
scheduled token: the defaults are the 32B shape's no-offloading rate on the H200, 8.8k tokens/s),
how many prompts were served from the CPU tier and the tokens they found, and for the hit
requests the step their load started, completed and their first token came. ``--trace RATES``
prints those batches step by step (requests and tokens scheduled, loads started and completed,
store jobs).

Configs as in ``docs/bench_load_path.py``: ``cpu`` (vLLM's CPUOffloadingSpec), ``ours``
(TieredOffloadingSpec, CPU tier only, defaults), ``ours-sched`` (ours under ``TieringScheduler``,
as gpu-bench's sweep runs it), ``ours@K`` (``max_loading_requests`` K; 0: no
cap). ``BENCH_TIERING_ROOT=DIR``: the ``tiering`` code of another checkout (``git worktree add
DIR COMMIT``), to compare before and after a change. Needs CUDA vLLM 0.33's Python code (``.venv033``; no GPU: the scheduler needs none).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness
sys.path.insert(0, str(HERE))  # bench_load_path
sys.path.insert(0, str(HERE.parent))  # benchmarks


@dataclass
class StepRecord:
    """One scheduler step of a batch."""
    step: int
    requests: int
    tokens: int
    loads_started: list[str]
    loads_done: list[str]
    store_jobs: int


@dataclass
class BatchResult:
    config: str
    kind: str
    rate: float
    steps: int
    modeled_s: float
    hit_requests: int
    cached_tokens: int
    sched_s: float = 0.0  # schedule()'s wall time over the batch
    sched_cpu_s: float = 0.0  # and its CPU time
    load_start: dict[str, int] = field(default_factory=dict)  # request -> step (1-based)
    load_done: dict[str, int] = field(default_factory=dict)
    first_token: dict[str, int] = field(default_factory=dict)
    trace: list[StepRecord] = field(default_factory=list)


class Recorder:
    """Wraps a harness's scheduler: what each step scheduled, loaded and completed."""

    def __init__(self, harness: object) -> None:
        self.h = harness
        self.steps: list[StepRecord] = []
        self.sched_s = self.sched_cpu_s = 0.0  # schedule()'s wall and CPU time, this batch
        sched = harness.scheduler  # type: ignore[attr-defined]
        self._schedule, self._update = sched.schedule, sched.update_from_output
        sched.schedule, sched.update_from_output = self.schedule, self.update

    def schedule(self, *args: object, **kw: object) -> object:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self._schedule(*args, **kw)
        self.sched_s += time.perf_counter() - t0
        self.sched_cpu_s += time.thread_time() - c0
        meta = out.kv_connector_metadata
        self.steps.append(StepRecord(
            self.h.step_no, len(out.num_scheduled_tokens),  # type: ignore[attr-defined]
            sum(out.num_scheduled_tokens.values()),
            [j.req_id for j in meta.load_jobs.values()] if meta is not None else [], [],
            len(meta.store_jobs) if meta is not None else 0))
        return out

    def update(self, sched_out: object, runner_out: object) -> object:
        kv = getattr(runner_out, "kv_connector_output", None)
        if kv is not None and kv.finished_recving and self.steps:
            self.steps[-1].loads_done.extend(sorted(kv.finished_recving))
        return self._update(sched_out, runner_out)


def run_batch(h: object, ids: set[str], step0: int) -> dict[str, int]:
    """Step the harness until the batch is done; the step each request got its token."""
    first: dict[str, int] = {}
    orig_step = h.step  # type: ignore[attr-defined]

    def step() -> None:
        orig_step()
        reqs = h.scheduler.requests  # type: ignore[attr-defined]
        for rid in [r for r in ids if r not in reqs or reqs[r].num_output_tokens]:
            first[rid] = h.step_no - step0  # type: ignore[attr-defined]
            ids.discard(rid)

    h.step = step  # type: ignore[attr-defined]
    try:
        h.run(max_steps=100_000)  # type: ignore[attr-defined]
    finally:
        h.step = orig_step  # type: ignore[attr-defined]
    return first


def tiering_scheduler() -> type:
    """``ours-sched``: the engine's scheduler under our spec, as gpu-bench's ``ours-sched``."""
    from tiering.vllm.scheduler import TieringScheduler

    return TieringScheduler


def run(a: argparse.Namespace) -> list[BatchResult]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-mixed-"))
    os.environ.setdefault("TIERING_SHM_DIR", str(tmp / "shm"))
    from bench_load_path import BENCH_KV_BYTES_PER_TOKEN, bench_model, extra_for
    from vllm_harness import Harness

    from benchmarks.gpu_bench import sweep_batches

    model, kvb = bench_model(tmp), BENCH_KV_BYTES_PER_TOKEN
    n, tokens = a.prompts, a.tokens
    plan = sweep_batches(n, a.hit_rates)
    rng = random.Random(5)
    count = max(max(b) for _, _, b in plan) + 1
    prompts = [[rng.randrange(4, 500) for _ in range(tokens)] for _ in range(count)]
    results: list[BatchResult] = []
    for config in a.configs:
        h = Harness(model, extra_for(config, int(n * tokens * kvb * a.cpu_factor), a.chunk, 16),
                    gpu_tokens=n * (tokens + 32) + 4096, delay=a.delay, max_len=tokens + 64,
                    batched_tokens=a.batched_tokens, max_num_seqs=1024, prefix_caching=False,
                    scheduler_cls=tiering_scheduler() if config.startswith("ours-sched") else None)
        assert h.block_size == 16, f"GPU block size {h.block_size}: run with CUDA vLLM 0.33"
        rec = Recorder(h)
        if a.freeze:  # as vLLM's engine core does once it is built (vllm.utils.gc_utils)
            gc.collect()
            gc.freeze()
        for b, (kind, rate, batch) in enumerate(plan):
            rec.steps.clear()
            rec.sched_s = rec.sched_cpu_s = 0.0
            h.cached.clear()
            step0 = h.step_no
            ids = [f"{kind}{b}-{i}" for i in batch]
            for rid, i in zip(ids, batch, strict=True):
                h.add(rid, prompts[i], max_tokens=1)
            first = run_batch(h, set(ids), step0)
            res = BatchResult(config, kind, rate, 0, 0.0,
                              sum(1 for r in ids if h.cached.get(r, 0) > 0),
                              sum(h.cached.get(r, 0) for r in ids))
            for s in rec.steps:
                s.step -= step0
                for rid in s.loads_started:
                    res.load_start.setdefault(rid, s.step)
                for rid in s.loads_done:
                    res.load_done.setdefault(rid, s.step)
            # the steps until the batch's last request finished (the run's tail steps only
            # drain store completions)
            res.steps = max(first.values())
            res.sched_s, res.sched_cpu_s = rec.sched_s, rec.sched_cpu_s
            res.first_token = {r: first[r] for r in ids if h.cached.get(r, 0) > 0}
            res.trace = [s for s in rec.steps if s.step <= res.steps]
            res.modeled_s = sum(a.step_ms / 1e3 + s.tokens * a.token_us / 1e6
                                for s in res.trace)
            results.append(res)
        if h.manager is not None:
            h.manager.shutdown()
        gc.unfreeze()
    return results


def report(results: list[BatchResult], trace_rates: list[float]) -> None:
    print(f"{'config':<8} {'batch':<5} {'hits%':>5} {'steps':>5} {'modeled s':>9} "
          f"{'hit reqs':>8} {'cached':>7} {'load start':>14} {'load done':>14} "
          f"{'1st token (hits)':>18} {'sched ms':>8} {'cpu ms':>7}")

    def span(d: dict[str, int]) -> str:
        if not d:
            return "-"
        v = list(d.values())
        return f"{statistics.mean(v):4.1f} [{min(v)}-{max(v)}]"

    for r in results:
        print(f"{r.config:<8} {r.kind:<5} {r.rate:5.0f} {r.steps:5d} {r.modeled_s:9.2f} "
              f"{r.hit_requests:8d} {r.cached_tokens:7d} {span(r.load_start):>14} "
              f"{span(r.load_done):>14} {span(r.first_token):>18} {r.sched_s * 1e3:8.1f} "
              f"{r.sched_cpu_s * 1e3:7.1f}")
    for r in results:
        if r.kind != "hit" or r.rate not in trace_rates:
            continue
        print(f"\n{r.config} {r.rate:.0f}% hits, step by step "
              "(requests / tokens scheduled, loads started / completed, store jobs):")
        for s in r.trace:
            print(f"  step {s.step:3d}: {s.requests:4d} req {s.tokens:6d} tok  "
                  f"loads +{len(s.loads_started):<4d} done {len(s.loads_done):<4d} "
                  f"stores {s.store_jobs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=96, help="N a batch (the sweep: 1B 1024, "
                    "8B 256, 32B 96)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--no-freeze", dest="freeze", action="store_false",
                    help="leave the startup heap to the garbage collector (the engine freezes it; "
                    "unfrozen, one full collection in a 1024-prompt 100%% batch took 263 ms)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens an offloaded chunk (CUDA: 64)")
    ap.add_argument("--hit-rates", default="0,20,50,80,100")
    ap.add_argument("--configs", default="cpu,ours")
    ap.add_argument("--delay", type=int, default=1, help="steps a load or store job takes")
    ap.add_argument("--cpu-factor", type=float, default=1.5, help="CPU tier / KV of a batch")
    ap.add_argument("--batched-tokens", type=int, default=16384)
    ap.add_argument("--step-ms", type=float, default=30.0, help="modeled cost of a step")
    ap.add_argument("--token-us", type=float, default=114.0,
                    help="modeled cost of a scheduled token (114: 8.8k tokens/s)")
    ap.add_argument("--trace", default="", help="hit rates to print step by step")
    a = ap.parse_args()
    root = os.environ.get("BENCH_TIERING_ROOT")
    if root:  # measure another checkout's tiering (git worktree add DIR COMMIT)
        from bench_load_path import _CheckoutFinder

        sys.meta_path.insert(0, _CheckoutFinder(Path(root)))
    a.hit_rates = [float(x) for x in a.hit_rates.split(",") if x]
    a.configs = [c for c in a.configs.split(",") if c]
    trace = [float(x) for x in a.trace.split(",") if x]
    print(f"{a.prompts} prompts x {a.tokens} tokens a batch, hit rates {a.hit_rates}, "
          f"jobs take {a.delay} step(s); modeled step = {a.step_ms:g} ms + "
          f"{a.token_us:g} us/token")
    report(run(a), trace)


if __name__ == "__main__":
    main()
