"""The worker side: vLLM's ``OffloadingWorker`` over our copiers (``backends/block_copy.py``,
``backends/cuda_copy.py``).

Each job's GPU spec and staging rows become one descriptor list (``CopyLayout``), copied by
``MemcpyCopier`` on vLLM's CPU platform or ``CudaCopier`` on CUDA. The worker never reports
a failed transfer: vLLM's connector asserts success.
"""

from __future__ import annotations

import logging
import time

from tiering.backends.block_copy import BlockCopier, CopyLayout, TensorInfo
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
    def __init__(self, layout: CopyLayout, copier: BlockCopier, region: StagingRegion) -> None:
        self.layout, self.copier, self.region = layout, copier, region

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, rows: LoadStoreSpec,
                direction: str) -> bool:
        t0 = time.perf_counter() if TRACE.on else 0.0
        self.copier.submit_job(job_id, self.layout, gpu.block_ids, gpu.group_sizes,
                               gpu.block_indices, rows.block_ids, direction)
        if TRACE.on:
            TRACE.add("submit", t=t0, dt=time.perf_counter() - t0, job=job_id, dir=direction,
                      blocks=len(gpu.block_ids))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, "store")

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, dst_spec, src_spec, "expedited" if expedited else "load")

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(f.job_id, True, f.size, f.seconds)
                for f in self.copier.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def shutdown(self) -> None:
        self.copier.shutdown()
        self.region.close()
