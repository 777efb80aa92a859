"""Write-through vs write-back under vLLM 0.33's store pattern, at the chain (no vLLM needed).

gpu-bench's throughput step on the H200 (8 prefixes of 4096 tokens, a CPU tier of half the
working set) ran ``ours-wb`` (write-back) at 2.38 req/s, below no offloading (2.49) and far below
write-through (4.04). This replays the shape of that step's stores: ``--prefixes`` prefixes of
``--chunks`` chunks each stored through a CPU tier of half the working set, ``--per-step``
chunks a scheduler step, each chunk in its own ``prepare_store`` call (vLLM 0.33 prepares one
chunk per call), its ``complete_store`` a step later, and ``--step-ms`` of GPU time per step
(a sleep). Then it counts what the tiers hold and what the scheduler thread spent per store:

* ``in_cpu`` / ``on_disk`` / ``retained``: chunks in the CPU tier, on disk, in either;
* ``refused``: stores the CPU tier turned down (every victim pinned);
* ``writeback_misses``: rows evicted before any write reached the disk;
* ``sched_us_per_store``: scheduler-thread time (prepare/complete/step end) per chunk stored.

    python docs/bench_writeback.py DIR [--rows 1024] [--row-kib 256] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tierutil import facts, key  # noqa: E402

import tiering.backends.staging as staging  # noqa: E402
from tiering.backends.file_tier import FileTier  # noqa: E402
from tiering.backends.staging import StagingRegion  # noqa: E402
from tiering.chain import TierChain  # noqa: E402
from tiering.cpu_tier import CpuTier  # noqa: E402


def run(folder: Path, demote: str, a: argparse.Namespace) -> dict[str, float]:
    row = a.row_kib << 10
    shutil.rmtree(folder, ignore_errors=True)
    tier = FileTier({"path": str(folder), "capacity": 4 * a.rows * row, "policy": "lru",
                     "io": "posix", "demote": demote}, facts(row))
    chain = TierChain(CpuTier(StagingRegion(f"bench-wb-{demote}", a.rows, row), "lru"), [tier])
    keys = [key(f"p{p}c{c}") for p in range(a.prefixes) for c in range(2 * a.rows // a.prefixes)]
    refused, sched, pending = 0, 0.0, []
    for start in range(0, len(keys), a.per_step):
        t = time.perf_counter()
        prepared = []
        for k in keys[start:start + a.per_step]:
            out = chain.prepare_store([k])
            if out is None:
                refused += 1
            else:
                prepared += out[0]
        chain.on_schedule_end()
        chain.complete_store(pending)  # the GPU copies of the step before are done
        pending = prepared
        sched += time.perf_counter() - t
        time.sleep(a.step_ms / 1000)  # the GPU computes this step
    t = time.perf_counter()
    chain.complete_store(pending)
    chain.on_schedule_end()
    sched += time.perf_counter() - t
    time.sleep(a.step_ms / 1000)
    chain.poll()
    st = tier.stats.snapshot()
    out = {"in_cpu": sum(chain.cpu.contains(k) for k in keys),
           "on_disk": sum(k in tier.entries for k in keys),
           "retained": sum(chain.cpu.contains(k) or k in tier.entries for k in keys),
           "chunks": len(keys), "refused": refused,
           "writeback_misses": st.get("writeback_misses", 0),
           "sched_us_per_store": round(sched / len(keys) * 1e6, 1)}
    chain.close()
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--rows", type=int, default=1024, help="CPU tier rows (half the prefixes)")
    ap.add_argument("--row-kib", type=int, default=256)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--per-step", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=20.0)
    a = ap.parse_args()
    staging.SHM_DIR = Path(tempfile.mkdtemp(prefix="bench-wb-shm-", dir="/dev/shm"))
    try:
        for demote in ("on_store", "on_evict"):
            r = run(Path(a.dir) / "bench-wb", demote, a)
            print(f"{demote:<9} {json.dumps(r)}", flush=True)
    finally:
        shutil.rmtree(staging.SHM_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
