"""A long prompt's disk hit through the scheduler-side managers, as vLLM's scheduler drives them.

gpu-bench's 32k disk phase on the H200 took 4.0 s through our ``TieredOffloadingSpec`` and
3.3 s through vLLM's ``TieringOffloadingSpec`` over the very same ``FileTier``: the difference
is in the scheduler side, which needs no GPU. This builds both managers from their specs
(vLLM 0.33's config types), stores a prompt of ``--chunks`` chunks, pushes it out of the CPU
tier with filler prompts (a quarter more than the CPU tier holds, as gpu-bench does), waits for
the writes, and then times the disk hit the way vLLM's scheduler asks for it: every step, a
scan of the prompt's chunks (``lookup`` until a miss, positions recorded in the request's
context) and ``on_schedule_end``, back to back, until every chunk is a HIT; then
``prepare_load``/``complete_load`` (the GPU copy itself is not modelled). Then the same after a
restart (a new manager over the same folder, a fresh staging region).

Systems: ``ours`` (our spec: CPU tier + file tier, write-through, ``promote: always`` unless
``--promote auto``) and ``vtier-ours`` (vLLM's TieringOffloadingSpec, our FileTier as its
secondary tier). Both read with ``io_threads`` = ``--threads``. Needs vLLM 0.33 (``.venv033``).

    python docs/bench_disk_hit.py DIR [--chunks 512] [--row-mib 2] [--threads 8] [--rounds 3]
           [--systems ours,vtier-ours] [--json OUT.json]

Prints one line per measurement: milliseconds to all-HIT, GB/s, scheduler steps, the longest
step (the scan that reserved the promotions) and what a re-ask costs the scheduler thread per
chunk (the median over the scans after the first that found reads still pending). Then fio
(``$TIERING_FIO``, ``fio`` on PATH or ``.device/fio/fio``) reads the same bytes of the same slab
file that the last round's ``ours`` promoted from (O_DIRECT, psync, ``--threads`` jobs, one row
per block) and the promotion rates are given as a share of fio's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _config(extra: dict[str, Any], engine: str, block_bytes: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0",), 0),), worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False, extra_config=extra, engine_id=engine,
        model=OffloadingModelConfig("bench-disk-hit", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout="LBHNC")


def make_manager(system: str, folder: Path, cpu_bytes: int, disk_bytes: int, threads: int,
                 row_bytes: int, promote: str, engine: str, switch_ms: float | None = None
                 ) -> Any:
    """The scheduler-side manager of ``system``, built by its spec (as vLLM builds it)."""
    file_tier = {"path": str(folder), "capacity": disk_bytes, "policy": "lru", "io": "posix",
                 "io_threads": threads}
    if system == "ours":
        from tiering.vllm import TieredOffloadingSpec

        if switch_ms is not None:  # the bench's own switch interval, not the spec's
            extra_ours = {"switch_interval_ms": 0}
        else:
            extra_ours = {}

        # the rows are one block each: named, so that on a CUDA machine the spec does not
        # choose its 64-token default chunk (4x the rows' bytes: the CPU tier then held a
        # quarter of the rows and refused the prompt's second step)
        extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
                 "cpu_bytes_to_use": cpu_bytes, "blocks_per_chunk": 1,
                 "tiers": [{"medium": "cpu", "policy": "lru", "promote": promote},
                           {"medium": "file", **file_tier}], **extra_ours}
        return TieredOffloadingSpec(_config(extra, engine, row_bytes)).get_manager()
    if system == "vtier-ours":
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                 "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                                      **file_tier}]}
        return TieringOffloadingSpec(_config(extra, engine, row_bytes)).get_manager()
    raise ValueError(f"unknown system {system!r}: expected ours or vtier-ours")


def keys_of(prompt: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prompt}:{i}".encode()).digest() for i in range(n)]


def _schedule_end() -> Any:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _context(req_id: str, keys: list[bytes]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    return ctx


def store(mgr: Any, req_id: str, keys: list[bytes], per_step: int = 512) -> None:
    """Store a prompt's chunks as vLLM does, a step's worth at a time (the GPU copy into the
    rows is not modelled: the rows keep whatever they held)."""
    ctx = _context(req_id, keys)
    mgr.on_new_request(ctx)
    for a in range(0, len(keys), per_step):
        part = keys[a:a + per_step]
        out = mgr.prepare_store(part, ctx)
        mgr.on_schedule_end(_schedule_end())
        if out is None:
            raise RuntimeError(f"{req_id}: the CPU tier refused to store chunks {a}..")
        mgr.complete_store(list(out.keys_to_store), ctx)
    mgr.on_request_finished(ctx)


def drain(mgr: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        if time.monotonic() > deadline:
            raise TimeoutError("writes still pending")
        mgr.on_schedule_end(_schedule_end())
        time.sleep(0.002)


def disk_hit(mgr: Any, req_id: str, keys: list[bytes]) -> dict[str, Any]:
    """Scan every step until all chunks are HITs; ms, steps, and how many were hits."""
    from vllm.v1.kv_offload.base import LookupResult

    ctx = _context(req_id, keys)
    mgr.on_new_request(ctx)
    t0, steps, hits, longest = time.perf_counter(), 0, 0, 0.0
    rescans: list[float] = []  # per chunk, the scans after the first that found reads pending
    while True:
        steps += 1
        t_step = time.perf_counter()
        hits, pending = 0, False
        for k in keys:
            r = mgr.lookup(k, ctx)
            if r is LookupResult.MISS:
                break
            hits += 1
            pending |= r is not LookupResult.HIT
        if steps > 1 and pending and hits:
            rescans.append((time.perf_counter() - t_step) / hits)
        mgr.on_schedule_end(_schedule_end())
        longest = max(longest, time.perf_counter() - t_step)
        if not pending or steps > 100000:
            break
    seconds = time.perf_counter() - t0
    if hits:
        mgr.prepare_load(keys[:hits], ctx)
        mgr.complete_load(keys[:hits], ctx)
    mgr.on_request_finished(ctx)
    # the longest step is the one whose scan reserved the promotions (and issued the reads)
    # what vLLM's every re-ask of a waiting request costs the scheduler thread, per chunk
    rescan_us = 1e6 * statistics.median(rescans) if rescans else None
    return {"ms": 1000 * seconds, "steps": steps, "hits": hits, "longest_step_ms": 1000 * longest,
            "rescan_us_per_chunk": rescan_us}


def slot_reads_max() -> int:
    from tiering.backends import slot_reads

    return slot_reads.MAX_READ_RUN_BYTES


def fio_binary() -> str | None:
    from tiering.bench import fio_binary as on_path

    here = Path(__file__).resolve().parent.parent / ".device" / "fio" / "fio"
    return on_path() or (str(here) if here.is_file() else None)


def fio_read(path: Path, row_bytes: int, total: int, threads: int) -> dict[str, Any] | str:
    """fio reading the first ``total`` bytes of ``path`` as ``threads`` sequential shares."""
    fio = fio_binary()
    if fio is None:
        return "fio not found ($TIERING_FIO, PATH, .device/fio/fio)"
    share = max(row_bytes, total // threads // row_bytes * row_bytes)
    cmd = [fio, "--name=promotion-bytes", f"--filename={path}", "--rw=read",
           f"--bs={row_bytes}", f"--size={share}", f"--offset_increment={share}",
           f"--numjobs={threads}", "--thread", "--group_reporting", "--direct=1",
           "--ioengine=psync", "--output-format=json"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return f"fio failed: {res.stderr.strip()[:300]}"
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    return {"GBps": job["read"]["bw_bytes"] / 1e9, "bytes": share * threads, "file": str(path),
            "fio": fio}


def rows_read(path: Path, row_bytes: int, total: int, threads: int, run_rows: int) -> dict[str, Any]:
    """The floor of our read path without the tier: plain ``preadv`` into distinct rows
    (``bench_read_floor.one_read``, no checksum, an idle main thread, this process's switch
    interval). fio reads every block of a job into the same few buffers, hot in the CPU's
    caches; where the device is memory (a RAM disk) that is an advantage no promotion has."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_read_floor import one_read

    gbps = one_read(str(path), total, row_bytes, threads, run_rows, "anon", False, False,
                    sys.getswitchinterval())
    return {"GBps": gbps, "bytes": total, "run_rows": run_rows}


def run_system(system: str, root: Path, a: argparse.Namespace, row: int,
               rnd: int, keep: bool = False) -> list[dict[str, Any]]:
    folder = root / system
    shutil.rmtree(folder, ignore_errors=True)
    n = a.chunks
    cpu_rows = int(n * 1.125) + 1
    fill_prompts = int(cpu_rows * 1.25 // n) + 1
    disk_bytes = int((n * (1 + fill_prompts)) * row * 1.1)
    out = []
    engine = f"diskhit-{system}-{rnd}"
    mgr = make_manager(system, folder, cpu_rows * row, disk_bytes, a.threads, row, a.promote,
                       engine, a.switch_ms)
    try:
        prompt = keys_of(rnd * 1000, n)
        store(mgr, "prompt", prompt)
        drain(mgr)  # a long prompt's prefill gives the disk seconds: its writes are done
        for f in range(fill_prompts):
            store(mgr, f"fill{f}", keys_of(rnd * 1000 + 1 + f, n))
            drain(mgr)
        r = disk_hit(mgr, "hit", prompt)
        out.append({"system": system, "phase": "disk", "round": rnd, **r})
    finally:
        mgr.shutdown()
    mgr = make_manager(system, folder, cpu_rows * row, disk_bytes, a.threads, row, a.promote,
                       engine + "r", a.switch_ms)
    try:
        r = disk_hit(mgr, "restart", prompt)
        out.append({"system": system, "phase": "restart", "round": rnd, **r})
    finally:
        mgr.shutdown()
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    for r in out:
        r["GBps"] = r["hits"] * row / (r["ms"] / 1000) / 1e9
        print(f"{r['system']:<11} {r['phase']:<8} round {rnd}: {r['ms']:7.1f} ms  "
              f"{r['GBps']:5.2f} GB/s  {r['steps']:4d} steps (longest {r['longest_step_ms']:.0f} ms)  "
              f"{r['hits']}/{n} hits, a re-ask {r['rescan_us_per_chunk'] or 0:.2f} us a chunk",
              flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--row-mib", type=float, default=2)
    ap.add_argument("--threads", type=int, default=16)  # the file tier's io_threads
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="ours,vtier-ours")
    ap.add_argument("--promote", default="always", choices=("always", "auto"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--read-run-mib", type=float, default=None,
                    help="the largest vectored read of adjacent slots (tiering.settings."
                         "MAX_READ_RUN_BYTES; default: the setting's value), for A/B runs")
    ap.add_argument("--lookup-poll-s", type=float, default=None,
                    help="ours: how often a lookup applies finished reads (tiering.settings."
                         "LOOKUP_POLL_INTERVAL_S; 0: at every lookup, as before it was set)")
    ap.add_argument("--switch-ms", type=float, default=None,
                    help="the interpreter's switch interval (sys.setswitchinterval) in ms "
                         "for every system, ours' spec told to leave it (default: ours' spec "
                         "lowers it to its switch_interval_ms for the rest of the process)")
    a = ap.parse_args()
    if a.switch_ms is not None:
        sys.setswitchinterval(a.switch_ms / 1000)
    if a.read_run_mib is not None:
        from tiering.backends import slot_reads

        slot_reads.MAX_READ_RUN_BYTES = int(a.read_run_mib * 2**20)
    if a.lookup_poll_s is not None:
        from tiering import chain

        chain.LOOKUP_POLL_INTERVAL_S = a.lookup_poll_s
    row = int(a.row_mib * 2**20) // 4096 * 4096
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    results: list[dict[str, Any]] = []
    systems = [s for s in a.systems.split(",") if s]
    for rnd in range(a.rounds):  # interleaved: the machine's drift hits every system alike
        order = systems
        if rnd == a.rounds - 1 and "ours" in systems:
            # the last round's ``ours`` keeps its folder for fio: it runs last, so that no
            # other system's cache has to fit beside it (a 26 GiB RAM disk holds one, not
            # two: the H200's disk-hit step failed there, 2026-12-04)
            order = [s for s in systems if s != "ours"] + ["ours"]
        for system in order:
            last = rnd == a.rounds - 1 and system == "ours"
            results += run_system(system, root, a, row, rnd, keep=last)
    summary: dict[str, Any] = {}
    slabs = sorted((root / "ours").glob("*/slab-0000.dat"))
    if slabs:
        fio = fio_read(slabs[0], row, a.chunks * row, a.threads)
        summary["fio"] = fio
        if isinstance(fio, dict):
            print(f"fio        read the same file: {fio['GBps']:5.2f} GB/s "
                  f"({fio['bytes'] >> 20} MiB, {a.threads} jobs, {row >> 10} KiB blocks)")
        else:
            print(f"fio: {fio}")
        per_run = max(1, slot_reads_max() // row)
        raw = rows_read(slabs[0], row, a.chunks * row, a.threads, per_run)
        summary["rows_read"] = raw
        print(f"preadv     into distinct rows: {raw['GBps']:5.2f} GB/s ({per_run} rows a call, "
              f"{a.threads} threads)")
        shutil.rmtree(root / "ours", ignore_errors=True)
    for system in systems:
        for phase in ("disk", "restart"):
            ms = [r["ms"] for r in results if r["system"] == system and r["phase"] == phase]
            if ms:
                med = statistics.median(ms)
                summary[f"{system}_{phase}_ms"] = med
                gbps = a.chunks * row / (med / 1000) / 1e9
                of_fio = ""
                if isinstance(summary.get("fio"), dict):
                    share = gbps / summary["fio"]["GBps"]
                    summary[f"{system}_{phase}_of_fio"] = share
                    of_fio = f", {100 * share:.0f}% of fio"
                us = [r["rescan_us_per_chunk"] for r in results if r["system"] == system
                      and r["phase"] == phase and r.get("rescan_us_per_chunk") is not None]
                rescan = ""
                if us:
                    summary[f"{system}_{phase}_rescan_us_per_chunk"] = statistics.median(us)
                    rescan = f"; a re-ask {statistics.median(us):.2f} us a chunk"
                print(f"median {system:<11} {phase:<8} {med:7.1f} ms = {gbps:5.2f} GB/s{of_fio} "
                      f"({', '.join(f'{x:.0f}' for x in ms)}){rescan}")
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv[1:], "results": results,
                                            "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
