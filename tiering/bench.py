"""``tiering bench``: the file tier against the raw device (fio) and vLLM's own fs tier.

One run writes then reads ``--total`` bytes in rows of ``--row-bytes`` through each system on the
same filesystem, interleaved per repeat so that the noise of a shared machine hits all of them
alike, and reports medians. Every byte read back is compared with what was written (after the
timed phase, so the comparison costs no throughput). Reads are cold: O_DIRECT, and the page
cache (with dentries and inodes) is dropped before each read phase when permitted, else every
file is ``posix_fadvise(DONTNEED)``-ed.

* ``tier``      — our ``FileTier`` API (what ``TieredOffloadingSpec``'s chain calls): slab files,
  LMDB index, fdatasync + index commit per batch, checksums both ways.
* ``vllm_tier`` — the same tier through vLLM's ``SecondaryTierManager`` interface
  (``tiering.vllm.FileTier`` under ``TieringOffloadingSpec``; see ``tiering/vllm/bench_tiers.py``).
* ``vllm_fs``   — vLLM's own ``fs`` tier through the same interface, same threads and memory
  (one file per chunk, its C extension when built; no fsync, no checksums).
* ``fio``       — N threads (``--thread --numjobs=N``, ``psync``, O_DIRECT), each sequential over
  its share of one preallocated file, block size = row: the device with the same I/Os in
  flight and none of the software. ``$TIERING_FIO`` names the binary if it is not ``fio``.
* ``py_io``     — the ceiling of any Python tier: N Python threads doing nothing but the tier's
  system calls (``os.pwritev``/``os.preadv`` of 1 MiB runs of adjacent rows, O_DIRECT, one
  preallocated file, one ``fdatasync`` after the writes) from the same source rows into a
  destination as large as the data, as the tier does (fio reuses one small buffer per thread,
  which stays in the CPU cache).
* ``py_io_xxh3`` — ``py_io`` plus the xxh3 of every row both ways (what the tier adds per byte
  to verify every read), through the tier's own ``checksum_of``.

CPU cost is the process's user+system seconds over bytes moved, both directions averaged
(fio's: its children's rusage).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiering import cli_args
from tiering.backends.namespace import make_dirs
from tiering.backends.slab_io import aligned_buffer
from tiering.bench_common import bench_key, cpu_seconds, drop_caches


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

    def bad_rows(self, rows: np.ndarray) -> int:
        """How many of ``rows`` (row i = run row i) differ from what was written."""
        return sum(int((rows[a:a + self.n] != self.arr[:len(rows) - a]).any(axis=1).sum())
                   for a in range(0, len(rows), self.n))


def run_tier(folder: Path, pool: Pool, n_rows: int, threads: int, io: str) -> dict[str, Any]:
    from tiering.backends.file_tier import FileTier
    from tiering.backends.namespace import NamespaceFacts

    rb = pool.row_bytes
    facts = NamespaceFacts("bench", "bfloat16", "bench", rb, 16)
    cfg = {"path": str(folder), "capacity": n_rows * rb, "policy": "lru", "io": io,
           "io_threads": threads, "slab_file_bytes": "4GiB"}
    tier = FileTier(cfg, facts)
    keys = [bench_key(i) for i in range(n_rows)]
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    step = max(8, threads * 2)
    for s in range(0, n_rows, step):
        tier.put(keys[s:s + step], [pool.row(i) for i in range(s, min(n_rows, s + step))])
        tier.poll()
    done = tier.wait_idle(timeout=3600)
    write_s, write_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    assert all(d.ok for d in done) and len(tier) == n_rows, "tier bench: writes failed"
    engine = tier.io.describe()
    tier.close()
    cold = drop_caches(folder)
    tier = FileTier(cfg, facts)
    out_buf = aligned_buffer(n_rows * rb)  # row i lands at i * rb: compared after timing
    out = np.frombuffer(out_buf, np.uint8).reshape(n_rows, rb)
    out[:] = 0xA5
    window = max(threads * 2, min(n_rows, (64 << 20) // rb))  # a long prompt's promotion
    failed, inflight, nxt = 0, 0, 0
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    while nxt < n_rows or inflight:
        while inflight < window and nxt < n_rows:  # a scheduler step: requests of 16 chunks
            hi = min(n_rows, nxt + 16, nxt + window - inflight)
            batch = [(keys[i], out_buf[i * rb:(i + 1) * rb], i) for i in range(nxt, hi)]
            assert all(tier.get(batch))
            inflight += hi - nxt
            nxt = hi
        for r in tier.poll(wait=0.05 if inflight >= window or nxt >= n_rows else 0.0):
            inflight -= 1
            failed += not r.ok
    read_s, read_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    tier.close()
    total = n_rows * rb
    return {"write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9,
            "cpu_s_per_GB": (write_cpu + read_cpu) / (2 * total / 1e9),
            "write_cpu_s_per_GB": write_cpu / (total / 1e9),
            "read_cpu_s_per_GB": read_cpu / (total / 1e9),
            "bad_rows": failed + pool.bad_rows(out), "engine": engine, "cold": cold}


def run_python_io(folder: Path, pool: Pool, n_rows: int, threads: int,
                  checksum: bool) -> dict[str, Any]:
    """``py_io`` / ``py_io_xxh3``: Python threads issuing the tier's calls and nothing else."""
    import threading

    from tiering.backends.checksum import checksum_of
    from tiering.settings import MIN_RUN_BYTES

    rb = pool.row_bytes
    per_run = max(1, MIN_RUN_BYTES // rb)
    runs = [(a, min(n_rows, a + per_run)) for a in range(0, n_rows, per_run)]
    path = folder / "rows.dat"
    try:  # O_DIRECT as the tier's engine opens slab files, buffered where it is refused
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600), True
    except (OSError, AttributeError):
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT, 0o600), False
    sums = [0] * n_rows
    keys = [bench_key(i) for i in range(n_rows)] if checksum else []
    out_buf = aligned_buffer(n_rows * rb)
    out = np.frombuffer(out_buf, np.uint8).reshape(n_rows, rb)
    out[:] = 0xA5
    failed = [0] * threads  # per thread: no shared counter to race on
    errors: list[BaseException] = []

    def write(k: int) -> None:
        for a, b in runs[k::threads]:
            bufs = [pool.row(i) for i in range(a, b)]
            if checksum:
                for i, buf in zip(range(a, b), bufs, strict=True):
                    sums[i] = checksum_of(0, keys[i], buf)
            os.pwritev(fd, bufs, a * rb)

    def read(k: int) -> None:
        for a, b in runs[k::threads]:
            bufs = [out_buf[i * rb:(i + 1) * rb] for i in range(a, b)]
            os.preadv(fd, bufs, a * rb)
            if checksum:
                for i, buf in zip(range(a, b), bufs, strict=True):
                    failed[k] += checksum_of(0, keys[i], buf) != sums[i]

    def guarded(fn: Callable[[int], None], k: int) -> None:
        try:
            fn(k)
        except BaseException as exc:  # raised in the caller's thread below, never lost
            errors.append(exc)

    def timed(fn: Callable[[int], None]) -> tuple[float, float]:
        workers = [threading.Thread(target=guarded, args=(fn, k)) for k in range(threads)]
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        if fn is write:
            os.fdatasync(fd)
        return time.perf_counter() - t0, cpu_seconds() - cpu0

    try:
        os.posix_fallocate(fd, 0, n_rows * rb)  # preallocated, as the tier's slab files are
        write_s, write_cpu = timed(write)
        cold = drop_caches(folder)
        read_s, read_cpu = timed(read)
    finally:
        os.close(fd)
    total = n_rows * rb
    return {"write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9,
            "cpu_s_per_GB": (write_cpu + read_cpu) / (2 * total / 1e9),
            "write_cpu_s_per_GB": write_cpu / (total / 1e9),
            "read_cpu_s_per_GB": read_cpu / (total / 1e9),
            # a row that came back wrong also fails its checksum: counted once
            "bad_rows": max(sum(failed), pool.bad_rows(out)), "cold": cold,
            "rows_per_call": per_run, "direct": direct}


def fio_binary() -> str | None:
    return os.environ.get("TIERING_FIO") or shutil.which("fio")


def run_fio(folder: Path, row_bytes: int, total: int, threads: int) -> dict[str, Any] | str:
    fio = fio_binary()
    if not fio:
        return "fio not installed (apt-get install fio, or set TIERING_FIO)"
    out: dict[str, Any] = {}
    cpu = 0.0
    share = -(-total // threads // row_bytes) * row_bytes
    path = folder / "fio.dat"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:  # preallocated, as the tier's slab files are
        os.posix_fallocate(fd, 0, share * threads)
    finally:
        os.close(fd)

    def run(rw: str, size: int) -> tuple[dict[str, Any] | str, float]:
        cmd = [fio, "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={row_bytes}",
               f"--size={size}", f"--offset_increment={share}", f"--numjobs={threads}",
               "--thread", "--group_reporting", "--direct=1", "--ioengine=psync",
               "--end_fsync=1", "--output-format=json"]
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run(cmd, capture_output=True, text=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            return f"fio failed: {res.stderr.strip()[:200]}", 0.0
        secs = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        return json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0], secs

    # fio's own start (option parsing, thread and buffer setup) costs ~0.1-0.2 s of CPU; a run
    # of one block per thread measures it, and it is taken out of the per-GB figures
    job, startup = run("read", row_bytes)
    if isinstance(job, str):
        return job
    out["startup_cpu_s"] = startup
    for rw in ("write", "read"):
        out["cold"] = drop_caches(folder) if rw == "read" else None
        job, secs = run(rw, share)
        if isinstance(job, str):
            return job
        out[f"{rw}_GBps"] = job[rw]["bw_bytes"] / 1e9
        secs = max(0.0, secs - startup)
        out[f"{rw}_cpu_s_per_GB"] = secs / (share * threads / 1e9)
        cpu += secs
    out["cpu_s_per_GB"] = cpu / (2 * share * threads / 1e9)
    out["bad_rows"] = 0
    return out


def run_vllm(kind: str, folder: Path, pool: Pool, n_rows: int, threads: int, io: str,
             job_rows: int) -> dict[str, Any] | str:
    """``vllm_tier`` or ``vllm_fs`` through vLLM's SecondaryTierManager interface."""
    try:
        from tiering.vllm.bench_tiers import run_interface
    except Exception as exc:  # vLLM absent or broken
        return f"vLLM's tiering interface unavailable: {type(exc).__name__}: {exc}"
    return run_interface(kind, folder, pool.arr, n_rows, threads, job_rows=job_rows, io=io)


def run_index(folder: Path, entries: int) -> dict[str, Any]:
    """Reopen cost and lookup rate of a namespace holding ``entries`` records."""
    from tiering.backends.file_tier import FileTier
    from tiering.backends.index import Index, pack_record
    from tiering.backends.namespace import NamespaceFacts
    from tiering.tier import Lookup

    facts = NamespaceFacts("bench-index", "bfloat16", "bench", 4096, 16)
    cfg = {"path": str(folder), "capacity": entries * 4096, "policy": "arc", "io": "posix",
           "preallocate": False}
    FileTier(cfg, facts).close()
    idx = Index(folder / facts.namespace_id, map_size=(64 << 20) + entries * 2048)
    now = time.time()
    for s in range(0, entries, 100_000):
        recs = [(bench_key(i), pack_record(i, 4096, 0, 0, now, now - i, i % 3))
                for i in range(s, min(entries, s + 100_000))]
        idx.publish(recs, [])
    idx.close()
    t0 = time.perf_counter()
    if os.environ.get("TIERING_PROFILE_REOPEN"):
        import cProfile

        cProfile.runctx("FileTier(cfg, facts).close()", globals(), locals(), sort="cumtime")
    tier = FileTier(cfg, facts)
    reopen = time.perf_counter() - t0
    keys = [bench_key(i) for i in range(0, entries, max(1, entries // 200_000))]
    t0 = time.perf_counter()
    hits = sum(tier.lookup(k) is Lookup.HIT for k in keys)
    rate = len(keys) / (time.perf_counter() - t0)
    tier.close()
    return {"index_entries": entries, "reopen_s": reopen, "lookups_per_s": rate,
            "lookup_hits": hits}


PARTS = ("tier", "vllm_tier", "vllm_fs", "fio", "py_io", "py_io_xxh3")
FIELDS = ("write_GBps", "read_GBps", "cpu_s_per_GB", "write_cpu_s_per_GB", "read_cpu_s_per_GB")


def bench(path: str, row_bytes: int, total: int, threads: int, repeat: int,
          only: str | None = None, io: str = "auto", index_entries: int = 0,
          parts: list[str] | None = None, job_rows: int = 16) -> dict[str, Any]:
    n_rows = max(1, total // row_bytes)
    total = n_rows * row_bytes
    pool = Pool(row_bytes, max(1, min(n_rows, (256 << 20) // row_bytes)))
    parts = ["tier"] if only == "tier" else list(parts or PARTS)
    runs: dict[str, list[dict[str, Any]] | None] = {p: [] for p in parts}
    notes: list[str] = []
    root = Path(path)
    make_dirs(root)  # 0700 whatever the umask
    for _ in range(repeat):
        for part in parts:
            folder = Path(tempfile.mkdtemp(prefix=f"bench-{part}-", dir=root))
            r: dict[str, Any] | str
            try:
                if part == "tier":
                    r = run_tier(folder, pool, n_rows, threads, io)
                elif part == "fio":
                    r = run_fio(folder, row_bytes, total, threads)
                elif part in ("py_io", "py_io_xxh3"):
                    r = run_python_io(folder, pool, n_rows, threads, part == "py_io_xxh3")
                else:
                    r = run_vllm(part, folder, pool, n_rows, threads, io, job_rows)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if isinstance(r, str):
                notes.append(f"{part}: {r}")
                runs[part] = None
            elif (kept := runs[part]) is not None:
                kept.append(r)
        parts = [p for p in parts if runs[p] is not None]

    def med(part: str, field: str) -> float | None:
        rs = runs.get(part)
        return statistics.median(r[field] for r in rs) if rs else None

    out: dict[str, Any] = {"row_bytes": row_bytes, "total_bytes": total, "threads": threads,
                           "repeat": repeat, "job_rows": job_rows, "io_engine": None}
    for part in PARTS:
        for f in FIELDS:
            out[f"{part}_{f}"] = med(part, f)
        if rs := runs.get(part):
            out[f"{part}_bad_rows"] = sum(r["bad_rows"] for r in rs)
            out[f"{part}_runs"] = rs
    if tier_runs := runs.get("tier"):
        out["io_engine"] = tier_runs[0]["engine"]
    colds = {r.get("cold") for rs in runs.values() if rs for r in rs} - {None}
    out["cold_reads"] = sorted(colds)
    if "fadvise" in colds:
        notes.append("page cache not dropped (no permission): reads are cold through O_DIRECT "
                     "and posix_fadvise(DONTNEED) of every file")
    for a, b in (("tier", "fio"), ("vllm_tier", "fio"), ("tier", "vllm_fs"),
                 ("vllm_tier", "vllm_fs"), ("tier", "py_io_xxh3"), ("vllm_tier", "py_io_xxh3")):
        for d in ("write", "read"):
            x, y = out.get(f"{a}_{d}_GBps"), out.get(f"{b}_{d}_GBps")
            out[f"ratio_{a}_vs_{b}_{d}"] = x / y if x and y else None
    x, y = out.get("vllm_tier_cpu_s_per_GB"), out.get("vllm_fs_cpu_s_per_GB")
    out["ratio_cpu_vllm_tier_vs_vllm_fs"] = x / y if x and y else None
    if index_entries:
        folder = Path(tempfile.mkdtemp(prefix="bench-index-", dir=root))
        try:
            out.update(run_index(folder, index_entries))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    out["notes"] = notes
    return out


def print_table(r: dict[str, Any]) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    print(f"rows {r['row_bytes']} B x {r['total_bytes'] // r['row_bytes']}  threads "
          f"{r['threads']}  repeats {r['repeat']}  engine {r['io_engine']}  "
          f"cold reads: {', '.join(r['cold_reads']) or '-'}")
    print(f"{'system':<10} {'write GB/s':>10} {'read GB/s':>10} {'CPU s/GB':>9} "
          f"{'(write':>7} {'read)':>6} {'bad rows':>8}")
    for p in PARTS:
        if r.get(p + "_write_GBps") is None:
            continue
        print(f"{p:<10} {f(r[p + '_write_GBps']):>10} {f(r[p + '_read_GBps']):>10} "
              f"{f(r[p + '_cpu_s_per_GB']):>9} {f(r[p + '_write_cpu_s_per_GB']):>7} "
              f"{f(r[p + '_read_cpu_s_per_GB']):>6} {r.get(p + '_bad_rows', '-'):>8}")
    for k, v in r.items():
        if k.startswith("ratio_") and v is not None:
            print(f"{k:<36} {f(v)}")
    for k in ("index_entries", "reopen_s", "lookups_per_s"):
        if k in r:
            print(f"{k:<36} {r[k]:.2f}" if isinstance(r[k], float) else f"{k:<36} {r[k]}")
    for n in r["notes"]:
        print(f"note: {n}")


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.total < args.row_bytes:
        raise ValueError(f"--total: {args.total} bytes holds no row of --row-bytes "
                         f"{args.row_bytes}")
    parts = args.parts.split(",") if args.parts else None
    for p in parts or ():
        if p not in PARTS:
            raise ValueError(f"--parts: unknown part {p!r}; expected {', '.join(PARTS)}")
    r = bench(args.path, args.row_bytes, args.total, args.threads, args.repeat, args.only,
              args.io, args.index_entries, parts, args.job_rows)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_table(r)
    bad = sum(r.get(f"{p}_bad_rows", 0) for p in PARTS)
    return 1 if bad else 0


def add_bench_command(sub: argparse._SubParsersAction[cli_args.Parser]) -> None:
    p = sub.add_parser("bench", help="file tier vs fio vs vLLM's fs tier on the same disk",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=cli_args.cache_path,
                   help="a folder on the filesystem to measure (scratch data goes here)")
    p.add_argument("--row-bytes", type=cli_args.size(4096, 1 << 30, multiple=4096),
                   default="2MiB", help="row size, a multiple of 4096 (default 2MiB)")
    p.add_argument("--total", type=cli_args.size(4096, 1 << 44), default="4GiB",
                   help="bytes written and read per system (default 4GiB)")
    p.add_argument("--threads", type=cli_args.integer(1, 1024), default=16,
                   help="I/O threads = I/Os in flight (default 16, the file tier's io_threads)")
    p.add_argument("--repeat", type=cli_args.integer(1, 1000), default=3)
    p.add_argument("--io", default="auto", choices=["auto", "posix", "kvikio"],
                   help="the tier's slab I/O (auto, posix, kvikio)")
    p.add_argument("--only", choices=["tier"], help="run the tier part alone")
    p.add_argument("--parts", help=f"comma-separated subset of {','.join(PARTS)} (default all)")
    p.add_argument("--job-rows", type=cli_args.integer(1, 4096), default=16,
                   help="chunks per vLLM transfer job (vllm_tier, vllm_fs)")
    p.add_argument("--index-entries", type=cli_args.integer(0, 10**9), default=0,
                   help="also measure reopen time and lookups/s with this many index entries")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_bench)
