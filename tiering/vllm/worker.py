"""The worker side: vLLM's ``OffloadingWorker`` over our copiers (``backends/block_copy.py``,
``backends/cuda_copy.py``).

Each job's GPU spec and staging rows become one descriptor list (``CopyLayout``), copied by
``MemcpyCopier`` on vLLM's CPU platform or ``CudaCopier`` on CUDA. The worker never reports
a failed transfer: vLLM's connector asserts success. A load the copier could not enqueue
(``CopyFailed``: nothing of it in flight) is reported finished, and its GPU blocks are handed to
vLLM as load errors through our connector (``TieredOffloadingConnector.
get_block_ids_with_load_errors``): vLLM recomputes them under ``"kv_load_failure_policy":
"recompute"`` (what ``tiering config`` prints) and fails only those requests under its default.
Under vLLM's plain ``OffloadingConnector`` nobody asks for them, so the load's failure stops the
engine as before. A store the copier could not enqueue is reported finished too, and its rows
are marked failed in the staging region (``StagingRegion.mark_store_failed``) before vLLM hears
of it: when vLLM's scheduler side completes the store, our CPU tier finds the marks and drops
those rows (misses, counted as rejections for ``error``) instead of serving bytes the GPU never
wrote. That needs no connector of ours: the region is shared by the worker and the scheduler.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tiering.backends.block_copy import BlockCopier, CopyFailed, CopyLayout, TensorInfo
from tiering.backends.staging import StagingRegion
from tiering.step_trace import TRACE
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


def make_layout(kv_caches: CanonicalKVCaches, region: StagingRegion, rank: int,
                cell_bytes: int, blocks_per_chunk: int) -> CopyLayout:
    tensors = [TensorInfo(t.tensor.data_ptr(), t.tensor.stride(0) * t.tensor.element_size(),
                          t.page_size_bytes) for t in kv_caches.tensors]
    refs = [[(r.tensor_idx, r.page_size_bytes) for r in group]
            for group in kv_caches.group_data_refs]
    return CopyLayout(tensors, refs, region.base_address, region.row_bytes, rank, cell_bytes,
                      blocks_per_chunk, torch_tensors=[t.tensor for t in kv_caches.tensors])


class TieredWorker(OffloadingWorker):
    def __init__(self, layout: CopyLayout, copier: BlockCopier, region: StagingRegion,
                 load_errors_reported: bool = False) -> None:
        self.layout, self.copier, self.region = layout, copier, region
        # a connector asks for failed loads' blocks (ours does): loads may fail into them
        self.load_errors_reported = load_errors_reported
        self._failed_jobs: list[int] = []  # failed jobs not yet reported finished
        self._load_error_blocks: set[int] = set()  # their GPU blocks, until vLLM takes them
        self.failed_loads = 0  # counted once per job, for the log and the tests
        self.failed_stores = 0
        # jobs the copier accepted and has not reported: what a late failure needs
        self._in_flight: dict[int, tuple[str, Any, Any]] = {}  # job -> (dir, blocks, rows)

    def take_load_error_blocks(self) -> set[int]:
        """The GPU blocks of loads that failed since the last call (vLLM's
        ``get_block_ids_with_load_errors``, on the worker thread)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, rows: LoadStoreSpec,
                direction: str) -> bool:
        # wall time and the thread's CPU time: wall far above CPU means the thread waited
        t0, c0 = (time.perf_counter(), time.thread_time()) if TRACE.on else (0.0, 0.0)
        try:
            self.copier.submit_job(job_id, self.layout, gpu.block_ids, gpu.group_sizes,
                                   gpu.block_indices, rows.block_ids, direction)
        except CopyFailed as exc:
            self._failed(job_id, direction, gpu.block_ids, rows.block_ids, str(exc))
            self._failed_jobs.append(job_id)
            return True
        self._in_flight[job_id] = (direction, gpu.block_ids, rows.block_ids)
        if TRACE.on:
            TRACE.add("submit", t=t0, dt=time.perf_counter() - t0, cpu=time.thread_time() - c0,
                      job=job_id, dir=direction, blocks=len(gpu.block_ids))
        return True

    def _failed(self, job_id: int, direction: str, blocks: Any, rows: Any, why: str) -> None:
        """A job whose copies could not be enqueued (nothing of it in flight): a store's rows
        are marked failed, a load's GPU blocks become load errors; raises where no connector
        takes load errors (vLLM's own would count the blocks as loaded)."""
        if direction == "store":
            # marked before the job is reported: the scheduler reads the marks only once
            # vLLM has heard that the job finished
            try:
                self.region.mark_store_failed(int(r) for r in rows)
            except ValueError as exc:  # rows the CPU tier never gave out: nothing to drop
                log.error("vllm-tiering: store job %d: %s", job_id, exc)
            self.failed_stores += 1
            log.error("vllm-tiering: store job %d failed (%s); its %d CPU rows are marked "
                      "failed and dropped when vLLM completes the store", job_id, why,
                      len(rows))
            return
        if not self.load_errors_reported:
            raise CopyFailed(f"load job {job_id}: {why}")
        self.failed_loads += 1
        self._load_error_blocks.update(int(b) for b in blocks)
        log.error("vllm-tiering: load job %d failed (%s); vLLM is told its %d GPU blocks "
                  "did not load (recomputed under kv_load_failure_policy=recompute)",
                  job_id, why, len(blocks))

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, "store")

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, dst_spec, src_spec, "expedited" if expedited else "load")

    def get_finished(self) -> list[TransferResult]:
        # a failed job is "finished" for vLLM (it asserts success): a load's blocks are load
        # errors, a store's rows are marked failed in the region
        failed = [TransferResult(job_id, True) for job_id in self._failed_jobs]
        self._failed_jobs.clear()
        done = []
        for f in self.copier.get_finished():
            direction, blocks, rows = self._in_flight.pop(f.job_id, ("", (), ()))
            if f.ok:
                done.append(TransferResult(f.job_id, True, f.size, f.seconds))
                continue
            self._failed(f.job_id, direction, blocks, rows, "its copies could not be enqueued")
            failed.append(TransferResult(f.job_id, True))
        return failed + done

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids.difference(self._failed_jobs))

    def shutdown(self) -> None:
        self.copier.shutdown()
        self.region.close()
