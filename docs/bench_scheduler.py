"""Scheduler-side cost of the tier chain: µs per chunk at 100k resident chunks.

    python docs/bench_scheduler.py [CHUNKS]

A TierChain with CHUNKS CPU rows (4 KiB each, in a temp folder) and one file tier, filled to
the brim; then lookups (hits in CPU, misses that also ask the file tier) and prepare_store +
complete_store of new chunks (each evicting one) are timed per chunk, in batches of 16 chunks
(one request's worth), as vLLM's scheduler calls them. No I/O is timed: the file tier's
admission (store_threshold) is set so that it writes nothing. The "per request" column times
lookups the way the vLLM adapter makes them: with a request's record (``RequestScan``, one
per 16 chunks) and each chunk's position.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    tmp = Path(tempfile.mkdtemp(prefix="bench-sched-"))
    os.environ["TIERING_SHM_DIR"] = str(tmp / "shm")
    import tiering.backends.staging as staging

    staging.SHM_DIR = tmp / "shm"
    from tiering.backends.file_tier import FileTier
    from tiering.backends.namespace import NamespaceFacts
    from tiering.backends.staging import StagingRegion
    from tiering.bench_common import bench_key
    from tiering.chain import TierChain
    from tiering.cpu_tier import CpuTier

    facts = NamespaceFacts("bench-sched", "bfloat16", "bench", 4096, 16)
    from tiering.request_scan import RequestScan

    print(f"{'policy':<7} {'lookup hit':>11} {'per request':>12} {'lookup miss':>12} "
          f"{'store (evicting)':>17}  µs/chunk")
    for policy in ("lru", "arc", "s3fifo"):
        disk = FileTier({"path": str(tmp / f"disk-{policy}"), "capacity": 2 * n * 4096,
                         "io": "posix", "preallocate": False, "store_threshold": 1_000_000},
                        facts)
        chain = TierChain(CpuTier(StagingRegion(f"bench-{policy}", n, 4096), policy, 0),
                          file_tiers=[disk])
        keys = [bench_key(i) for i in range(n)]
        for s in range(0, n, 16):
            out = chain.prepare_store(keys[s:s + 16])
            chain.complete_store(out[0])
        t0 = time.perf_counter()
        for k in keys:
            chain.lookup(k)
        hit = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for s in range(0, n, 16):
            req = RequestScan(chain, str(s))
            for j, k in enumerate(keys[s:s + 16]):
                req.lookup(k, first_token=16 * j)
        per_request = (time.perf_counter() - t0) / n * 1e6
        missing = [bench_key(n + i) for i in range(n)]
        t0 = time.perf_counter()
        for k in missing[: n // 4]:
            chain.lookup(k)
        miss = (time.perf_counter() - t0) / (n // 4) * 1e6
        t0 = time.perf_counter()
        m = n // 4
        for s in range(0, m, 16):
            out = chain.prepare_store(missing[s:s + 16])
            chain.complete_store(out[0])
        store = (time.perf_counter() - t0) / m * 1e6
        print(f"{policy:<7} {hit:>11.2f} {per_request:>12.2f} {miss:>12.2f} {store:>17.2f}")
        chain.close()
        chain.region.close(unlink=True)


if __name__ == "__main__":
    main()
