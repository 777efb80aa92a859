"""Copies between KV-cache blocks and staging rows (no DMA of its own): descriptors and the host copier.

vLLM-agnostic on purpose, so the GPU benchmark runs where vLLM is not installed: the caller
passes each KV tensor's base address, block stride and page size, and which tensors each KV
group uses. ``CopyLayout.descriptors`` turns one job (block ids, group sizes, first logical
block per group, row ids) into three int64 arrays (device address, row address, bytes), one
entry per (block, tensor ref); ``merge_runs`` joins entries that continue each other on both
sides. Both copiers take those arrays:

* ``MemcpyCopier`` (here) — host-only (vLLM's CPU platform and CI): ``ctypes.memmove`` per run.
* ``CudaCopier`` (``cuda_copy.py``) — pinned rows, batched asynchronous CUDA copies.

Copiers never report a failed job (vLLM asserts on failures): a copy API error raises
``CopyFailed`` from ``submit_job`` once nothing of the job is in flight (``TieredWorker`` turns a
failed load into vLLM's load errors, which it recomputes, and lets a failed store stop the
engine rather than count rows that were not written).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# How a cell orders a chunk's blocks (CopyLayout): recorded in the namespace where a chunk has
# more than one block, since rows stored in another order are other bytes
BLOCK_ORDER = "last_first"


@dataclass
class TensorInfo:
    base: int  # address of block 0
    stride: int  # bytes from one block to the next
    page: int  # bytes of one block's page (padded)


class CopyFailed(RuntimeError):
    """A job's copies could not be enqueued (a copy API error). Raised by ``submit_job`` only
    after whatever part of the job had been enqueued has completed: nothing of the job is in
    flight, and the job is not reported by ``get_finished``. The caller decides what the
    failure becomes (the vLLM worker: a load's blocks are reported to vLLM as load errors and
    recomputed; a store's rows are marked failed in the staging region and dropped when vLLM
    completes it)."""


@dataclass
class Finished:
    job_id: int
    size: int
    seconds: float
    ok: bool = True  # False: the job's copies could not be enqueued (a miss, never raised)


class DescriptorCopier(Protocol):
    """What the descriptor path needs of a copier: enqueue one job's copies, each
    ``size[i]`` bytes from address ``src[i]`` to ``dst[i]``. Called from vLLM's worker thread."""

    def submit(self, job_id: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
               direction: str = "store") -> None: ...


class BlockCopier(Protocol):
    """A copier between the GPU's KV blocks and the staging rows (``MemcpyCopier`` here,
    ``CudaCopier`` on CUDA), as ``TieredWorker`` drives it from vLLM's worker thread:
    ``submit_job`` enqueues and returns, ``get_finished`` polls (each submitted job is reported
    once), ``wait`` blocks on the named jobs, ``shutdown`` releases what the copier holds."""

    name: str

    def submit_job(self, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                   group_sizes: Sequence[int], block_indices: Sequence[int], rows: np.ndarray,
                   direction: str) -> None: ...

    def get_finished(self) -> list[Finished]: ...

    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None: ...


class CopyLayout:
    """Where each KV tensor's pages live on the device and in a staging row.

    A worker's cell of a row holds the chunk's pages tensor by tensor; within a tensor, the
    chunk's blocks are stored **last position first** (``BLOCK_ORDER``). Why: vLLM frees a
    request's blocks tail first and hands freed blocks out in that order, so a request served
    from recycled blocks (every request once the GPU cache has filled) gets descending block
    ids: logical blocks 0, 1, 2, 3 of a chunk in GPU blocks b, b-1, b-2, b-3. Stored last
    first, such a chunk's pages are adjacent in the same order on both sides and ``merge_runs``
    copies each tensor's part of the chunk in one descriptor (on the H200's 8B shape, 256 KiB
    instead of four of 64 KiB, a quarter of the descriptors a job). Blocks in ascending order
    (a fresh cache) copy page by page instead, as descending ones did before.
    """

    def __init__(self, tensors: Sequence[TensorInfo], group_refs: Sequence[Sequence[tuple[int, int]]],
                 row_base: int, row_bytes: int, rank: int, cell_bytes: int,
                 blocks_per_chunk: int, torch_tensors: Sequence[torch.Tensor] | None = None
                 ) -> None:
        self.tensors, self.refs, self.bpc = list(tensors), group_refs, blocks_per_chunk
        self.torch_tensors = list(torch_tensors) if torch_tensors is not None else None
        self.cell_bytes = cell_bytes
        offsets = np.cumsum([0] + [t.page * blocks_per_chunk for t in self.tensors])
        if offsets[-1] > cell_bytes:
            raise ValueError(f"KV pages need {offsets[-1]} bytes per chunk per worker but the "
                             f"row gives each worker {cell_bytes}")
        self.tensor_off = offsets[:-1].tolist()
        self.row_base = row_base + rank * cell_bytes
        self.row_bytes = row_bytes
        # per group, one column per tensor ref: base, block stride, offset in the cell, page,
        # bytes copied; ``descriptors`` broadcasts them against a job's blocks (no loop over
        # layers: a 32-layer job of one request's blocks cost ~10 us per layer in numpy calls)
        self._group_cols = []
        for refs in self.refs:
            idx = [t_idx for t_idx, _ in refs]
            self._group_cols.append(tuple(
                np.asarray(v, dtype=np.int64).reshape(-1, 1) for v in (
                    [self.tensors[i].base for i in idx], [self.tensors[i].stride for i in idx],
                    [self.tensor_off[i] for i in idx], [self.tensors[i].page for i in idx],
                    [page_bytes for _, page_bytes in refs])))

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
            base, stride, t_off, page, nbytes = self._group_cols[g]
            # tensor-major: all of the job's blocks in the group's first tensor, then the next
            dev.append((base + blocks * stride).ravel())
            slot_in_cell = self.bpc - 1 - pos % self.bpc  # last position first (class doc)
            host.append((row_addr + t_off + slot_in_cell * page).ravel())
            size.append(np.repeat(nbytes.ravel(), n))
            blk_off += n
            row_off += n_rows
        if row_off != len(rows):
            raise ValueError(f"job names {len(rows)} rows but its blocks span {row_off}")
        if not dev:
            empty = np.empty(0, np.int64)
            return empty, empty, empty
        return np.concatenate(dev), np.concatenate(host), np.concatenate(size)

    def page_rows(self, group_sizes: Sequence[int], block_indices: Sequence[int]) -> np.ndarray:
        """For each entry of ``descriptors`` (same job, same order): the index into the job's
        ``rows`` of the row it belongs to."""
        out = []
        row_off = 0
        for g, n in enumerate(group_sizes):
            if n == 0:
                continue
            skip = int(block_indices[g]) % self.bpc
            idx = row_off + (np.arange(n, dtype=np.int64) + skip) // self.bpc
            out.extend([idx] * len(self.refs[g]))
            row_off += -(-(n + skip) // self.bpc)
        return np.concatenate(out) if out else np.empty(0, np.int64)


def merge_runs(src: np.ndarray, dst: np.ndarray, size: np.ndarray, by: str = "src"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge descriptors that continue the previous one on both sides (fewer, larger copies).

    The result is ordered by ``by`` ("src" or "dst") address.
    """
    if len(src) <= 1:
        return src, dst, size
    order = np.argsort(src if by == "src" else dst, kind="stable")
    src, dst, size = src[order], dst[order], size[order]
    cont = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    idx = np.nonzero(np.concatenate(([True], ~cont)))[0]
    return src[idx], dst[idx], np.add.reduceat(size, idx)


def split_at_segments(src: np.ndarray, dst: np.ndarray, size: np.ndarray, base: int, span: int,
                      segment: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same copies, cut wherever one side's range in ``[base, base + span)`` crosses a
    multiple of ``segment`` bytes from ``base``.

    Why: the CUDA copier registers the staging rows with CUDA in segments
    (``cuda_copy.REGISTER_SEGMENT``), and one copy may not span two registrations
    (``cudaMemcpyBatchAsync`` fails with an invalid value). A page never starts at an odd place,
    but ``merge_runs`` joins pages of neighbouring rows where both sides continue (in a packed
    layout, one tensor of whole blocks, chunks in descending blocks stored in descending rows
    are one run), and a row may itself straddle a boundary where the row size does not divide
    the segment. Pointers outside the range (the device side) are never cut on their own."""
    src, dst, size = (np.asarray(a, dtype=np.int64) for a in (src, dst, size))
    base, span, segment = int(base), int(span), int(segment)  # numpy scalars would make floats
    cut_entry, cut_off = [], []  # per crossing: the copy, and the offset into it of a boundary
    for side in (src, dst):
        if not len(side):
            break
        rel = side - base
        lo, hi = int(rel.min()), int((rel + size).max()) - 1
        if hi < 0 or lo >= span or (lo >= 0 and lo // segment == hi // segment):
            continue  # this side is all outside, or all inside one segment (a job's usual case)
        first, last = rel // segment, (rel + size - 1) // segment
        crossing = np.nonzero((rel >= 0) & (rel < span) & (size > 0) & (first != last))[0]
        if not len(crossing):
            continue
        # every boundary k * segment with first < k <= last, as an offset into its copy
        per = last[crossing] - first[crossing]
        entry = np.repeat(crossing, per)
        k = first[entry] + 1 + (np.arange(len(entry)) - np.repeat(np.cumsum(per) - per, per))
        cut_entry.append(entry)
        cut_off.append(k * segment - rel[entry])
    if not cut_entry:
        return src, dst, size
    # each copy's pieces start at 0 and at each of its cuts, in order; a piece ends where the
    # next one of the same copy starts, or at the copy's end
    entries = np.concatenate([np.arange(len(size)), *cut_entry])
    offsets = np.concatenate([np.zeros(len(size), dtype=np.int64), *cut_off])
    order = np.lexsort((offsets, entries))
    entries, offsets = entries[order], offsets[order]
    keep = np.concatenate(([True], (entries[1:] != entries[:-1]) | (offsets[1:] != offsets[:-1])))
    entries, offsets = entries[keep], offsets[keep]  # a boundary both sides cross, once
    same = entries[1:] == entries[:-1]
    ends = np.append(np.where(same, offsets[1:], size[entries[:-1]]), size[entries[-1]])
    return src[entries] + offsets, dst[entries] + offsets, ends - offsets


def submit_descriptors(copier: DescriptorCopier, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                       group_sizes: Sequence[int], block_indices: Sequence[int],
                       rows: np.ndarray, direction: str) -> None:
    """The descriptor path of any copier: build the job's copies, source to destination."""
    dev, host, size = layout.descriptors(block_ids, group_sizes, block_indices, rows)
    if direction == "store":
        copier.submit(job_id, dev, host, size, direction)
    else:
        copier.submit(job_id, host, dev, size, direction)


class MemcpyCopier:
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

    def submit_job(self, job_id: int, layout: CopyLayout, block_ids: np.ndarray,
                   group_sizes: Sequence[int], block_indices: Sequence[int], rows: np.ndarray,
                   direction: str) -> None:
        submit_descriptors(self, job_id, layout, block_ids, group_sizes, block_indices, rows,
                           direction)

    def get_finished(self) -> list[Finished]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        return
