"""``tiering bench``: the file tier against the raw device (fio) and vLLM's own fs tier.

One run writes then reads ``--total`` bytes in rows of ``--row-bytes`` through each system on the
same filesystem, interleaved per repeat so that the noise of a virtual disk hits all of them
alike, and reports medians. Every byte read back is checked. Reads are cold: O_DIRECT where the
filesystem allows it, and the page cache is dropped before each read phase when permitted.

* ``tier``    — our FileTier (slab files, LMDB index, fdatasync + index commit per batch).
* ``fio``     — sequential O_DIRECT writes/reads of one file, block size = row, iodepth = the
  tier's I/O threads (libaio): what the device gives with the same I/Os in flight.
* ``vllm_fs`` — ``vllm.v1.kv_offload.tiering.fs.io.batch_{store,load}_block`` (one file per
  chunk under hashed folders, its C extension when present), run on the same number of threads
  in batches, from and into the same memory. It does not fsync.

CPU cost is the process's user+system time over bytes moved, both directions averaged, less the
time the benchmark itself spends comparing bytes (fio's own usr+sys for fio).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tiering.backends.io_engines import aligned_buffer
from tiering.backends.sizes import parse_size


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


class Pool:
    """Source rows with distinct random contents; row i of the run uses pool row i % n."""

    def __init__(self, row_bytes: int, n: int, seed: int = 0) -> None:
        self.row_bytes, self.n = row_bytes, n
        self.buf = aligned_buffer(row_bytes * n)
        rng = np.random.default_rng(seed)
        np.frombuffer(self.buf, np.uint8)[:] = rng.integers(0, 256, row_bytes * n, np.uint8)
        self.arr = np.frombuffer(self.buf, np.uint8).reshape(n, row_bytes)

    def row(self, i: int) -> memoryview:
        j = i % self.n
        return self.buf[j * self.row_bytes:(j + 1) * self.row_bytes]

    def check(self, i: int, data: memoryview) -> bool:
        return np.array_equal(np.frombuffer(data, np.uint8), self.arr[i % self.n])


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0"


def run_tier(folder: Path, pool: Pool, n_rows: int, threads: int, io: str) -> dict[str, Any]:
    from tiering.backends.file_tier import FileTier
    from tiering.backends.namespace import NamespaceFacts

    rb = pool.row_bytes
    facts = NamespaceFacts("bench", "bfloat16", "bench", rb, 16)
    cfg = {"path": str(folder), "capacity": n_rows * rb, "policy": "lru", "io": io,
           "io_threads": threads, "slab_file_bytes": "4GiB"}
    tier = FileTier(cfg, facts)
    keys = [_key(i) for i in range(n_rows)]
    cpu0, t0 = _cpu(), time.perf_counter()
    step = max(8, threads * 2)
    for s in range(0, n_rows, step):
        tier.put(keys[s:s + step], [pool.row(i) for i in range(s, min(n_rows, s + step))])
        tier.poll()
    done = tier.wait_idle(timeout=3600)
    write_s, write_cpu = time.perf_counter() - t0, _cpu() - cpu0
    assert all(d.ok for d in done) and len(tier) == n_rows, "tier bench: writes failed"
    engine = tier.engine.describe()
    tier.close()
    dropped = drop_caches()
    tier = FileTier(cfg, facts)
    inflight = max(threads * 2, min(n_rows, (64 << 20) // rb))  # a long prompt's promotion
    outs = [aligned_buffer(rb) for _ in range(inflight)]
    free = list(range(inflight))
    bad, check_cpu = 0, 0.0
    cpu0, t0 = _cpu(), time.perf_counter()
    nxt = 0
    while nxt < n_rows or len(free) < inflight:
        batch = []
        while free and nxt < n_rows:  # like a scheduler step: start every read that fits
            b = free.pop()
            batch.append((keys[nxt], outs[b], (b, nxt)))
            nxt += 1
        assert all(tier.get(batch))
        for r in tier.poll(wait=0.05 if not free else 0.0):
            b, i = r.token
            c0 = time.thread_time()
            bad += (not r.ok) or not pool.check(i, outs[b])
            check_cpu += time.thread_time() - c0
            free.append(b)
    read_s, read_cpu = time.perf_counter() - t0, _cpu() - cpu0 - check_cpu
    tier.close()
    total = n_rows * rb
    return {"write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9,
            "cpu_s_per_GB": (write_cpu + read_cpu) / (2 * total / 1e9), "bad_rows": bad,
            "engine": engine, "cache_dropped": dropped}


def run_fio(folder: Path, row_bytes: int, total: int, iodepth: int) -> dict[str, Any] | str:
    if not shutil.which("fio"):
        return "fio not installed (apt-get install fio)"
    out: dict[str, Any] = {}
    cpu = 0.0
    for rw in ("write", "read"):
        if rw == "read":
            drop_caches()
        cmd = ["fio", "--name=bench", f"--filename={folder / 'fio.dat'}", f"--rw={rw}",
               f"--bs={row_bytes}", f"--size={total}", "--direct=1", "--ioengine=libaio",
               f"--iodepth={iodepth}", "--end_fsync=1", "--output-format=json"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            return f"fio failed: {res.stderr.strip()[:200]}"
        job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
        side = job[rw]
        secs = job["job_runtime"] / 1000 or 1e-9
        out[f"{rw}_GBps"] = side["bw_bytes"] / 1e9
        cpu += (job["usr_cpu"] + job["sys_cpu"]) / 100 * secs
    out["cpu_s_per_GB"] = cpu / (2 * total / 1e9)
    return out


def run_vllm_fs(folder: Path, pool: Pool, n_rows: int, threads: int) -> dict[str, Any] | str:
    try:
        from vllm.v1.kv_offload.tiering.fs import io as fsio
    except Exception as exc:  # vLLM absent or broken
        return f"vllm fs tier unavailable: {type(exc).__name__}: {exc}"
    rb = pool.row_bytes
    use_direct = fsio.probe_o_direct(str(folder))
    paths = []
    for i in range(n_rows):
        h = _key(i)[:32].hex()
        paths.append(str(folder / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"))
    batch = 8
    batches = [list(range(s, min(n_rows, s + batch))) for s in range(0, n_rows, batch)]
    src = pool.buf

    def store(ids: list[int]) -> None:
        fsio.batch_store_block([paths[i] for i in ids], src,
                               [(i % pool.n) * rb for i in ids], rb, use_direct)

    outs = aligned_buffer(rb * batch * threads)
    slots = list(range(threads))
    bad = 0

    check_cpu = [0.0]

    def load(ids: list[int]) -> int:
        s = slots.pop()
        try:
            base = s * batch * rb
            fsio.batch_load_block([paths[i] for i in ids], outs,
                                  [base + j * rb for j in range(len(ids))], rb, use_direct)
            c0 = time.thread_time()
            bad = sum(not pool.check(i, outs[base + j * rb: base + (j + 1) * rb])
                      for j, i in enumerate(ids))
            check_cpu[0] += time.thread_time() - c0  # racy += is fine for a measurement
            return bad
        finally:
            slots.append(s)

    with ThreadPoolExecutor(threads) as ex:
        cpu0, t0 = _cpu(), time.perf_counter()
        list(ex.map(store, batches))
        write_s, write_cpu = time.perf_counter() - t0, _cpu() - cpu0
        drop_caches()
        cpu0, t0 = _cpu(), time.perf_counter()
        bad = sum(ex.map(load, batches))
        read_s, read_cpu = time.perf_counter() - t0, _cpu() - cpu0 - check_cpu[0]
    total = n_rows * rb
    return {"write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9,
            "cpu_s_per_GB": (write_cpu + read_cpu) / (2 * total / 1e9), "bad_rows": bad,
            "o_direct": use_direct}


def run_index(folder: Path, entries: int) -> dict[str, Any]:
    """Reopen cost and lookup rate of a namespace holding ``entries`` records."""
    from tiering.backends.file_tier import FileTier
    from tiering.backends.index import Index, pack_record
    from tiering.backends.namespace import NamespaceFacts

    facts = NamespaceFacts("bench-index", "bfloat16", "bench", 4096, 16)
    cfg = {"path": str(folder), "capacity": entries * 4096, "policy": "arc", "io": "posix",
           "preallocate": False}
    FileTier(cfg, facts).close()
    idx = Index(folder / facts.namespace_id, map_size=(64 << 20) + entries * 2048)
    now = time.time()
    for s in range(0, entries, 100_000):
        recs = [(_key(i), pack_record(i, 4096, 0, 0, now, now - i, i % 3))
                for i in range(s, min(entries, s + 100_000))]
        idx.publish(recs, [])
    idx.close()
    t0 = time.perf_counter()
    if os.environ.get("TIERING_PROFILE_REOPEN"):
        import cProfile

        cProfile.runctx("FileTier(cfg, facts).close()", globals(), locals(), sort="cumtime")
    tier = FileTier(cfg, facts)
    reopen = time.perf_counter() - t0
    keys = [_key(i) for i in range(0, entries, max(1, entries // 200_000))]
    t0 = time.perf_counter()
    hits = sum(map(tier.lookup, keys))
    rate = len(keys) / (time.perf_counter() - t0)
    tier.close()
    return {"index_entries": entries, "reopen_s": reopen, "lookups_per_s": rate,
            "lookup_hits": hits}


def bench(path: str, row_bytes: int, total: int, threads: int, repeat: int, only: str | None,
          io: str, index_entries: int) -> dict[str, Any]:
    n_rows = max(1, total // row_bytes)
    total = n_rows * row_bytes
    pool = Pool(row_bytes, max(1, min(n_rows, (256 << 20) // row_bytes)))
    parts = ["tier"] if only == "tier" else ["tier", "fio", "vllm_fs"]
    runs: dict[str, list] = {p: [] for p in parts}
    notes: list[str] = []
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(repeat):
        for part in parts:
            folder = Path(tempfile.mkdtemp(prefix=f"bench-{part}-", dir=root))
            try:
                if part == "tier":
                    r = run_tier(folder, pool, n_rows, threads, io)
                elif part == "fio":
                    r = run_fio(folder, row_bytes, total, threads)
                else:
                    r = run_vllm_fs(folder, pool, n_rows, threads)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if isinstance(r, str):
                notes.append(f"{part}: {r}")
                runs[part] = None
                parts = [p for p in parts if p != part]
            elif runs[part] is not None:
                runs[part].append(r)

    def med(part: str, field: str) -> float | None:
        rs = runs.get(part)
        return statistics.median(r[field] for r in rs) if rs else None

    out: dict[str, Any] = {"row_bytes": row_bytes, "total_bytes": total, "threads": threads,
                           "repeat": repeat, "io_engine": None}
    for part, prefix in (("tier", "tier"), ("fio", "fio"), ("vllm_fs", "vllm_fs")):
        for f in ("write_GBps", "read_GBps", "cpu_s_per_GB"):
            out[f"{prefix}_{f}"] = med(part, f)
    if runs.get("tier"):
        out["io_engine"] = runs["tier"][0]["engine"]
        out["tier_bad_rows"] = sum(r["bad_rows"] for r in runs["tier"])
        if not runs["tier"][0]["cache_dropped"]:
            notes.append("page cache not dropped (no permission); reads used O_DIRECT only")
    if runs.get("vllm_fs"):
        out["vllm_fs_bad_rows"] = sum(r["bad_rows"] for r in runs["vllm_fs"])
    for a, b in (("tier", "fio"), ("tier", "vllm_fs")):
        for d in ("write", "read"):
            x, y = out.get(f"{a}_{d}_GBps"), out.get(f"{b}_{d}_GBps")
            out[f"ratio_{a}_vs_{b}_{d}"] = x / y if x and y else None
    x, y = out.get("tier_cpu_s_per_GB"), out.get("vllm_fs_cpu_s_per_GB")
    out["ratio_cpu_tier_vs_vllm_fs"] = x / y if x and y else None
    if index_entries:
        folder = Path(tempfile.mkdtemp(prefix="bench-index-", dir=root))
        try:
            out.update(run_index(folder, index_entries))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    out["notes"] = notes
    return out


def _print_table(r: dict[str, Any]) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    print(f"rows {r['row_bytes']} B x {r['total_bytes'] // r['row_bytes']}  threads "
          f"{r['threads']}  repeats {r['repeat']}  engine {r['io_engine']}")
    print(f"{'system':<9} {'write GB/s':>10} {'read GB/s':>10} {'CPU s/GB':>9}")
    for p in ("tier", "fio", "vllm_fs"):
        print(f"{p:<9} {f(r[p + '_write_GBps']):>10} {f(r[p + '_read_GBps']):>10} "
              f"{f(r[p + '_cpu_s_per_GB']):>9}")
    for k, v in r.items():
        if k.startswith("ratio_"):
            print(f"{k:<32} {f(v)}")
    for k in ("index_entries", "reopen_s", "lookups_per_s"):
        if k in r:
            print(f"{k:<32} {r[k]:.2f}" if isinstance(r[k], float) else f"{k:<32} {r[k]}")
    for n in r["notes"]:
        print(f"note: {n}")


def _cmd_bench(args: argparse.Namespace) -> int:
    r = bench(args.path, parse_size(args.row_bytes, "--row-bytes"),
              parse_size(args.total, "--total"), args.threads, args.repeat, args.only, args.io,
              args.index_entries)
    print(json.dumps(r, indent=2)) if args.json else _print_table(r)
    bad = r.get("tier_bad_rows", 0) or r.get("vllm_fs_bad_rows", 0)
    return 1 if bad else 0


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="file tier vs fio vs vLLM's fs tier on the same disk",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a folder on the filesystem to measure (scratch data goes here)")
    p.add_argument("--row-bytes", default="2MiB")
    p.add_argument("--total", default="4GiB")
    p.add_argument("--threads", type=int, default=8, help="I/O threads = I/Os in flight")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--io", default="auto", help="tier I/O engine (auto, posix, kvikio)")
    p.add_argument("--only", choices=["tier"], help="run the tier part alone")
    p.add_argument("--index-entries", type=int, default=0,
                   help="also measure reopen time and lookups/s with this many index entries")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_bench)
