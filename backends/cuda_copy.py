"""``CudaCopyEngine``: copies between GPU KV blocks and pinned staging rows.

The rows are registered with CUDA as pinned memory (in segments: one registration of tens of
GiB can fail; failures are counted and those rows copy as pageable memory), one stream per
direction plus one for expedited loads, each job ``cudaMemcpyBatchAsync`` calls of ≤1024 runs in
host-address order (through ctypes on numpy arrays; cuda-bindings, or per-run
``cudaMemcpyAsync`` where the batch API is missing, as fallbacks), a CUDA event per job for
completion and timing. Optionally (``staging_bytes`` > 0) jobs made of small pages (per-layer
layouts: 64 KiB each) of whole rows go through a double-buffered device staging area laid out
like the rows: gather/scatter on the GPU, then one batched copy of whole rows over PCIe. Off by
default: on the H200 it did not beat the direct path (docs/benchmarks.md).

Torch and cuda-bindings are imported when the engine is built, never at module import. The
engine never reports a failed job (vLLM asserts on failures): a copy API error raises at once,
which vLLM treats as a fatal worker error rather than silently serving wrong KV.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Sequence

import numpy as np

from tiering.backends.dma import CopyLayout, Finished, merge_runs, submit_descriptors

log = logging.getLogger(__name__)
BATCH_MAX = 1024  # descriptors per cudaMemcpyBatchAsync call (larger calls measured slower)
REGISTER_SEGMENT = 1 << 30


class _CudartBatch:
    """``cudaMemcpyBatchAsync`` called through ctypes on the CUDA runtime that torch loaded.

    cuda-bindings converts Python lists element by element (tens of ms for the 16k descriptors of
    a per-layer job); ctypes hands the numpy arrays' memory straight to the runtime.
    """

    class Attrs(ctypes.Structure):  # struct cudaMemcpyAttributes (CUDA 12.8+)
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int),
                    ("srcLocId", ctypes.c_int), ("dstLocType", ctypes.c_int),
                    ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]

    def __init__(self, runtime_major: int) -> None:
        self.lib = ctypes.CDLL(f"libcudart.so.{runtime_major}")
        fn = self.lib.cudaMemcpyBatchAsync
        fn.restype = ctypes.c_int
        self.has_fail_idx = runtime_major == 12  # 12.8/12.9 take a failIdx out-parameter
        self.fn = fn
        self.attrs = self.Attrs(1, 0, 0, 0, 0, 0)  # source access order: stream
        self.attr_idx = (ctypes.c_size_t * 1)(0)

    def __call__(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int) -> int:
        p = ctypes.c_void_p
        args = [p(dst.ctypes.data), p(src.ctypes.data), p(size.ctypes.data),
                ctypes.c_size_t(len(size)), ctypes.byref(self.attrs), self.attr_idx,
                ctypes.c_size_t(1)]
        if self.has_fail_idx:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        return self.fn(*args, p(stream))


class CudaCopyEngine:
    """Batched async copies on CUDA streams (see module doc)."""

    name = "cuda"

    def __init__(self, host_base: int, host_bytes: int, device: object = None,
                 api: str = "auto", batch_max: int = BATCH_MAX, order: str = "host",
                 staging_bytes: int = 0, staging_threshold: int = 256 << 10) -> None:
        import torch
        from cuda.bindings import runtime as rt

        self.torch, self.rt = torch, rt
        self.batch_max, self.order = batch_max, order
        self.staging_bytes, self.staging_threshold = staging_bytes, staging_threshold
        self._staging: dict[str, object] = {}  # direction -> device buffer (allocated lazily)
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
        self._ctypes: _CudartBatch | None = None
        if api in ("auto", "ctypes") and self.batch_api:
            try:
                major = int(str(torch.version.cuda).split(".")[0])
                self._ctypes = _CudartBatch(major)
            except (OSError, AttributeError, ValueError) as exc:
                if api == "ctypes":
                    raise
                log.info("cudaMemcpyBatchAsync through ctypes unavailable (%s); using "
                         "cuda-bindings", exc)
        self.api = "ctypes" if self._ctypes else ("bindings" if self.batch_api else "memcpy")
        self._jobs: deque = deque()

    def _make_attrs(self):
        rt = self.rt
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        return attr

    def submit(self, job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
               direction: str = "store") -> None:
        torch = self.torch
        stream = self.streams[direction]
        # Stores read blocks the model just wrote: order them after the compute stream's work.
        # Loads are reported done (and only then used) through their end event.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        store = direction == "store"
        # walk host memory in address order (stores: by destination, loads: by source)
        s, d, n = merge_runs(src, dst, size, by=("dst" if store else "src")
                             if self.order == "host" else ("src" if store else "dst"))
        s, d, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (s, d, n))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self._copy(job_id, s, d, n, stream.cuda_stream)
        end.record(stream)
        self._jobs.append((job_id, int(size.sum()), start, end))

    def submit_job(self, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                   group_sizes: Sequence[int], block_indices: Sequence[int], rows: np.ndarray,
                   direction: str) -> None:
        """One vLLM job. Small pages of whole rows are gathered on the GPU (see _gather_job);
        everything else goes through the descriptor path."""
        small = max(t.page for t in layout.tensors) < self.staging_threshold
        whole_rows = all(int(i) % layout.bpc == 0 and n % layout.bpc == 0
                         for i, n in zip(block_indices, group_sizes, strict=True))
        if (self.staging_bytes >= 2 * layout.cell_bytes and small and whole_rows
                and layout.torch_tensors is not None):
            self._gather_job(job_id, layout, block_ids, group_sizes, rows, direction)
            return
        submit_descriptors(self, job_id, layout, block_ids, group_sizes, block_indices, rows,
                           direction)

    def _gather_job(self, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                    group_sizes: Sequence[int], rows: np.ndarray, direction: str) -> None:
        """Per-layer pages (tens of KiB each) moved as whole rows: on the GPU, one gather
        (store) or scatter (load) kernel per KV tensor between the blocks and a staging buffer
        laid out like the rows; over PCIe, one batched copy of whole rows. Two buffers and two
        streams per direction: the kernels for piece k+1 run while piece k crosses PCIe."""
        torch = self.torch
        store = direction == "store"
        kern, copy = self.streams[direction], self._copy_stream(direction)
        kern.wait_stream(torch.cuda.current_stream(self.device))
        bufs = self._staging_buffers(direction)
        cell, bpc = layout.cell_bytes, layout.bpc
        per_piece = max(1, len(bufs[0]) // cell)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(kern)
        free = [None, None]  # per buffer: event after which it may be refilled
        total, k = 0, 0
        blk_off = row_off = 0
        for g, n in enumerate(group_sizes):
            if n == 0:
                continue
            n_rows = n // bpc
            g_rows = np.asarray(rows[row_off:row_off + n_rows], dtype=np.int64)
            # indices go up once, asynchronously: a pageable host->device copy would block the
            # host until the stream drained and serialize every piece
            idx = torch.from_numpy(np.asarray(block_ids[blk_off:blk_off + n],
                                              dtype=np.int64)).pin_memory()
            with torch.cuda.stream(kern):
                g_blocks = idx.to(self.device, non_blocking=True)
            for r0 in range(0, n_rows, per_piece):
                r1, b = min(n_rows, r0 + per_piece), k % 2
                blocks = g_blocks[r0 * bpc:r1 * bpc]
                stage = bufs[b][:(r1 - r0) * cell].view(r1 - r0, cell)
                host = (layout.row_base + g_rows[r0:r1] * layout.row_bytes).astype(np.uint64)
                dev = np.uint64(stage.data_ptr()) + np.arange(r1 - r0, dtype=np.uint64) * \
                    np.uint64(cell)
                sizes = np.full(r1 - r0, cell, dtype=np.uint64)
                first, second = (kern, copy) if store else (copy, kern)
                if free[b] is not None:
                    first.wait_event(free[b])
                if not store:
                    self._copy(job_id, host, dev, sizes, copy.cuda_stream)
                    landed = torch.cuda.Event()
                    landed.record(copy)
                    kern.wait_event(landed)
                with torch.cuda.stream(kern):
                    for t_idx, page_bytes in layout.refs[g]:
                        page, off = layout.tensors[t_idx].page, layout.tensor_off[t_idx]
                        region = stage[:, off:off + bpc * page].unflatten(1, (bpc, page))
                        region = region[:, :, :page_bytes]
                        tensor = layout.torch_tensors[t_idx][:, :page_bytes]
                        if store:
                            region.copy_(tensor.index_select(0, blocks).view(region.shape))
                        else:
                            tensor.index_copy_(0, blocks, region.reshape(-1, page_bytes))
                        total += page_bytes * len(blocks)
                if store:
                    gathered = torch.cuda.Event()
                    gathered.record(kern)
                    copy.wait_event(gathered)
                    self._copy(job_id, dev, host, sizes, copy.cuda_stream)
                done = torch.cuda.Event()
                done.record(second)
                free[b] = done
                k += 1
            blk_off += n
            row_off += n_rows
        # the job ends when both streams are through
        kern.wait_stream(copy)
        end.record(kern)
        self._jobs.append((job_id, total, start, end))

    def _copy_stream(self, direction: str):
        key = ("copy", direction)
        s = self._staging.get(key)
        if s is None:
            s = self.torch.cuda.Stream(self.device)
            self._staging[key] = s
        return s

    def _staging_buffers(self, direction: str):
        bufs = self._staging.get(("bufs", direction))
        if bufs is None:
            half = self.staging_bytes // 2
            bufs = [self.torch.empty(half, dtype=self.torch.int8, device=self.device)
                    for _ in range(2)]
            self._staging[("bufs", direction)] = bufs
        return bufs

    def _copy(self, job_id: int, s: np.ndarray, d: np.ndarray, n: np.ndarray,
              handle: int) -> None:
        rt = self.rt
        s, d, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (s, d, n))
        bm = self.batch_max
        for lo in range(0, len(s), bm):
            if self._ctypes is not None:
                code = self._ctypes(d[lo:lo + bm], s[lo:lo + bm], n[lo:lo + bm], handle)
                if code != 0:
                    raise RuntimeError(f"cudaMemcpyBatchAsync for job {job_id} failed: {code}")
                continue
            ss, dd, nn = s[lo:lo + bm].tolist(), d[lo:lo + bm].tolist(), n[lo:lo + bm].tolist()
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
