"""The staged copy path's layout plan (``staged_plan.plan_staged``), executed on host memory.

The GPU engine runs the plan as kernels (page gathers/scatters) and batched row copies; here
the same plan is run with ``memmove`` over numpy buffers standing in for device memory, so the
arithmetic (which page goes to which buffer slot, which runs reach which row) is checked on any
machine. The GPU tests (tests/gpu/) run the real thing.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tiering.backends.block_copy import CopyLayout, TensorInfo
from tiering.backends.staged_plan import plan_staged


def build(pages=(512, 1024, 512), num_blocks=40, bpc=1, rows=24, rank=0, world=1, seed=0):
    rng = np.random.default_rng(seed)
    tensors = [rng.integers(0, 256, (num_blocks, p), dtype=np.uint8) for p in pages]
    infos = [TensorInfo(t.ctypes.data, t.strides[0], p) for t, p in zip(tensors, pages,
                                                                         strict=True)]
    cell = sum(pages) * bpc
    row_bytes = -(-cell * world // 4096) * 4096
    region = np.zeros(rows * row_bytes, dtype=np.uint8)
    refs = [[(i, p) for i, p in enumerate(pages)]]
    layout = CopyLayout(infos, refs, region.ctypes.data, row_bytes, rank, cell, bpc)
    return tensors, region, layout


def run_plan(layout, dev, host, size, rows_per_buffer, store, nbuf=2, first=0, slot=None):
    bufs = [np.full(rows_per_buffer * layout.cell_bytes, 0xEE, dtype=np.uint8)
            for _ in range(nbuf)]
    plan = plan_staged(layout, dev, host, size, slot, rows_per_buffer,
                       [b.ctypes.data for b in bufs], first)
    assert sorted(plan.size.tolist()) == sorted(size.tolist())
    seen_bufs = []
    for lo, hi, b, (staged_addr, host_addr, n) in plan.pieces:
        seen_bufs.append(b)
        if store:  # gather, then rows out
            for i in range(lo, hi):
                ctypes.memmove(int(plan.staged[i]), int(plan.dev[i]), int(plan.size[i]))
            for a, h, k in zip(staged_addr.tolist(), host_addr.tolist(), n.tolist(), strict=True):
                ctypes.memmove(h, a, k)
        else:  # rows in, then scatter
            for a, h, k in zip(staged_addr.tolist(), host_addr.tolist(), n.tolist(), strict=True):
                ctypes.memmove(a, h, k)
            for i in range(lo, hi):
                ctypes.memmove(int(plan.dev[i]), int(plan.staged[i]), int(plan.size[i]))
        # every staged page lies inside its piece's buffer slot range
        base = bufs[b].ctypes.data
        assert np.all(plan.staged[lo:hi] >= base)
        assert np.all(plan.staged[lo:hi] + plan.size[lo:hi] <= base + len(bufs[b]))
    assert seen_bufs == [(first + k) % nbuf for k in range(len(plan.pieces))]
    return plan


@pytest.mark.parametrize("rows_per_buffer", [1, 3, 64])
@pytest.mark.parametrize("bpc,rank,world", [(1, 0, 1), (4, 0, 1), (2, 1, 2)])
def test_store_then_load_round_trips_through_the_plan(rows_per_buffer, bpc, rank, world):
    tensors, region, layout = build(bpc=bpc, rank=rank, world=world)
    rng = np.random.default_rng(1)
    n_rows = 5
    blocks = rng.choice(20, n_rows * bpc, replace=False)
    rows = rng.choice(24, n_rows, replace=False)
    dev, host, size = layout.descriptors(blocks, [len(blocks)], [0], rows)
    slot = layout.page_rows([len(blocks)], [0])
    run_plan(layout, dev, host, size, rows_per_buffer, store=True, slot=slot)
    # each row holds its chunk's pages in the row layout (tensor after tensor; in each, the
    # chunk's blocks last position first: CopyLayout)
    cell = layout.cell_bytes
    for r_i, r in enumerate(rows):
        start = r * layout.row_bytes + rank * cell
        got = region[start:start + cell]
        off = 0
        for t in tensors:
            page = t.shape[1]
            for k in reversed(range(bpc)):
                assert np.array_equal(got[off:off + page], t[blocks[r_i * bpc + k]])
                off += page
    # other rows of the region are untouched
    other = np.setdiff1d(np.arange(24), rows)
    assert not region.reshape(24, -1)[other].any()
    # load into other blocks: the same bytes come back
    targets = 20 + rng.choice(20, n_rows * bpc, replace=False)
    before = [t[blocks].copy() for t in tensors]
    dev, host, size = layout.descriptors(targets, [len(targets)], [0], rows)
    run_plan(layout, dev, host, size, rows_per_buffer, store=False, first=1, slot=slot)
    for t, b in zip(tensors, before, strict=True):
        assert np.array_equal(t[targets], b)


def test_partial_first_chunk_writes_only_its_pages():
    """A job starting mid-chunk (block_indices not a multiple of blocks_per_chunk) must leave
    the rest of the row's cell as it was: the row copies cover only the job's pages."""
    tensors, region, layout = build(bpc=4)
    region[:] = 0x5A
    blocks = np.array([3, 9, 11, 17, 19], dtype=np.int64)  # 1 partial chunk (skip 3) + 1 whole
    rows = np.array([6, 2], dtype=np.int64)
    dev, host, size = layout.descriptors(blocks, [5], [3], rows)
    plan = run_plan(layout, dev, host, size, 2, store=True, slot=layout.page_rows([5], [3]))
    cell = layout.cell_bytes
    row6 = region[6 * layout.row_bytes:6 * layout.row_bytes + cell]
    page0 = tensors[0].shape[1]
    # position 3 (block 3) is tensor 0's first slot (last position first); positions 0..2, in
    # its next three slots, were not part of the job
    assert np.array_equal(row6[:page0], tensors[0][3])
    assert np.all(row6[page0:4 * page0] == 0x5A)
    # the row copies move exactly the job's bytes: the partial row as runs inside its cell,
    # the whole row as one copy
    _, host_addr, n = plan.pieces[0][3]
    assert int(n.sum()) == int(size.sum())
    assert len(n) == 1 + len(tensors)  # row 2 whole; row 6: one run per tensor (position 3)


def test_page_outside_its_cell_is_refused():
    _, region, layout = build()
    dev = np.array([0], dtype=np.int64)
    host = np.array([layout.row_base + layout.cell_bytes - 16], dtype=np.int64)
    with pytest.raises(ValueError, match="outside its row's cell"):
        plan_staged(layout, dev, host, np.array([32], dtype=np.int64), np.zeros(1, np.int64), 2,
                    [0, 0], 0)


def _random_job(rng: np.random.Generator, n_groups: int, bpc: int, num_blocks: int,
                n_rows: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Block ids (each group's in ascending, descending or shuffled order, or runs of both),
    group sizes, first logical blocks (partial first chunks among them) and distinct rows."""
    blocks, sizes, firsts, rows = [], [], [], []
    free = [int(r) for r in rng.permutation(n_rows)]
    pool = [int(b) for b in rng.permutation(num_blocks)]
    for _ in range(n_groups):
        n = int(rng.integers(0, 3 * bpc + 1))
        ids = sorted(pool[:n])
        del pool[:n]
        mode = rng.integers(0, 4)
        if mode == 1:
            ids = ids[::-1]
        elif mode == 2:
            ids = [int(b) for b in rng.permutation(ids)]
        elif mode == 3:  # runs of either direction
            runs = [ids[i:i + 4] for i in range(0, n, 4)]
            ids = [b for r in runs for b in (r[::-1] if rng.random() < 0.5 else r)]
        first = int(rng.integers(0, 3 * bpc))
        blocks += ids
        sizes.append(n)
        firsts.append(first)
        rows += [free.pop() for _ in range(-(-(n + first % bpc) // bpc) if n else 0)]
    return blocks, sizes, firsts, rows


@pytest.mark.parametrize("seed", range(16))
def test_the_plan_moves_the_same_bytes_as_the_host_copier(seed):
    """For any block order, partial first chunks, several groups (refs copying less than the
    padded page among them) and a second rank's cell, the staged plan writes exactly the
    bytes ``MemcpyCopier`` writes for the same descriptors (rows and the rest of the region),
    and its load puts back exactly what the host copier's load puts back."""
    from tiering.backends.block_copy import MemcpyCopier

    rng = np.random.default_rng(100 + seed)
    bpc = int(rng.choice([1, 2, 4, 8]))
    world = int(rng.choice([1, 2]))
    rank = int(rng.integers(0, world))
    pages = [int(rng.choice([256, 512, 1024])) for _ in range(int(rng.integers(1, 4)))]
    num_blocks, n_rows = 64, 40
    tensors = [rng.integers(0, 256, (num_blocks, p), dtype=np.uint8) for p in pages]
    infos = [TensorInfo(t.ctypes.data, t.strides[0], p) for t, p in zip(tensors, pages,
                                                                         strict=True)]
    n_groups = int(rng.integers(1, 4))
    refs = [[(int(i), int(rng.choice([pages[i], pages[i] - 64])))
             for i in sorted(rng.choice(len(pages), int(rng.integers(1, len(pages) + 1)),
                                        replace=False))] for _ in range(n_groups)]
    cell = sum(pages) * bpc
    row_bytes = -(-cell * world // 4096) * 4096
    region = rng.integers(0, 256, n_rows * row_bytes, dtype=np.uint8)
    layout = CopyLayout(infos, refs, region.ctypes.data, row_bytes, rank, cell, bpc)
    blocks, sizes, firsts, rows = _random_job(rng, n_groups, bpc, num_blocks, n_rows)
    dev, host, size = layout.descriptors(np.asarray(blocks, dtype=np.int64), sizes, firsts,
                                         np.asarray(rows, dtype=np.int64))
    slot = layout.page_rows(sizes, firsts)
    rows_per_buffer = int(rng.integers(1, 5))
    before = region.copy()
    run_plan(layout, dev, host, size, rows_per_buffer, store=True, slot=slot)
    staged = region.copy()
    region[:] = before
    MemcpyCopier().submit(1, dev, host, size)
    assert np.array_equal(staged, region)
    # loads: the stored rows back into the GPU blocks, after scrambling them
    stored = [t.copy() for t in tensors]
    for t in tensors:
        t[:] = rng.integers(0, 256, t.shape, dtype=np.uint8)
    scrambled = [t.copy() for t in tensors]
    run_plan(layout, dev, host, size, rows_per_buffer, store=False, first=1, slot=slot)
    by_plan = [t.copy() for t in tensors]
    for t, s in zip(tensors, scrambled, strict=True):
        t[:] = s
    MemcpyCopier().submit(2, host, dev, size, "load")
    for t, p in zip(tensors, by_plan, strict=True):
        assert np.array_equal(t, p)
    for g, n in enumerate(sizes):  # and the loaded pages are the stored ones
        lo = sum(sizes[:g])
        for b in blocks[lo:lo + n]:
            for i, nbytes in refs[g]:
                assert np.array_equal(tensors[i][b, :nbytes], stored[i][b, :nbytes])
