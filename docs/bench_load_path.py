"""Scheduler-side cost of a CPU-tier load, per block, in a real vLLM Scheduler (issue 15).

    .venv033/bin/python docs/bench_load_path.py [--prompts 256] [--chunk-tokens 16]
        [--configs none,cpu,ours] [--profile DIR]

The prefill sweep's workload without a model: N unique 512-token prompts, max_tokens 1, GPU
prefix caching off, 16-token GPU blocks (CUDA vLLM 0.33 on a machine without a GPU: the
scheduler needs none). A fill batch stores them (the simulated worker of
``tests/vllm_harness.py`` completes every job one step after it was issued), then the same
prompts again as new requests: every full chunk but the last is a CPU hit. Timed: the whole
hit batch through ``Scheduler.schedule`` and ``update_from_output`` (and the connector's
scheduler side and our manager inside them), against the same batch without offloading
(``none``: every token computed). Reported: µs per loaded GPU block, raw and above ``none``
(what the load path adds on the scheduler thread). ``--profile DIR``: the hit batch under
cProfile, summarized by part of the code (``tiering.profiling``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness


def extra_for(config: str, cpu_bytes: int, chunk_tokens: int, block_tokens: int,
              sync_load_bytes: int = 0) -> dict | None:
    if config == "none":
        return None
    extra: dict = {"cpu_bytes_to_use": cpu_bytes}
    if sync_load_bytes:
        extra["sync_load_budget_bytes"] = sync_load_bytes
    if chunk_tokens != block_tokens:
        extra["block_size"] = chunk_tokens
    if config == "cpu":
        extra["spec_name"] = "CPUOffloadingSpec"
    else:
        extra.update(spec_name="TieredOffloadingSpec", spec_module_path="tiering.vllm",
                     tiers=[{"medium": "cpu", "policy": "lru"}])
    return extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=16)
    ap.add_argument("--configs", default="none,cpu,ours")
    ap.add_argument("--repeat", type=int, default=3, help="hit batches timed (median)")
    ap.add_argument("--sync-load-mib", type=float, default=0.0,
                    help="vLLM's sync_load_budget_bytes (MiB of loads a step that run before "
                         "the step's forward pass instead of asynchronously; 0: off)")
    ap.add_argument("--profile", default="", help="folder for the profiles of the hit batch")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    os.environ.setdefault("TIERING_SHM_DIR", str(tmp / "shm"))
    import random
    import statistics

    from vllm_harness import Harness

    from tiering import profiling
    from tiering.tiny_model import build

    model = str(build(tmp / "model", layers=2, hidden=128, heads=2, kv_heads=2,
                      intermediate=256, max_pos=4096))
    kvb = 2 * 2 * 64 * 2 * 4  # layers x kv heads x head dim x (K, V) x float32
    n, tokens = a.prompts, a.tokens
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 500) for _ in range(tokens)] for _ in range(n)]
    results: dict[str, dict] = {}
    print(f"{n} prompts x {tokens} tokens, {a.chunk_tokens}-token chunks; hit batch timed "
          f"{a.repeat}x (median)")
    for config in [c for c in a.configs.split(",") if c]:
        cpu_bytes = int(n * tokens * kvb * 1.5) + (64 << 20)
        h = Harness(model, extra_for(config, cpu_bytes, a.chunk_tokens, 16,
                                     int(a.sync_load_mib * 2**20)),
                    gpu_tokens=n * (tokens + 32) + 4096, delay=1, max_len=tokens + 64,
                    batched_tokens=16384, max_num_seqs=1024, prefix_caching=False)
        assert h.block_size == 16, f"GPU block size {h.block_size}: run with CUDA vLLM 0.33"
        for i, p in enumerate(prompts):  # the fill batch stores every prompt
            h.add(f"fill-{i}", p, max_tokens=1)
        h.run(max_steps=100_000)
        times, loaded = [], []
        for rep in range(a.repeat + (1 if a.profile else 0)):
            prof = rep == a.repeat  # one more batch under the profiler
            h.cached.clear()
            for i, p in enumerate(prompts):
                h.add(f"hit{rep}-{i}", p, max_tokens=1)
            gc.collect()
            if prof:
                path = Path(a.profile) / f"bench_load_path_{config}_{a.chunk_tokens}.pstats"
                path.parent.mkdir(parents=True, exist_ok=True)
                profiling.start_profile(None, str(path))
            t0 = time.perf_counter()
            h.run(max_steps=100_000)
            took = time.perf_counter() - t0
            if prof:
                profiling.stop_profile(None, str(path))
                blocks = sum(h.cached.values()) / 16
                text = profiling.summarize(str(path), blocks=max(blocks, 1.0))
                path.with_suffix(".txt").write_text(text + "\n")
                print(text.split("\ntop ")[0])
                continue
            times.append(took)
            loaded.append(sum(h.cached.values()) / 16)
        t = statistics.median(times)
        blocks = statistics.median(loaded)
        results[config] = {"s": t, "blocks": blocks, "steps": h.step_no}
        if h.manager is not None:
            h.manager.shutdown()
        del h
        gc.collect()
    base = results.get("none", {}).get("s")
    print(f"{'config':<6} {'batch s':>8} {'blocks loaded':>14} {'us/block':>9} "
          f"{'above none us/block':>20} {'us/prompt':>10}")
    for config, r in results.items():
        per = 1e6 * r["s"] / r["blocks"] if r["blocks"] else float("nan")
        above = 1e6 * (r["s"] - base) / r["blocks"] if r["blocks"] and base else float("nan")
        print(f"{config:<6} {r['s']:8.3f} {r['blocks']:14.0f} {per:9.1f} {above:20.1f} "
              f"{1e6 * r['s'] / n:10.0f}")


if __name__ == "__main__":
    main()
