"""Disk tiers measured through vLLM's own ``SecondaryTierManager`` interface.

Both tiers are built by vLLM's ``SecondaryTierFactory`` over the same primary (CPU) memory and
driven exactly as vLLM's ``TieringOffloadingManager`` drives them: ``submit_store`` /
``submit_load`` with ``TransferJob``s of ``job_rows`` chunks, up to ``jobs_in_flight`` jobs
outstanding, and ``get_finished_jobs`` polled from one thread (the scheduler's) every
millisecond, as a scheduler step would. Used by ``tiering bench`` (parts ``vllm_tier`` and
``vllm_fs``).

* ``vllm_tier`` — our ``tiering.vllm.FileSecondaryTier`` (config type ``FileTier``) (``io_threads`` = threads).
* ``vllm_fs``   — vLLM's ``fs`` tier (``FileSystemTierManager``): one file per chunk, its C
  extension when built, a job runs on one pool thread; ``n_read_threads`` +
  ``n_write_threads`` = threads (every pool thread serves both queues, so either phase runs on
  all of them: the same I/Os in flight as ours).

Reads are cold for both: written with O_DIRECT, read with O_DIRECT, and between the store and
the load phase the page cache (and dentries/inodes, which the one-file-per-chunk tier needs)
is dropped when permitted, else every file is ``posix_fadvise(DONTNEED)``-ed. Every loaded row
is compared with the bytes stored (destination rows are overwritten before each load, so a
load that moves nothing cannot pass).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiering.backends.slab_io import aligned_buffer
from tiering.bench_common import bench_key, cpu_seconds, drop_caches


def _spec(row_bytes: int, engine: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0",), 0),), worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": row_bytes},
        engine_id=engine, model=OffloadingModelConfig(f"bench-{engine}", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout="LBHNC")
    return TieringOffloadingSpec(cfg)


def make_tier(kind: str, folder: Path, primary: np.ndarray, threads: int, capacity: int,
              io: str = "posix", options: dict[str, Any] | None = None) -> Any:
    """A SecondaryTierManager built by vLLM's factory over ``primary`` (rows x row_bytes)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    rb = primary.shape[1]
    if kind == "vllm_tier":
        conf = {"type": "FileTier", "module_path": "tiering.vllm", "path": str(folder),
                "capacity": capacity, "policy": "lru", "io": io, "io_threads": threads, **(options or {})}
    elif kind == "vllm_fs":
        conf = {"type": "fs", "root_dir": str(folder), "n_read_threads": -(-threads // 2),
                "n_write_threads": max(1, threads // 2)}
    else:
        raise ValueError(f"unknown tier kind {kind!r}")
    return SecondaryTierFactory.create_secondary_tier(conf, primary.data,
                                                      _spec(rb, kind))


def _drive(tier: Any, jobs: list[tuple[list[bytes], np.ndarray]], promotion: bool,
           jobs_in_flight: int) -> int:
    """Submit ``jobs`` keeping up to ``jobs_in_flight`` outstanding; returns failed jobs."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(req_id="bench")
    queue = collections.deque(jobs)
    inflight, failed, next_id = 0, 0, 1
    while queue or inflight:
        while queue and inflight < jobs_in_flight:
            keys, chunk_ids = queue.popleft()
            job = TransferJob(job_id=next_id, keys=keys, chunk_ids=chunk_ids,
                              is_promotion=promotion, req_context=ctx)
            next_id += 1
            inflight += 1
            (tier.submit_load if promotion else tier.submit_store)(job)
        finished = list(tier.get_finished_jobs())
        for r in finished:
            inflight -= 1
            failed += not r.success
        if not finished:
            time.sleep(0.001)  # a scheduler step later
    return failed


def run_interface(kind: str, folder: Path, source: np.ndarray, n_rows: int, threads: int,
                  job_rows: int = 16, jobs_in_flight: int = 0, io: str = "posix",
                  options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Store ``n_rows`` rows (row i = ``source[i % len(source)]``), drop caches, load them all.

    The primary region holds every row (row i in chunk i), so the timed phases do nothing but
    submit and poll; the loaded bytes are compared after the load phase. ``jobs_in_flight``
    defaults to 2 x threads (each vLLM fs job runs on one thread).
    """
    n_src, rb = source.shape
    jobs_in_flight = jobs_in_flight or 2 * threads
    primary = np.frombuffer(aligned_buffer(n_rows * rb), np.uint8).reshape(n_rows, rb)
    for a in range(0, n_rows, n_src):
        primary[a:a + n_src] = source[:n_rows - a]
    tier = make_tier(kind, folder, primary, threads, n_rows * rb, io, options)
    keys = [bench_key(i) for i in range(n_rows)]
    jobs = [(keys[a:a + job_rows], np.arange(a, min(n_rows, a + job_rows), dtype=np.int64))
            for a in range(0, n_rows, job_rows)]
    try:
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        failed_w = _drive(tier, jobs, False, jobs_in_flight)
        tier.drain_jobs()
        write_s, write_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        primary[:] = 0xA5  # a load must overwrite every row
        cold = drop_caches(folder)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        failed_r = _drive(tier, jobs, True, jobs_in_flight)
        read_s, read_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    finally:
        tier.shutdown()
    bad = sum(int((primary[a:a + n_src] != source[:n_rows - a]).any(axis=1).sum())
              for a in range(0, n_rows, n_src))
    total = n_rows * rb
    return {"write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9,
            "cpu_s_per_GB": (write_cpu + read_cpu) / (2 * total / 1e9),
            "write_cpu_s_per_GB": write_cpu / (total / 1e9),
            "read_cpu_s_per_GB": read_cpu / (total / 1e9),
            "bad_rows": bad, "failed_jobs": failed_w + failed_r, "cold": cold,
            "job_rows": job_rows, "jobs_in_flight": jobs_in_flight}
