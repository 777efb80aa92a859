"""Mooncake tier throughput and latency between two processes on one host (docs/scale-out.md).

Starts a real ``mooncake_master`` on free localhost ports; a writer process (lending the
segment) stores N rows through a ``MooncakeTier`` from a staging-like mmap; a reader process
(lending nothing, so every byte crosses the transfer engine from the writer's segment) asks the
master which rows exist and reads them into its own mmap, checksums verified; the bytes are
compared. Reports store and read GB/s (first submit to last completion, the tier's own threads),
the exists round trip, and the per-batch latency.

    python docs/bench_mooncake.py [--rows 256] [--row-mib 2] [--batch-rows 16] [--threads 4]
                                  [--protocol tcp] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mooncake_util import MooncakeMaster  # noqa: E402

from tiering.backends.mooncake_tier import MooncakeTier  # noqa: E402
from tiering.backends.namespace import NamespaceFacts  # noqa: E402
from tiering.tier import Lookup  # noqa: E402


def region(rows: int, row: int, seed: int) -> tuple[mmap.mmap, np.ndarray]:
    buf = mmap.mmap(-1, rows * row)
    arr = np.frombuffer(buf, dtype=np.uint8).reshape(rows, row)
    if seed >= 0:
        arr[:] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return buf, arr


def tier(cfg: dict[str, Any], row: int) -> MooncakeTier:
    t = MooncakeTier(cfg, NamespaceFacts("bench", "bfloat16", "NHD", row, 16))
    assert t.wait_connected(30), "no connection to the master"
    return t


def keys_of(rnd: int, n: int) -> list[bytes]:
    return [f"bench-{rnd}-{i}".encode() for i in range(n)]


def writer(cfg: dict[str, Any], rows: int, row: int, rounds: int, q: Any, go: Any) -> None:
    buf, _ = region(rows, row, seed=1)
    t = tier(cfg, row)
    for rnd in range(rounds):
        keys = keys_of(rnd, rows)
        t0 = time.perf_counter()
        out = t.put(keys, [memoryview(buf)[i * row:(i + 1) * row] for i in range(rows)])
        done = t.wait_idle(timeout=600)
        secs = time.perf_counter() - t0
        ok = sum(c.ok for c in done)
        q.put({"round": rnd, "stored": ok, "admitted": len(out.admitted), "store_s": secs,
               "batch_s": [c.seconds for c in done[::cfg["batch_rows"]]]})
    go.wait()  # keep the segment mounted until the reader is done
    t.close()


def reader(cfg: dict[str, Any], rows: int, row: int, rounds: int) -> list[dict[str, Any]]:
    """One client for every round (its first round pays the transfer engine's connections)."""
    buf, arr = region(rows, row, seed=-1)
    src = region(rows, row, seed=1)[1]
    t = tier({**cfg, "segment": 0}, row)
    out = []
    for rnd in range(rounds):
        arr[:] = 0
        keys = keys_of(rnd, rows)
        t0 = time.perf_counter()
        answers = [t.lookup(k) for k in keys]
        while Lookup.RETRY in answers:
            t.poll(wait=0.001)
            answers = [t.lookup(k) for k in keys]
        exists_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        started = t.get([(k, memoryview(buf)[i * row:(i + 1) * row], i)
                         for i, k in enumerate(keys)])
        done = t.wait_idle(timeout=600)
        read_s = time.perf_counter() - t0
        out.append({"hits": sum(a is Lookup.HIT for a in answers), "started": sum(started),
                    "read_ok": sum(c.ok for c in done), "exists_s": exists_s,
                    "read_s": read_s, "bytes_equal": bool(np.array_equal(arr, src)),
                    "batch_s": [c.seconds for c in done[::cfg["batch_rows"]]]})
    t.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--row-mib", type=float, default=2)
    ap.add_argument("--batch-rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    row = int(a.row_mib * (1 << 20)) // 4096 * 4096
    work = Path("/tmp") / f"bench_mooncake_{time.monotonic_ns()}"
    work.mkdir()
    segment = 2 * a.rows * a.rounds * (row + 64) + (64 << 20)
    master = MooncakeMaster(work).start()
    try:
        cfg = {**master.tier_config(), "segment": segment, "local_hostname": "127.0.0.1",
               "protocol": a.protocol, "io_threads": a.threads, "batch_rows": a.batch_rows,
               "timeout_s": 30.0}
        ctx = mp.get_context("spawn")
        q, go = ctx.Queue(), ctx.Event()
        w = ctx.Process(target=writer, args=(cfg, a.rows, row, a.rounds, q, go))
        w.start()
        stores = [q.get(timeout=900) for _ in range(a.rounds)]
        reads = reader(cfg, a.rows, row, a.rounds)
        go.set()
        w.join(60)
    finally:
        master.close()
    nbytes = a.rows * row
    res = {"rows": a.rows, "row_bytes": row, "batch_rows": a.batch_rows, "threads": a.threads,
           "protocol": a.protocol,
           "store_gbps": [round(nbytes / s["store_s"] / 1e9, 2) for s in stores],
           "read_gbps": [round(nbytes / r["read_s"] / 1e9, 2) for r in reads],
           "exists_ms": [round(r["exists_s"] * 1e3, 2) for r in reads],
           "store_batch_ms_p50": round(1e3 * statistics.median(
               x for s in stores for x in s["batch_s"]), 2),
           "read_batch_ms_p50": round(1e3 * statistics.median(
               x for r in reads for x in r["batch_s"]), 2),
           "all_stored": all(s["stored"] == a.rows for s in stores),
           "all_read_equal": all(r["read_ok"] == a.rows and r["bytes_equal"] for r in reads)}
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{a.rows} rows x {row >> 10} KiB, {a.protocol}, {a.threads} threads, "
          f"{a.batch_rows} rows a batch, {a.rounds} rounds (the reader's first is cold)")
    print(f"  store  GB/s {res['store_gbps']}  (batch p50 {res['store_batch_ms_p50']} ms)")
    print(f"  read   GB/s {res['read_gbps']}  (batch p50 {res['read_batch_ms_p50']} ms; "
          f"checksums verified)")
    print(f"  exists {res['exists_ms']} ms for {a.rows} names (one round trip per batch)")
    print(f"  every row stored: {res['all_stored']}; every row read back equal: "
          f"{res['all_read_equal']}")


if __name__ == "__main__":
    main()
