"""Owner-thread cost of the file tier's slot bookkeeping: µs per row on the scheduler thread.

    python docs/bench_file_owner.py [ROWS]

A FileTier of 8192 slots of 4 KiB on /dev/shm (posix engine, sparse slabs) takes ROWS rows
(default 40000) in requests of 256 (so past the first 8192 every row evicts one and reuses its
slot), then every resident key is read back in requests of 256. Timed on the owner thread
only: ``put``, applying a group commit's write results (``_finish_writes``), ``get``, and
applying a run of read results (``_finish_reads``). The I/O itself runs on the tier's threads
and is not in these numbers (it competes for the GIL, so run it on a quiet machine).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from typing import Any


def main() -> None:
    from tiering.backends.file_tier import FileTier
    from tiering.backends.namespace import NamespaceFacts
    from tiering.backends.slab_io import aligned_buffer

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40_000
    row_bytes = 4096
    facts = NamespaceFacts("bench-owner", "bfloat16", "bench", row_bytes, 16)
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(n)]
    row = aligned_buffer(row_bytes)
    spent = {"put": 0.0, "finish_writes": 0.0, "get": 0.0, "finish_reads": 0.0}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        tier = FileTier({"path": d, "capacity": 8192 * row_bytes, "policy": "lru",
                         "io": "posix", "preallocate": False}, facts)

        def timed(name: str, fn: Any) -> Any:
            def run(*args: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    spent[name] += time.perf_counter() - t0
            return run

        tier._finish_writes = timed("finish_writes", tier._finish_writes)  # type: ignore[method-assign]
        tier._finish_reads = timed("finish_reads", tier._finish_reads)  # type: ignore[method-assign]
        put, get = timed("put", tier.put), timed("get", tier.get)
        for s in range(0, n, 256):
            batch = keys[s:s + 256]
            put(batch, [row] * len(batch))
            tier.wait_idle()
        bufs = [aligned_buffer(row_bytes) for _ in range(256)]
        resident = [k for k in keys if tier.contains(k)]
        for s in range(0, len(resident), 256):
            batch = resident[s:s + 256]
            get([(k, b, None) for k, b in zip(batch, bufs, strict=False)])
            tier.wait_idle()
        tier.check()
        tier.close()
    per = {"put": n, "finish_writes": n, "get": len(resident), "finish_reads": len(resident)}
    print(json.dumps({f"{k}_us_per_row": round(v / per[k] * 1e6, 3) for k, v in spent.items()}))


if __name__ == "__main__":
    main()
