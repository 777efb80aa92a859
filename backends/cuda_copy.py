"""``CudaCopier``: copies between GPU KV blocks and pinned staging rows.

The rows are registered with CUDA as pinned memory (in segments: one registration of tens of
GiB can fail; failures are counted and those rows copy as pageable memory), one stream per
direction plus one for expedited loads, a CUDA event per job for completion and timing.

How a job's bytes move (``copy``; chosen per job by page size):

* ``dma`` — the descriptor path: each (block, KV tensor) page is one descriptor of
  ``cudaMemcpyBatchAsync`` calls of ≤1024 runs in host-address order (through ctypes on numpy
  arrays; cuda-bindings, or per-run ``cudaMemcpyAsync`` where the batch API is missing, as
  fallbacks). Near one large copy's speed for large pages (packed layouts: 2 MiB per block).
* ``staged`` — for small pages (per-layer layouts: 64 KiB each): one Triton kernel launch
  (``gpu_kernels.py``) gathers a piece of the job's pages into a device buffer laid out like
  the rows (store) or scatters them out of it (load); PCIe sees whole-row copies. Two buffers
  per direction: the kernel for piece k+1 runs while piece k crosses PCIe.
* ``direct`` — for small pages: one kernel launch reads or writes the registered host rows
  directly (no DMA descriptors, no device buffer; uses SMs for the whole transfer).
* ``auto`` (default) — ``dma``: on the H200 (docs/benchmarks.md) the descriptor path moved
  per-layer pages faster in one direction than either kernel path, whose extra work (a gather
  or scatter pass, or SM-driven PCIe traffic) did not pay for itself there; ``staged`` only
  overlapped both directions better. ``staged``/``direct`` apply to jobs whose pages are all
  smaller than ``small_page_bytes`` and 16-byte aligned (others take ``dma``); when Triton is
  missing or its kernel fails its self-check, asking for them is an error.

Torch, Triton and cuda-bindings are imported when the copier is built, never at module import.
The copier never reports a failed job (vLLM asserts on failures): a copy API error raises
``CopyFailed`` from ``submit_job``, after waiting for the part of the job already enqueued, and
the job is never reported finished (the vLLM worker decides what the failure becomes).
Ordering: every job's first operation waits for the work already queued on the submitting
thread's current stream (the forward pass that wrote the blocks a store reads); a job is
reported finished only when its end event, recorded after all its copies and kernels, has
completed (so a load's blocks are complete before vLLM schedules the request that uses them).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from tiering.backends.block_copy import (
    CopyFailed,
    CopyLayout,
    Finished,
    merge_runs,
    split_at_segments,
)
from tiering.backends.copy_feeder import CopyFeeder, FeedJob
from tiering.backends.staged_plan import plan_staged
from tiering.settings import CUDA_BATCH_MAX, LOAD_QUEUE_MAX_BYTES
from tiering.step_trace import ALLOCATOR_CALLS, TRACE

if TYPE_CHECKING:  # never at run time: torch comes with the copier (see above)
    import torch

log = logging.getLogger(__name__)
BATCH_MAX = CUDA_BATCH_MAX  # descriptors per cudaMemcpyBatchAsync call (tiering.settings)
REGISTER_SEGMENT = 1 << 30
COPY_MODES = ("auto", "dma", "staged", "direct")
# cudaMemcpySrcAccessOrder values (CUDA 12.8+ runtime API)
ACCESS_ORDERS = {"stream": 1, "during_api_call": 2, "any": 3}
KERNEL_ALIGN = 16  # gpu_kernels.ALIGN, repeated here so that choosing a path needs no Triton


def allocator_calls(torch: Any, device: Any) -> dict[str, int]:
    """Trace only: the running totals of the allocator calls a ``mark`` row carries
    (``ALLOCATOR_CALLS`` in tiering/step_trace.py; those this PyTorch counts). Reads the
    allocators' own nested statistics: flattening them costs more."""
    stats: dict[str, dict[str, Any]] = {"device": {}, "host": {}}
    try:
        stats["device"] = torch.cuda.memory_stats_as_nested_dict(device)
    except Exception:  # no device statistics here: the host's may still be counted
        pass
    try:
        stats["host"] = torch.cuda.memory.host_memory_stats_as_nested_dict()
    except Exception:  # an older PyTorch (no host statistics): the device's are counted
        pass
    return {field: int(stats[which][key]) for field, _, which, key in ALLOCATOR_CALLS
            if isinstance(stats[which].get(key), int)}


class _KernelUnavailable(RuntimeError):
    """The copy kernel cannot be built or its buffers allocated: the job takes the DMA path."""


class _CudartBatch:
    """``cudaMemcpyBatchAsync`` called through ctypes on the CUDA runtime that torch loaded.

    cuda-bindings converts Python lists element by element (tens of ms for the 16k descriptors of
    a per-layer job); ctypes hands the numpy arrays' memory straight to the runtime.
    """

    class Attrs(ctypes.Structure):  # struct cudaMemcpyAttributes (CUDA 12.8+)
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int),
                    ("srcLocId", ctypes.c_int), ("dstLocType", ctypes.c_int),
                    ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]

    def __init__(self, runtime_major: int, access_order: str = "stream", flags: int = 0) -> None:
        self.lib = ctypes.CDLL(f"libcudart.so.{runtime_major}")
        fn = self.lib.cudaMemcpyBatchAsync
        fn.restype = ctypes.c_int
        self.has_fail_idx = runtime_major == 12  # 12.8/12.9 take a failIdx out-parameter
        self.fn = fn
        # cudaMemcpySrcAccessOrder: the source may be read in stream order (1), or in any
        # order (3: the batch may be split over copy engines); flags: cudaMemcpyFlag*
        # (1: prefer overlap with compute)
        self.attrs = self.Attrs(ACCESS_ORDERS[access_order], 0, 0, 0, 0, flags)
        self.attr_idx = (ctypes.c_size_t * 1)(0)

    def __call__(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int) -> int:
        p = ctypes.c_void_p
        args = [p(dst.ctypes.data), p(src.ctypes.data), p(size.ctypes.data),
                ctypes.c_size_t(len(size)), ctypes.byref(self.attrs), self.attr_idx,
                ctypes.c_size_t(1)]
        if self.has_fail_idx:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        return int(self.fn(*args, p(stream)))


class CudaCopier:
    """Batched async copies and copy kernels on CUDA streams (see module doc).

    Called from one thread (vLLM's worker thread): ``submit``/``submit_job`` enqueue and
    return, ``get_finished`` polls events, ``wait`` blocks on the named jobs' end events. With
    ``load_queue_bytes``, loads are enqueued by a feeder thread instead (``CopyFeeder``), which
    appends them to the load direction's job queue as it enqueues them (``load_direct``: a load
    with room in the queue and none waiting before it is enqueued at once, on the calling
    thread; ``load_waves``: room only once the queue is empty, so that the compute stream's own
    host-to-GPU copies get the copy engine between waves; ``load_wave_streams`` 2: the waves
    take the load stream and a second one in turn, so that the next wave waits queued while one
    copies); a load it could not enqueue comes out of ``get_finished`` with ``ok`` False.
    """

    name = "cuda"

    def __init__(self, host_base: int, host_bytes: int, device: object = None,
                 api: str = "auto", batch_max: int = BATCH_MAX, order: str = "host",
                 copy: str = "auto", staging_bytes: int = 128 << 20,
                 small_page_bytes: int = 256 << 10, access_order: str = "stream",
                 copy_flags: int = 0, streams_per_direction: int = 1,
                 register_segment: int = 0, load_queue_bytes: int = 0,
                 load_direct: bool = False, load_waves: bool = False,
                 load_wave_streams: int = 1) -> None:
        import torch
        from cuda.bindings import runtime as rt

        if copy not in COPY_MODES:
            raise ValueError(f"copy: expected one of {', '.join(COPY_MODES)}, got {copy!r}")
        if access_order not in ACCESS_ORDERS:
            raise ValueError(f"access_order: expected one of {', '.join(ACCESS_ORDERS)}, got "
                             f"{access_order!r}")
        if streams_per_direction < 1:
            raise ValueError(f"streams_per_direction: expected >= 1, got {streams_per_direction}")
        if load_wave_streams < 1 or (load_wave_streams > 1 and not load_waves):
            raise ValueError(f"load_wave_streams: expected 1, or more with load_waves, got "
                             f"{load_wave_streams} (load_waves {load_waves})")
        register_segment = register_segment or REGISTER_SEGMENT  # tests pass small ones
        # a descriptor job split over this many streams per direction (several copy engines)
        self.streams_per_direction = streams_per_direction
        self.access_order, self.copy_flags = access_order, copy_flags
        self.torch, self.rt = torch, rt
        self.batch_max, self.order = batch_max, order
        self.staging_bytes, self.small_page_bytes = staging_bytes, small_page_bytes
        self.device = torch.device(device or "cuda")
        self.streams = {d: torch.cuda.Stream(self.device) for d in ("store", "load", "expedited")}
        self._extra_streams = {d: [torch.cuda.Stream(self.device)
                                   for _ in range(streams_per_direction - 1)]
                               for d in ("store", "load", "expedited")}
        # the fed loads' waves take these in turn (the load stream first; backends/copy_feeder.py)
        self._load_wave_streams = [self.streams["load"], *(
            torch.cuda.Stream(self.device) for _ in range(load_wave_streams - 1))]
        self.registered: list[int] = []
        self.register_failures = 0
        self._mapped_same_address = True
        # one copy may not span two registrations: ``_copy`` cuts runs at these boundaries
        self.host_base, self.host_bytes = host_base, host_bytes
        self.register_segment = register_segment
        for off in range(0, host_bytes, register_segment):
            seg = min(register_segment, host_bytes - off)
            (err,) = rt.cudaHostRegister(host_base + off, seg,
                                         rt.cudaHostRegisterDefault)
            if err == rt.cudaError_t.cudaSuccess:
                self.registered.append(host_base + off)
                err, dev_ptr = rt.cudaHostGetDevicePointer(host_base + off, 0)
                if err != rt.cudaError_t.cudaSuccess or int(dev_ptr) != host_base + off:
                    self._mapped_same_address = False
            else:
                self.register_failures += 1
        if self.register_failures:
            log.warning("cudaHostRegister failed for %d of %d segments: those rows copy as "
                        "pageable memory (slower)", self.register_failures,
                        -(-host_bytes // register_segment))
        self.batch_api = hasattr(rt, "cudaMemcpyBatchAsync")
        self._attrs = self._make_attrs() if self.batch_api else None
        self._ctypes: _CudartBatch | None = None
        if api in ("auto", "ctypes") and self.batch_api:
            try:
                major = int(str(torch.version.cuda).split(".")[0])
                self._ctypes = _CudartBatch(major, access_order, copy_flags)
            except (OSError, AttributeError, ValueError) as exc:
                if api == "ctypes":
                    raise
                log.info("cudaMemcpyBatchAsync through ctypes unavailable (%s); using "
                         "cuda-bindings", exc)
        self.api = "ctypes" if self._ctypes else ("bindings" if self.batch_api else "memcpy")
        # in-flight jobs per direction, in submission order: every job's end event is recorded
        # on its direction's stream, so they complete in this order and polling may stop at
        # the first one still running (one event query per direction and step, not per job).
        # Fed loads on two wave streams may end out of that order: one is then reported a
        # little after its end (behind an older load of the other stream), never before it
        # (job id, bytes, start event, end event)
        self._jobs: dict[str, deque[tuple[int, int, torch.cuda.Event, torch.cuda.Event]]] = {
            d: deque() for d in self.streams}
        # per direction, the end event of the job reported last (``_copy_began``)
        self._last_end: dict[str, torch.cuda.Event] = {}
        # kernel paths: per direction, a second stream for the row copies, two device buffers
        # and the events after which each buffer may be refilled (kept across jobs)
        self._kernels: ModuleType | None = None  # tiering.backends.gpu_kernels, once loaded
        self._kernel_hints = True
        self.copy = self._choose_copy(copy)
        self._copy_streams: dict[str, torch.cuda.Stream] = {}
        self._buffers: dict[str, list[torch.Tensor]] = {}
        self._free: dict[str, list[torch.cuda.Event | None]] = {}
        self._next_buffer: dict[str, int] = {}
        self.jobs_by_path = {"dma": 0, "staged": 0, "direct": 0}
        # the step trace (tiering/step_trace.py) puts job spans on the host clock through an
        # event recorded now: (host seconds, event)
        self._trace_base: tuple[float, torch.cuda.Event] | None = None
        # trace only: (host seconds, event on the compute stream, allocator_calls), one a step
        # (get_finished)
        self._marks: deque[tuple[float, torch.cuda.Event, dict[str, int]]] = deque()
        self._marking = True
        # loads: at most load_queue_bytes enqueued on the copy engine at once, the rest fed by
        # a thread as room frees (backends/copy_feeder.py says why); 0: all enqueued at once
        self._feeder: CopyFeeder | None = None
        if load_queue_bytes:
            self._feeder = CopyFeeder(torch, self.device, self.streams["load"], load_queue_bytes,
                                      self._copy, self._load_started,
                                      grow_to=max(load_queue_bytes, LOAD_QUEUE_MAX_BYTES),
                                      direct=load_direct, waves=load_waves,
                                      wave_streams=self._load_wave_streams)
        if TRACE.on:
            base = torch.cuda.Event(enable_timing=True)
            base.record(self.streams["store"])
            base.synchronize()
            self._trace_base = (time.perf_counter(), base)

    def _choose_copy(self, copy: str) -> str:
        if copy in ("dma", "auto"):
            return "dma"
        if copy == "direct" and (self.register_failures or not self._mapped_same_address):
            raise ValueError("copy: 'direct' needs every staging row registered with CUDA and "
                             "usable from the device at its host address; this machine has "
                             f"{self.register_failures} unregistered segment(s)")
        try:
            from tiering.backends import gpu_kernels
        except ImportError as exc:
            raise ValueError(f"copy: {copy!r} needs Triton ({exc})") from None
        self._kernels = gpu_kernels
        try:
            self._check_kernel()
        except _KernelUnavailable as exc:
            raise ValueError(f"copy: {copy!r}: the copy kernel does not work here "
                             f"({exc})") from None
        return copy

    def _check_kernel(self) -> None:
        """Build the kernel now (not in the first job) and check that it moves bytes exactly:
        three pages of odd lengths between random device buffers."""
        torch = self.torch
        src = torch.randint(-2**31, 2**31 - 1, (3 * 8192,), dtype=torch.int32, device=self.device)
        dst = torch.zeros_like(src)
        lengths = np.array([32768, 16, 4096 + 48], dtype=np.int64)
        offs = np.array([0, 8192 * 4, 16384 * 4], dtype=np.int64)
        with torch.cuda.stream(self.streams["store"]):
            table = self._upload((src.data_ptr() + offs, dst.data_ptr() + offs, lengths // 4))
            self._launch(table, 3, 0, 3, int(lengths.max()))
        self.streams["store"].synchronize()
        for o, n in zip(offs // 4, lengths // 4, strict=True):
            if not torch.equal(src[o:o + n], dst[o:o + n]) or dst[o + n:o + 8192].any():
                raise _KernelUnavailable("the copy kernel's self-check moved wrong bytes")

    def _make_attrs(self) -> Any:  # a cuda-bindings cudaMemcpyAttributes
        rt = self.rt
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        return attr

    def submit(self, job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
               direction: str = "store") -> None:
        """The descriptor path: copy ``size[i]`` bytes from ``src[i]`` to ``dst[i]``."""
        torch = self.torch
        stream = self.streams[direction]
        store = direction == "store"
        # walk host memory in address order (stores: by destination, loads: by source)
        s, d, n = merge_runs(src, dst, size, by=("dst" if store else "src")
                             if self.order == "host" else ("src" if store else "dst"))
        s, d, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (s, d, n))
        if direction == "load" and self._feeder is not None:
            after = torch.cuda.Event()  # the compute stream's work so far comes first
            after.record(torch.cuda.current_stream(self.device))
            self._feeder.put(FeedJob(job_id, s, d, n, int(n.sum()), after))
            self.jobs_by_path["dma"] += 1
            return
        # Stores read blocks the model just wrote: order them after the compute stream's work.
        # Loads are reported done (and only then used) through their end event.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        extra = self._extra_streams[direction]
        if extra and len(n) > 1:
            # split into contiguous parts of about equal bytes, one per stream; the job ends
            # when the main stream has waited for every part
            parts = len(extra) + 1
            cuts = np.searchsorted(np.cumsum(n), np.arange(1, parts) * (int(n.sum()) / parts))
            bounds = [0, *(min(int(c) + 1, len(n)) for c in cuts), len(n)]
            self._copy(job_id, s[:bounds[1]], d[:bounds[1]], n[:bounds[1]], stream.cuda_stream)
            for k, side in enumerate(extra, start=1):
                lo, hi = bounds[k], bounds[k + 1]
                if lo >= hi:
                    continue
                side.wait_event(start)  # after the work the job waits for (start follows it)
                self._copy(job_id, s[lo:hi], d[lo:hi], n[lo:hi], side.cuda_stream)
                part_end = torch.cuda.Event()
                part_end.record(side)
                stream.wait_event(part_end)
        else:
            self._copy(job_id, s, d, n, stream.cuda_stream)
        end.record(stream)
        self._jobs[direction].append((job_id, int(size.sum()), start, end))
        self.jobs_by_path["dma"] += 1

    def _load_started(self, job_id: int, nbytes: int, start: Any, end: Any) -> None:
        """The feeder enqueued a load (its thread): from now on it is polled as any job."""
        self._jobs["load"].append((job_id, nbytes, start, end))

    def path_for(self, dev: np.ndarray, host: np.ndarray, size: np.ndarray) -> str:
        """Which path a job of these descriptors takes (see module doc)."""
        if self.copy == "dma" or len(size) == 0 or int(size.max()) >= self.small_page_bytes:
            return "dma"
        a = KERNEL_ALIGN - 1
        if (np.bitwise_or.reduce(dev) | np.bitwise_or.reduce(host)
                | np.bitwise_or.reduce(size)) & a:
            return "dma"
        return self.copy

    def submit_job(self, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                   group_sizes: Sequence[int], block_indices: Sequence[int], rows: np.ndarray,
                   direction: str) -> None:
        """One vLLM job: its descriptors, then the path ``path_for`` picks. A copy API error
        raises ``CopyFailed`` once the part of the job already enqueued has completed."""
        try:
            self._submit_job(job_id, layout, block_ids, group_sizes, block_indices, rows,
                             direction)
        except CopyFailed:
            waves = self._load_wave_streams[1:] if direction == "load" else []
            for stream in (self.streams[direction], *self._extra_streams[direction], *waves,
                           self._copy_streams.get(direction)):
                if stream is not None:
                    stream.synchronize()
            raise

    def _submit_job(self, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                    group_sizes: Sequence[int], block_indices: Sequence[int], rows: np.ndarray,
                    direction: str) -> None:
        dev, host, size = layout.descriptors(block_ids, group_sizes, block_indices, rows)
        path = self.path_for(dev, host, size)
        if path != "dma":
            try:
                if path == "staged":
                    slot = layout.page_rows(group_sizes, block_indices)
                    self._staged_job(job_id, layout, dev, host, size, slot, direction)
                else:
                    self._direct_job(job_id, dev, host, size, direction)
                self.jobs_by_path[path] += 1
                return
            except _KernelUnavailable as exc:
                log.warning("copy kernel unavailable (%s): small pages copy as DMA descriptors "
                            "from now on", exc)
                self.copy = "dma"
        if direction == "store":
            self.submit(job_id, dev, host, size, direction)
        else:
            self.submit(job_id, host, dev, size, direction)

    # -- kernel paths ------------------------------------------------------------------------------
    def _launch(self, table: torch.Tensor, n: int, first: int, count: int, max_bytes: int) -> None:
        """Launch the page-copy kernel on the current stream; the first launch compiles it (with
        alignment hints, without them if that fails); a kernel that cannot be built at all
        raises ``_KernelUnavailable`` before anything of the job was enqueued."""
        assert self._kernels is not None, "kernel paths need gpu_kernels loaded"
        while True:
            try:
                self._kernels.launch(table, n, first, count, max_bytes, self._kernel_hints)
                return
            except Exception as exc:  # compile errors come in many types
                if self._kernel_hints:
                    log.warning("copy kernel with alignment hints failed to build (%s); "
                                "trying without", exc)
                    self._kernel_hints = False
                    continue
                raise _KernelUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _upload(self, columns: Sequence[np.ndarray]) -> torch.Tensor:
        """The kernel's page table (int64 columns, side by side) on the device, copied on the
        current stream from pinned memory (the host allocator keeps it until the copy ran)."""
        torch = self.torch
        table = torch.from_numpy(np.concatenate([np.asarray(c, dtype=np.int64)
                                                 for c in columns])).pin_memory()
        return table.to(self.device, non_blocking=True)

    def _direct_job(self, job_id: int, dev: np.ndarray, host: np.ndarray, size: np.ndarray,
                    direction: str) -> None:
        torch = self.torch
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        store = direction == "store"
        # walk host memory in address order
        order = np.argsort(host, kind="stable")
        dev, host, size = dev[order], host[order], size[order]
        src, dst = (dev, host) if store else (host, dev)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            table = self._upload((src, dst, size // 4))
            self._launch(table, len(size), 0, len(size), int(size.max()))
            end.record(stream)
        self._jobs[direction].append((job_id, int(size.sum()), start, end))

    def _staged_job(self, job_id: int, layout: CopyLayout, dev: np.ndarray, host: np.ndarray,
                    size: np.ndarray, slot: np.ndarray, direction: str) -> None:
        """Pages grouped by the row they belong to; a piece is as many rows as one buffer holds.
        Store, per piece: kernel gathers into buffer b, then one batched copy of its rows to
        host. Load: rows to buffer b, then the kernel scatters. Buffer b is refilled only after
        the last use of its previous contents (events kept across jobs)."""
        torch = self.torch
        cell = layout.cell_bytes
        bufs = self._staging_buffers(direction)
        if bufs is None or len(bufs[0]) < cell:
            raise _KernelUnavailable(f"staging buffers of {self.staging_bytes} bytes cannot "
                                     f"hold two rows of {cell} bytes")
        per_piece = len(bufs[0]) // cell
        store = direction == "store"
        kern, copy = self.streams[direction], self._copy_stream(direction)
        free = self._free.setdefault(direction, [None, None])
        b0 = self._next_buffer.get(direction, 0)
        plan = plan_staged(layout, dev, host, size, slot, per_piece,
                           [b.data_ptr() for b in bufs], b0)
        n_pieces = len(plan.pieces)
        src, dst = (plan.dev, plan.staged) if store else (plan.staged, plan.dev)
        size = plan.size
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        kern.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(kern):
            start.record(kern)
            table = self._upload((src, dst, size // 4))
            if not store:
                copy.wait_event(start)
            for lo, hi, b, (rs, rd, rn) in plan.pieces:
                if store:
                    if free[b] is not None:
                        kern.wait_event(free[b])
                    self._launch(table, len(size), lo, hi - lo, int(size[lo:hi].max()))
                    gathered = torch.cuda.Event()
                    gathered.record(kern)
                    copy.wait_event(gathered)
                    self._copy(job_id, rs, rd, rn, copy.cuda_stream)
                    done = torch.cuda.Event()
                    done.record(copy)
                else:
                    if free[b] is not None:
                        copy.wait_event(free[b])
                    self._copy(job_id, rd, rs, rn, copy.cuda_stream)  # host -> buffer
                    landed = torch.cuda.Event()
                    landed.record(copy)
                    kern.wait_event(landed)
                    self._launch(table, len(size), lo, hi - lo, int(size[lo:hi].max()))
                    done = torch.cuda.Event()
                    done.record(kern)
                free[b] = done
            kern.wait_stream(copy)  # the job ends when both streams are through
            end.record(kern)
        self._next_buffer[direction] = (b0 + n_pieces) % 2
        self._jobs[direction].append((job_id, int(size.sum()), start, end))

    def _copy_stream(self, direction: str) -> torch.cuda.Stream:
        s = self._copy_streams.get(direction)
        if s is None:
            s = self.torch.cuda.Stream(self.device)
            self._copy_streams[direction] = s
        return s

    def _staging_buffers(self, direction: str) -> list[torch.Tensor] | None:
        """Two device buffers of ``staging_bytes / 2`` for this direction, made on first use;
        None if the device has no room (the job then takes the descriptor path)."""
        bufs = self._buffers.get(direction)
        if bufs is None:
            half = self.staging_bytes // 2
            try:
                bufs = [self.torch.empty(half, dtype=self.torch.int8, device=self.device)
                        for _ in range(2)]
            except RuntimeError as exc:  # out of memory
                log.warning("no device memory for %d bytes of %s staging buffers (%s)",
                            self.staging_bytes, direction, exc)
                return None
            self._buffers[direction] = bufs
        return bufs

    def _copy(self, job_id: int, s: np.ndarray, d: np.ndarray, n: np.ndarray,
              handle: int) -> None:
        rt = self.rt
        s, d, n = split_at_segments(s, d, n, self.host_base, self.host_bytes,
                                    self.register_segment)
        s, d, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (s, d, n))
        bm = self.batch_max
        for lo in range(0, len(s), bm):
            if self._ctypes is not None:
                code = self._ctypes(d[lo:lo + bm], s[lo:lo + bm], n[lo:lo + bm], handle)
                if code != 0:
                    raise CopyFailed(f"cudaMemcpyBatchAsync for job {job_id} failed: {code}")
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
                raise CopyFailed(f"CUDA copy for job {job_id} failed: {err}")

    def get_finished(self) -> list[Finished]:
        if self._trace_base is not None and self._marking:
            try:
                self._mark_compute_stream()
            except Exception:  # a trace never raises into vLLM's worker: its marks stop
                self._marking = False
                self._marks.clear()
                log.exception("step trace: cannot mark the compute stream; marks are off")
        done = []
        if self._feeder is not None:
            done += [Finished(job_id, 0, 0.0, ok=False) for job_id in self._feeder.take_failed()]
        for direction, jobs in self._jobs.items():
            while jobs and jobs[0][3].query():
                job = jobs.popleft()
                start = self._copy_began(direction, job[2])
                self._last_end[direction] = job[3]
                done.append(Finished(job[0], job[1], start.elapsed_time(job[3]) / 1000))
                if self._trace_base is not None:
                    t, base = self._trace_base
                    TRACE.add("copy", job=job[0], dir=direction, bytes=job[1],
                              g0=t + base.elapsed_time(start) / 1000,
                              g1=t + base.elapsed_time(job[3]) / 1000)
        return done

    def _copy_began(self, direction: str, start: Any) -> Any:
        """The event a job's copy time counts from: its start event, or, for fed loads on
        several wave streams, the end of the load reported before it where that came later.
        Why: a wave begun on an idle stream records its first job's start at once, while the
        other stream's wave still holds the copy engine (which serves one stream's queue at a
        time, docs/benchmarks.md, "An H100, 2026-12-07g"); counted from there, the job would
        report that wave's time as its own (vLLM's transfer time, and a "late" job in the step
        trace). On one stream a job starts after the one before it, and nothing changes."""
        prev = self._last_end.get(direction)
        if (direction != "load" or len(self._load_wave_streams) < 2 or prev is None
                or prev.elapsed_time(start) >= 0):
            return start
        return prev

    def _mark_compute_stream(self) -> None:
        """Trace only: vLLM asks for finished jobs once a step, on its worker thread, after it
        enqueued the step's forward pass. An event recorded now on the compute stream lands
        when the GPU has run that pass; the ``mark`` rows (tiering/step_trace.py) then tell a
        step whose forward ran late (behind other work the compute stream waited for) from one
        the host waited for in vain. Marks reached are reported in order, at a later step."""
        assert self._trace_base is not None
        t, base = self._trace_base
        while self._marks and self._marks[0][1].query():
            host_t, event, calls = self._marks.popleft()
            TRACE.add("mark", t=host_t, g=t + base.elapsed_time(event) / 1000, **calls)
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(self.torch.cuda.current_stream(self.device))
        # the allocators' CUDA calls so far: a step whose pass waited on the GPU for other
        # streams' work, right after one of them, was held by that call's implicit sync
        self._marks.append((time.perf_counter(), event, allocator_calls(self.torch, self.device)))

    def wait(self, job_ids: set[int]) -> None:
        if self._feeder is not None:
            self._feeder.wait_fed(job_ids)
        for jobs in self._jobs.values():
            for job in list(jobs):  # the feeder thread may append meanwhile
                if job[0] in job_ids:
                    job[3].synchronize()

    def shutdown(self) -> None:
        if self._feeder is not None:
            self._feeder.close()
        self.torch.cuda.synchronize(self.device)
        for ptr in self.registered:
            self.rt.cudaHostUnregister(ptr)
        self.registered = []
        self._buffers.clear()
        self._free.clear()
