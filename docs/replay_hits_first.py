"""The prefill sweep's mixed batches replayed in a real vLLM 0.33 scheduler with a clock: where
hits first (tiering/vllm/hits_first.py) moves the batch's end, before a GPU says so.

    .venv033/bin/python docs/replay_hits_first.py [--prompts 256] [--hit-rates 20,50,80]

What is real: vLLM 0.33's ``Scheduler`` (under ``TieringSyncScheduler``, hits first on and
off), its offloading connector and our spec's manager and CPU tier, deciding every admission,
load and step. What is modelled (the H200's 8B shape by default, docs/benchmarks.md): a step
takes ``--step-s`` plus ``1 / --tokens-per-s`` per token it computes (``--idle-step-s`` with
nothing to compute); each load job crosses PCIe on one copy engine, in issue order, at
``--copy-gbps`` for its tokens' KV (``--kv-bytes-per-token``), from the start of the step that
issued it; a load is reported to the scheduler at the first step end after it landed. Stores
are left out (they take the other copy engine). The workload is the sweep's: a fill batch of N
unique 512-token prompts, then a batch in which a share of them are seen again, shuffled among
new ones (``benchmarks.gpu_bench.sweep_batches``), max_tokens 1, GPU prefix caching off,
vLLM's default step budget on an H200 (16384 tokens).

Printed per hit rate and order: the batch's modelled seconds, its tokens/s, the steps it took,
the last step in which a load started, and when the last loaded and the last computed request
got their token. A model, not a measurement: the GPU run decides (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness
sys.path.insert(0, str(HERE.parent))  # benchmarks


def extra(rows: int, hits_first: bool) -> dict:
    return {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
            "block_size": 64, "cpu_bytes_to_use": rows * (16 << 10) * 4 * 2,
            "tiers": [{"medium": "cpu", "policy": "lru"}], "hits_first": hits_first}


def replay(a: argparse.Namespace, model: str, rate: float, hits_first: bool) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm_harness import Harness

    from benchmarks.gpu_bench import sweep_batches
    from tiering.vllm.scheduler import TieringSyncScheduler

    n, tokens = a.prompts, 512
    chunks = n * tokens // 64
    h = Harness(model, extra(int(chunks * 1.5) + 64, hits_first), gpu_tokens=2 * n * (tokens + 16),
                delay=0, max_len=tokens + 16, batched_tokens=16384, max_num_seqs=1024,
                prefix_caching=False, scheduler_cls=TieringSyncScheduler)
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 500) for _ in range(tokens)] for _ in range(2 * n)]
    plan = sweep_batches(n, [rate])
    clock = {"t": 0.0, "engine_free": 0.0}
    jobs: dict[int, tuple[float, str | None]] = {}  # job -> (lands at, load request)
    first_token: dict[str, float] = {}
    loaded: set[str] = set()
    steps = 0
    last_load_step = -1

    def step() -> None:
        nonlocal steps, last_load_step
        s = h.scheduler
        out = s.schedule()
        start = clock["t"]
        meta = out.kv_connector_metadata
        for j, job in meta.load_jobs.items():
            req = s.requests[job.req_id]
            nbytes = (req.num_computed_tokens or tokens) * a.kv_bytes_per_token
            begin = max(start, clock["engine_free"])
            clock["engine_free"] = begin + nbytes / (a.copy_gbps * 1e9)
            jobs[j] = (clock["engine_free"], job.req_id)
            loaded.add(job.req_id)
            last_load_step = steps
        for j in meta.store_jobs:
            jobs[j] = (start, None)  # stores: the other copy engine, not modelled
        computed = sum(out.num_scheduled_tokens.values())
        dur = a.step_s + computed / a.tokens_per_s if computed else a.idle_step_s
        clock["t"] = end = start + dur
        steps += 1
        done = {j for j, (at, _) in jobs.items() if at <= end}
        recv = {jobs[j][1] for j in done if jobs[j][1] is not None}
        for j in done:
            del jobs[j]
        running = [r for r in s.running if out.num_scheduled_tokens.get(r.request_id)]
        reqs = [r.request_id for r in running]
        sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in running]
        for r, smp in zip(running, sampled, strict=True):
            if smp and r.request_id not in first_token:
                first_token[r.request_id] = end
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=recv or None,
                kv_connector_worker_meta=OffloadingWorkerMetadata(
                    completed_jobs=dict.fromkeys(done, 1)))))

    def run_batch(ids: list[int], tag: str) -> None:
        for i in ids:
            h.add(f"{tag}{i}", prompts[i], max_tokens=1)
        for _ in range(100_000):
            if not h.scheduler.requests and not jobs:
                return
            step()
        raise AssertionError("the batch did not finish")

    fill = plan[0][2]
    run_batch(fill, "f")
    _, _, batch = plan[-1]
    clock["t"] = clock["engine_free"] = 0.0
    first_token.clear()
    loaded.clear()
    steps, last_load_step = 0, -1
    run_batch(batch, "b")
    wall = max(first_token.values())
    hits = [t for r, t in first_token.items() if r in loaded]
    computed = [t for r, t in first_token.items() if r not in loaded]
    h.manager.shutdown()
    return {"rate": rate, "hits_first": hits_first, "wall_s": wall,
            "tokens_per_s": n * tokens / wall, "steps": steps, "last_load_step": last_load_step,
            "loaded": len(hits), "last_loaded_s": max(hits, default=0.0),
            "last_computed_s": max(computed, default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--hit-rates", default="20,50,80")
    ap.add_argument("--tokens-per-s", type=float, default=37_000.0,
                    help="the engine's prefill rate (H200, 8B: no offloading's 37k)")
    ap.add_argument("--step-s", type=float, default=0.01, help="a step's fixed cost")
    ap.add_argument("--idle-step-s", type=float, default=0.002, help="a step with no compute")
    ap.add_argument("--copy-gbps", type=float, default=48.0, help="loads over PCIe (H200)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=128 << 10, help="8B: 128 KiB")
    a = ap.parse_args()
    from benchmarks.tiny_model import build

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build(Path(tmp) / "model", layers=2, hidden=128, heads=2, kv_heads=2,
                          intermediate=256, max_pos=4096))
        none_s = a.prompts * 512 / a.tokens_per_s + a.step_s * (-(-a.prompts * 512 // 16384))
        print(f"no offloading (model): {none_s:.2f} s, {a.prompts * 512 / none_s:.0f} tok/s")
        print("| hits | order | batch s | tokens/s | x none | steps | last load starts at step "
              "| last loaded / computed request served at s |")
        print("|---|---|---|---|---|---|---|---|")
        for rate in (float(x) for x in a.hit_rates.split(",")):
            for hf in (False, True):
                r = replay(a, model, rate, hf)
                print(f"| {rate:g}% | {'hits first' if hf else 'vLLM order'} | "
                      f"{r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | "
                      f"{r['tokens_per_s'] * none_s / (a.prompts * 512):.2f} | {r['steps']} | "
                      f"{r['last_load_step']} | {r['last_loaded_s']:.2f} / "
                      f"{r['last_computed_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
