"""What a KV connector adds to taking requests in, before the first step (issue 15, 0% hits).

    .venv033/bin/python docs/bench_request_ingest.py [--prompts 1024] [--tokens 512]
        [--configs none,cpu,ours] [--repeat 3]

Why: in the prefill sweep at 0% hits, offloading costs 2-8% of the throughput of no
offloading, for vLLM's ``CPUOffloadingSpec`` and ours alike (docs/benchmarks.md). The step trace
of our 1B engine on the H100 (docs/results/2026-12-05c) shows where: the batch's first step
holds a handful of requests and the next one starts ~0.3 s later, while the engine takes the
other ~1000 requests in; after that the steps are as long as without offloading. With a
connector, vLLM hashes every request's blocks as it takes the request in (its offloading keys
need them), which it skips with prefix caching off and no connector.

What it measures: the same vLLM 0.33 ``Scheduler`` as the engine builds it
(``tests/vllm_harness.py``: the engine core's block hasher, our spec or vLLM's), N unique
prompts added as the engine core adds them (``Request`` with the block hasher, then
``Scheduler.add_request``), timed; then the first ``schedule()``. Per config: the median over
``--repeat`` fresh batches, ms per batch and µs per request.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # bench_load_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--configs", default="none,cpu,ours")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    os.environ.setdefault("TIERING_SHM_DIR", str(tmp / "shm"))
    import bench_load_path as blp
    from vllm_harness import Harness

    model = blp.bench_model(tmp)
    n, tokens = a.prompts, a.tokens
    rng = random.Random(7)
    print(f"{n} prompts x {tokens} tokens, 16-token blocks, prefix caching off")
    print(f"{'config':<8} {'add ms':>8} {'us/request':>11} {'first schedule ms':>18}")
    for config in [c for c in a.configs.split(",") if c]:
        extra = None if config == "none" else blp.extra_for(
            config, n * tokens * blp.BENCH_KV_BYTES_PER_TOKEN * 2 + (64 << 20), 64, 16, 0)
        adds, firsts = [], []
        for rep in range(a.repeat):
            h = Harness(model, extra, gpu_tokens=n * (tokens + 32) + 4096, delay=1,
                        max_len=tokens + 64, batched_tokens=16384, max_num_seqs=1024,
                        prefix_caching=False)
            prompts = [[rng.randrange(4, 500) for _ in range(tokens)] for _ in range(n)]
            gc.collect()
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                h.add(f"r{rep}-{i}", p, max_tokens=1)
            t1 = time.perf_counter()
            h.step()
            t2 = time.perf_counter()
            adds.append(t1 - t0)
            firsts.append(t2 - t1)
            if h.manager is not None:
                h.manager.shutdown()
        add = statistics.median(adds)
        print(f"{config:<8} {add * 1e3:8.1f} {add / n * 1e6:11.1f} "
              f"{statistics.median(firsts) * 1e3:18.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
