"""Copies between KV-cache blocks and staging rows: descriptors and copy engines.

vLLM-agnostic on purpose, so the GPU benchmark runs where vLLM is not installed: the caller
passes each KV tensor's base address, block stride and page size, and which tensors each KV
group uses. ``CopyLayout.descriptors`` turns one job (block ids, group sizes, first logical
block per group, row ids) into three int64 arrays (device address, row address, bytes), one
entry per (block, tensor ref); ``merge_runs`` joins entries that continue each other on both
sides. Both engines take those arrays:

* ``MemcpyEngine`` — host-only (vLLM's CPU platform and CI): ``ctypes.memmove`` per run.
* ``CudaCopyEngine`` — the rows are registered with CUDA as pinned memory (in segments: one
  registration of tens of GiB can fail), one stream per direction plus one for expedited loads,
  each job one ``cudaMemcpyBatchAsync`` per ≤1024 runs (per-run ``cudaMemcpyAsync`` where the
  batch API is missing), a CUDA event per job for completion and timing. Torch and
  cuda-bindings are imported when the engine is built, never at module import.

Engines never report a failed job (vLLM asserts on failures): a copy API error raises at once,
which vLLM treats as a fatal worker error rather than silently serving wrong KV.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)
BATCH_MAX = 1024  # descriptors per cudaMemcpyBatchAsync call (larger calls measured slower)
REGISTER_SEGMENT = 1 << 30


@dataclass
class TensorInfo:
    base: int  # address of block 0
    stride: int  # bytes from one block to the next
    page: int  # bytes of one block's page (padded)


@dataclass
class Finished:
    job_id: int
    size: int
    seconds: float


class CopyLayout:
    """Where each KV tensor's pages live on the device and in a staging row."""

    def __init__(self, tensors: Sequence[TensorInfo], group_refs: Sequence[Sequence[tuple[int, int]]],
                 row_base: int, row_bytes: int, rank: int, cell_bytes: int,
                 blocks_per_chunk: int) -> None:
        self.tensors, self.refs, self.bpc = list(tensors), group_refs, blocks_per_chunk
        offsets = np.cumsum([0] + [t.page * blocks_per_chunk for t in self.tensors])
        if offsets[-1] > cell_bytes:
            raise ValueError(f"KV pages need {offsets[-1]} bytes per chunk per worker but the "
                             f"row gives each worker {cell_bytes}")
        self.tensor_off = offsets[:-1].tolist()
        self.row_base = row_base + rank * cell_bytes
        self.row_bytes = row_bytes

    def descriptors(self, block_ids: np.ndarray, group_sizes: Sequence[int],
                    block_indices: Sequence[int], rows: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dev, host, size = [], [], []
        blk_off = row_off = 0
        for g, n in enumerate(group_sizes):
            if n == 0:
                continue
            blocks = np.asarray(block_ids[blk_off:blk_off + n], dtype=np.int64)
            skip = int(block_indices[g]) % self.bpc
            pos = np.arange(n, dtype=np.int64) + skip
            n_rows = -(-(n + skip) // self.bpc)
            grp_rows = np.asarray(rows[row_off:row_off + n_rows], dtype=np.int64)
            if len(grp_rows) < n_rows:
                raise ValueError(f"job names {len(rows)} rows but group {g}'s blocks need "
                                 f"{row_off + n_rows}")
            row_addr = self.row_base + grp_rows[pos // self.bpc] * self.row_bytes
            for t_idx, page_bytes in self.refs[g]:
                t = self.tensors[t_idx]
                dev.append(t.base + blocks * t.stride)
                host.append(row_addr + self.tensor_off[t_idx] + (pos % self.bpc) * t.page)
                size.append(np.full(n, page_bytes, dtype=np.int64))
            blk_off += n
            row_off += n_rows
        if row_off != len(rows):
            raise ValueError(f"job names {len(rows)} rows but its blocks span {row_off}")
        if not dev:
            empty = np.empty(0, np.int64)
            return empty, empty, empty
        return np.concatenate(dev), np.concatenate(host), np.concatenate(size)


def merge_runs(src: np.ndarray, dst: np.ndarray, size: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge descriptors that continue the previous one on both sides (fewer, larger copies)."""
    if len(src) <= 1:
        return src, dst, size
    order = np.argsort(src, kind="stable")
    src, dst, size = src[order], dst[order], size[order]
    cont = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    idx = np.nonzero(np.concatenate(([True], ~cont)))[0]
    return src[idx], dst[idx], np.add.reduceat(size, idx)


class MemcpyEngine:
    """Host copies done at submission (the 'device' blocks are host memory)."""

    name = "memcpy"

    def __init__(self) -> None:
        self._done: list[Finished] = []

    def submit(self, job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
               direction: str = "store") -> None:
        t0 = time.perf_counter()
        s, d, n = merge_runs(src, dst, size)
        for a, b, c in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
            ctypes.memmove(b, a, c)
        self._done.append(Finished(job_id, int(size.sum()), time.perf_counter() - t0))

    def get_finished(self) -> list[Finished]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        return


class CudaCopyEngine:
    """Batched async copies on CUDA streams (see module doc)."""

    name = "cuda"

    def __init__(self, host_base: int, host_bytes: int, device: object = None) -> None:
        import torch
        from cuda.bindings import runtime as rt

        self.torch, self.rt = torch, rt
        self.device = torch.device(device or "cuda")
        self.streams = {d: torch.cuda.Stream(self.device) for d in ("store", "load", "expedited")}
        self.registered: list[int] = []
        self.register_failures = 0
        for off in range(0, host_bytes, REGISTER_SEGMENT):
            seg = min(REGISTER_SEGMENT, host_bytes - off)
            (err,) = rt.cudaHostRegister(host_base + off, seg,
                                         rt.cudaHostRegisterDefault)
            if err == rt.cudaError_t.cudaSuccess:
                self.registered.append(host_base + off)
            else:
                self.register_failures += 1
        if self.register_failures:
            log.warning("cudaHostRegister failed for %d of %d segments: those rows copy as "
                        "pageable memory (slower)", self.register_failures,
                        -(-host_bytes // REGISTER_SEGMENT))
        self.batch_api = hasattr(rt, "cudaMemcpyBatchAsync")
        self._attrs = self._make_attrs() if self.batch_api else None
        self._jobs: deque = deque()

    def _make_attrs(self):
        rt = self.rt
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        return attr

    def submit(self, job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
               direction: str = "store") -> None:
        torch, rt = self.torch, self.rt
        stream = self.streams[direction]
        # Stores read blocks the model just wrote; loads must land before the model reads them:
        # order both against the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        s, d, n = merge_runs(src, dst, size)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        handle = stream.cuda_stream
        for lo in range(0, len(s), BATCH_MAX):
            ss, dd, nn = (s[lo:lo + BATCH_MAX].tolist(), d[lo:lo + BATCH_MAX].tolist(),
                          n[lo:lo + BATCH_MAX].tolist())
            if self.batch_api:
                res = rt.cudaMemcpyBatchAsync(dd, ss, nn, len(ss), [self._attrs], [0], 1, handle)
                err = res[0] if isinstance(res, tuple) else res
            else:
                err = rt.cudaError_t.cudaSuccess
                for a, b, c in zip(ss, dd, nn, strict=True):
                    (err,) = rt.cudaMemcpyAsync(b, a, c, rt.cudaMemcpyKind.cudaMemcpyDefault,
                                                handle)
                    if err != rt.cudaError_t.cudaSuccess:
                        break
            if err != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"CUDA copy for job {job_id} failed: {err}")
        end.record(stream)  # vLLM schedules a request only after its load is reported done
        self._jobs.append((job_id, int(size.sum()), start, end))

    def get_finished(self) -> list[Finished]:
        done = []
        pending = deque()
        while self._jobs:
            job = self._jobs.popleft()
            if job[3].query():
                done.append(Finished(job[0], job[1], job[2].elapsed_time(job[3]) / 1000))
            else:
                pending.append(job)
        self._jobs = pending
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job in self._jobs:
            if job[0] in job_ids:
                job[3].synchronize()

    def shutdown(self) -> None:
        self.torch.cuda.synchronize(self.device)
        for ptr in self.registered:
            self.rt.cudaHostUnregister(ptr)
        self.registered = []
