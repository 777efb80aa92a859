"""The staged copy path's plan: where each page of a job sits in the device staging buffers.

``CudaCopier``'s ``staged`` path (``cuda_copy.py``) gathers a job's small per-layer pages into
a device buffer laid out like the staging rows they belong to (a store) or scatters them out
of one (a load), so PCIe sees whole-row copies instead of one descriptor per page. This module
is that layout, in numpy only (no CUDA, no torch): the copier executes the plan, and
``tests/test_staged_plan.py`` executes it on host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tiering.backends.block_copy import CopyLayout, merge_runs


class StagedPlan(NamedTuple):
    """A staged job: page ``i`` moves between device address ``dev[i]`` and ``staged[i]`` in a
    staging buffer; ``pieces`` lists, per piece, its page range ``[lo, hi)``, its buffer, and
    its row copies (buffer address, host address, bytes), merged and in host-address order."""

    dev: np.ndarray
    staged: np.ndarray
    size: np.ndarray
    pieces: list[tuple[int, int, int, tuple[np.ndarray, np.ndarray, np.ndarray]]]


def plan_staged(layout: CopyLayout, dev: np.ndarray, host: np.ndarray, size: np.ndarray,
                slot: np.ndarray, rows_per_buffer: int, buffer_addresses: Sequence[int],
                first_buffer: int) -> StagedPlan:
    """Lay a job's pages out in staging buffers like the rows they belong to.

    ``slot[i]``: the index of page ``i``'s row among the job's rows (``CopyLayout.page_rows``).
    Row ``k`` of the job goes into slot ``k % rows_per_buffer`` of piece
    ``k // rows_per_buffer``, each page at the offset it has in its row's cell, so a row that
    the job covers whole reaches the host as one copy (rows covered in part: one copy per run
    of pages). Pieces take the buffers in turn, starting with ``first_buffer``. Cheap on
    purpose (no sort of the pages' addresses): it runs before the first byte moves.
    """
    cell = layout.cell_bytes
    rel = host - layout.row_base
    row = rel // layout.row_bytes
    in_cell = rel - row * layout.row_bytes
    if len(size) and (int(in_cell.min()) < 0 or int((in_cell + size).max()) > cell):
        raise ValueError("a page lies outside its row's cell")
    n_slots = int(slot.max()) + 1 if len(slot) else 0
    piece = slot // rows_per_buffer
    order = np.argsort(piece.astype(np.int32), kind="stable")  # radix sort: O(n)
    dev, host, size, slot, row, in_cell, piece = (
        a[order] for a in (dev, host, size, slot, row, in_cell, piece))
    n_pieces = int(piece[-1]) + 1 if len(piece) else 0
    nbuf = len(buffer_addresses)
    buf_of_piece = (np.arange(n_pieces) + first_buffer) % nbuf
    base = np.asarray(buffer_addresses, dtype=np.int64)
    slot_addr = base[buf_of_piece[np.arange(n_slots) // rows_per_buffer]] + \
        (np.arange(n_slots) % rows_per_buffer) * cell
    staged = slot_addr[slot] + in_cell
    # rows covered whole: one copy each; the others: their pages, merged where they touch
    covered = np.bincount(slot, weights=size, minlength=n_slots)
    whole = covered == cell
    row_of_slot = np.zeros(n_slots, dtype=np.int64)
    row_of_slot[slot] = row
    bounds = np.searchsorted(piece, np.arange(n_pieces + 1))
    whole_slots = np.flatnonzero(whole)
    whole_bounds = np.searchsorted(whole_slots // rows_per_buffer, np.arange(n_pieces + 1))
    pieces = []
    for p in range(n_pieces):
        lo, hi = int(bounds[p]), int(bounds[p + 1])
        ws = whole_slots[whole_bounds[p]:whole_bounds[p + 1]]
        src = [slot_addr[ws]]
        dst = [layout.row_base + row_of_slot[ws] * layout.row_bytes]
        n = [np.full(len(ws), cell, dtype=np.int64)]
        part = ~whole[slot[lo:hi]]
        if part.any():
            s, d, k = merge_runs(staged[lo:hi][part], host[lo:hi][part], size[lo:hi][part],
                                 by="dst")
            src.append(s)
            dst.append(d)
            n.append(k)
        a_src, a_dst, a_n = (np.ascontiguousarray(np.concatenate(a), dtype=np.uint64)
                             for a in (src, dst, n))
        pieces.append((lo, hi, int(buf_of_piece[p]), (a_src, a_dst, a_n)))
    return StagedPlan(dev, staged, size, pieces)
