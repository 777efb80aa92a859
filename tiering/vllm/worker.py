"""The worker side: copies between vLLM's KV-cache blocks and staging rows.

``TieredWorker`` builds, for every job, one descriptor list (source address, destination
address, bytes) from the GPU spec and the row ids, merges descriptors whose source and
destination both continue where the previous one ended, and hands the list to a copy engine:

* ``MemcpyEngine`` (vLLM's CPU platform, and CI): ``ctypes.memmove`` per merged run, done at
  submission; the job is reported finished on the next ``get_finished``.
* ``CudaCopyEngine`` (``tiering/vllm/cuda_copy.py``): pinned rows, a stream per direction plus
  one for expedited loads, one batched copy per job, events for completion and timing.

Never reports a failed transfer: vLLM's connector asserts success. A copy engine that fails
raises at construction (before vLLM starts serving), never per job.
"""

from __future__ import annotations

import ctypes
import logging
import time

import numpy as np

from tiering.backends.staging import StagingRegion
from tiering.vllm.compat import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

log = logging.getLogger(__name__)


class RowsSpec(BlockIDsLoadStoreSpec):
    """Staging rows (one per chunk key), in the order of the keys they belong to."""


class CopyLayout:
    """Where each KV tensor's pages live in device memory and in a staging row."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: StagingRegion, rank: int,
                 cell_bytes: int, blocks_per_chunk: int) -> None:
        self.bpc = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self.dev_base, self.dev_stride, self.page = [], [], []
        for t in kv_caches.tensors:
            self.dev_base.append(t.tensor.data_ptr())
            self.dev_stride.append(t.tensor.stride(0) * t.tensor.element_size())
            self.page.append(t.page_size_bytes)
        offsets = np.cumsum([0] + [p * blocks_per_chunk for p in self.page])
        if offsets[-1] > cell_bytes:
            raise ValueError(f"KV pages need {offsets[-1]} bytes per chunk per worker but the "
                             f"row gives each worker {cell_bytes}")
        self.row_base = region.base_address + rank * cell_bytes
        self.tensor_off = offsets[:-1].tolist()
        self.row_bytes = region.row_bytes

    def descriptors(self, gpu: GPULoadStoreSpec, rows: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device addresses, row addresses, sizes), one entry per (block, layer ref)."""
        dev, host, size = [], [], []
        blk_off = row_off = 0
        for g, n in enumerate(gpu.group_sizes):
            if n == 0:
                continue
            blocks = gpu.block_ids[blk_off:blk_off + n].astype(np.int64)
            skip = int(gpu.block_indices[g]) % self.bpc
            pos = np.arange(n, dtype=np.int64) + skip
            n_rows = -(-(n + skip) // self.bpc)
            grp_rows = rows[row_off:row_off + n_rows].astype(np.int64)
            if len(grp_rows) < n_rows:
                raise ValueError(f"job names {len(rows)} rows but group {g}'s blocks need "
                                 f"{row_off + n_rows}")
            row_addr = self.row_base + grp_rows[pos // self.bpc] * self.row_bytes
            for ref in self.refs[g]:
                t = ref.tensor_idx
                dev.append(self.dev_base[t] + blocks * self.dev_stride[t])
                host.append(row_addr + self.tensor_off[t] + (pos % self.bpc) * self.page[t])
                size.append(np.full(n, ref.page_size_bytes, dtype=np.int64))
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
    starts = np.concatenate(([True], ~cont))
    idx = np.nonzero(starts)[0]
    run_size = np.add.reduceat(size, idx)
    return src[idx], dst[idx], run_size


class MemcpyEngine:
    """Synchronous host copies (vLLM's CPU platform: the 'GPU' blocks are host memory)."""

    name = "memcpy"

    def __init__(self) -> None:
        self._done: list[TransferResult] = []

    def submit(self, job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
               expedited: bool = False) -> None:
        t0 = time.perf_counter()
        s, d, n = merge_runs(src, dst, size)
        for a, b, c in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
            ctypes.memmove(b, a, c)
        self._done.append(TransferResult(job_id, True, int(size.sum()),
                                         time.perf_counter() - t0))

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # copies finish inside submit

    def shutdown(self) -> None:
        return


class TieredWorker(OffloadingWorker):
    def __init__(self, layout: CopyLayout, engine, region: StagingRegion) -> None:
        self.layout, self.engine, self.region = layout, engine, region

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        dev, host, size = self.layout.descriptors(src_spec, dst_spec.block_ids)
        self.engine.submit(job_id, dev, host, size)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        dev, host, size = self.layout.descriptors(dst_spec, src_spec.block_ids)
        self.engine.submit(job_id, host, dev, size, expedited=expedited)
        return True

    def get_finished(self) -> list[TransferResult]:
        return self.engine.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.region.close()
