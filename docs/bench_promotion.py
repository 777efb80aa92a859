"""Promotion read speed while vLLM's scheduler re-asks the pending chunks (docs/benchmarks.md).

While a request's disk hits are being promoted, vLLM's scheduler asks for every chunk of the
request again each step, back to back. Those lookups run on the thread that shares the GIL with
the file tier's I/O threads. This times a run of N chunks promoted from a file tier, with the
scheduler modelled two ways: ``spin`` (scans back to back, as vLLM does) and ``sleep`` (1 ms
between scans: the I/O threads never wait for the GIL). Equal speeds mean the scans cost the
reads nothing.

    python docs/bench_promotion.py DIR [--chunks 384] [--row-mib 2] [--threads 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tierutil import facts, key  # noqa: E402

from tiering.backends.file_tier import FileTier  # noqa: E402
from tiering.backends.staging import StagingRegion  # noqa: E402
from tiering.chain import Lookup, TierChain  # noqa: E402
from tiering.cpu_tier import CpuTier  # noqa: E402
from tiering.request_scan import RequestScan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--chunks", type=int, default=384)
    ap.add_argument("--row-mib", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    row, n = a.row_mib << 20, a.chunks
    tier = FileTier({"path": a.dir, "capacity": (n + 8) * row, "policy": "lru", "io": "posix",
                     "io_threads": a.threads}, facts(row))
    chain = TierChain(CpuTier(StagingRegion("promo", n + 8, row), "lru"), [tier])
    keys = [key(i) for i in range(n)]
    for i in range(0, n, 16):
        out = chain.prepare_store(keys[i:i + 16])
        for r in out[1]:
            np.frombuffer(chain.region.row(r), np.uint8)[:] = i % 251
        chain.complete_store(out[0])
        chain.wait_idle()
    for _ in range(a.rounds):
        for mode in ("spin", "sleep"):
            chain.wait_idle()
            chain.reset()  # CPU rows dropped: the next request reads everything from the disk
            req = RequestScan(chain, mode)
            t, scans, pending = time.perf_counter(), 0, True
            while pending:
                pending = False
                for i, k in enumerate(keys):
                    r = req.lookup(k, first_token=16 * i)
                    assert r is not Lookup.MISS
                    pending |= r is Lookup.PENDING
                chain.on_schedule_end()
                scans += 1
                if mode == "sleep":
                    time.sleep(0.001)
            dt = time.perf_counter() - t
            print(f"{mode:5}  {n * row / dt / 1e9:5.2f} GB/s  {dt * 1000:7.1f} ms  "
                  f"{scans} scans", flush=True)
    chain.close()


if __name__ == "__main__":
    main()
