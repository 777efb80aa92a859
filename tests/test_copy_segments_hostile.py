"""Hostile tests: copies cut where the staging rows' CUDA registrations meet.

``CudaCopier`` registers the staging rows with CUDA in segments and one copy may not span two
registrations (``cudaMemcpyBatchAsync`` fails with an invalid value: a real engine stopped on an
H100 when ``merge_runs`` joined neighbouring rows of the packed layout). Every batch it submits
is first cut by ``block_copy.split_at_segments``. Here that preparation (``merge_runs`` by the
host side, then ``split_at_segments``) runs on random layouts and jobs over numpy buffers that
stand in for device and host memory, every resulting copy is checked (inside one segment, in
bounds, nothing lost, duplicated or cut needlessly) and executed with ``memmove``, and the
bytes are compared with the layout's definition (``CopyLayout``: a worker's cell of the row,
tensor after tensor, a chunk's blocks last position first), written out here independently.

The real ``CudaCopier`` (its constructor, ``submit_job``, ``submit``, ``_copy``, and the staged
path's row copies through ``_copy``) is also run, over stand-ins for torch and the CUDA runtime
that record the registrations it makes and refuse, as CUDA does, a copy that spans two of them.
No GPU is needed; nothing is skipped.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from tiering.backends.block_copy import CopyLayout, TensorInfo, merge_runs, split_at_segments
from tiering.backends.staged_plan import plan_staged

# -- helpers ---------------------------------------------------------------------------------------


def crosses(ptr, size, base: int, span: int, segment: int) -> np.ndarray:
    """Per copy: does this side start inside ``[base, base + span)`` and cross a boundary?"""
    ptr, size = np.asarray(ptr, dtype=np.int64), np.asarray(size, dtype=np.int64)
    rel = ptr - base
    inside = (rel >= 0) & (rel < span)
    return inside & (size > 0) & (rel // segment != (rel + size - 1) // segment)


def check_split(orig, out, base: int, span: int, segment: int) -> None:
    """``out`` is ``orig`` cut at segment boundaries and nowhere else: the pieces of each copy
    follow each other in order on both sides, add up to it exactly, no piece is empty (unless
    its copy was), no in-range side of a piece crosses a boundary, and every cut lies on a
    boundary of a side that starts inside the range."""
    s, d, n = (np.asarray(a, dtype=np.int64).tolist() for a in orig)
    s2, d2, n2 = (np.asarray(a).tolist() for a in out)
    assert len(s2) == len(d2) == len(n2)
    j = 0
    for i in range(len(n)):
        if n[i] == 0:
            assert (s2[j], d2[j], n2[j]) == (s[i], d[i], 0), (i, j)
            j += 1
            continue
        acc = 0
        while acc < n[i]:
            assert j < len(n2), f"copy {i} lost {n[i] - acc} bytes"
            assert n2[j] > 0, f"copy {i}: empty piece {j}"
            assert s2[j] == s[i] + acc and d2[j] == d[i] + acc, f"copy {i}: piece {j} misplaced"
            acc += n2[j]
            j += 1
            if acc < n[i]:  # a cut: only where an in-range side meets a boundary
                assert any(0 <= p - base < span and (p + acc - base) % segment == 0
                           for p in (s[i], d[i])), f"copy {i} cut needlessly at +{acc}"
        assert acc == n[i], f"copy {i}: pieces add up to {acc}, not {n[i]}"
    assert j == len(n2), f"{len(n2) - j} extra pieces"
    for side in (s2, d2):
        assert not crosses(side, n2, base, span, segment).any()


def disjoint(ptr, size) -> bool:
    ptr, size = np.asarray(ptr, dtype=np.int64), np.asarray(size, dtype=np.int64)
    keep = size > 0
    ptr, size = ptr[keep], size[keep]
    order = np.argsort(ptr, kind="stable")
    ptr, size = ptr[order], size[order]
    return bool(np.all(ptr[:-1] + size[:-1] <= ptr[1:]))


# -- random cases ----------------------------------------------------------------------------------


@dataclass
class Case:
    desc: str
    layout: CopyLayout
    dev_mem: np.ndarray  # every KV tensor lives in here ("device" memory)
    host_mem: np.ndarray  # the staging rows, from ``lead`` on
    lead: int
    base: int
    span: int
    segment: int
    blocks: np.ndarray
    group_sizes: list[int]
    block_indices: list[int]
    rows: np.ndarray
    # the layout's definition, independently: (device offset, host offset, bytes) per page
    expect: list[tuple[int, int, int]] = field(default_factory=list)
    cell: int = 0

    def arenas(self) -> list[tuple[int, int]]:
        return [(self.dev_mem.ctypes.data, self.dev_mem.ctypes.data + len(self.dev_mem)),
                (self.base, self.base + self.span)]


def _order(rng, ids: np.ndarray, how: str) -> np.ndarray:
    if how == "asc":
        return np.sort(ids)
    if how == "desc":
        return np.sort(ids)[::-1].copy()
    return rng.permutation(ids)


def _pick(rng, total: int, universe: int, how: str) -> np.ndarray:
    """``total`` distinct ids below ``universe``: a contiguous run (ascending or descending, as
    vLLM hands recycled blocks out) or a random set in ascending, descending or random order."""
    if how in ("run_desc", "run_asc"):
        start = int(rng.integers(0, universe - total + 1))
        ids = np.arange(start, start + total, dtype=np.int64)
        return ids[::-1].copy() if how == "run_desc" else ids
    return _order(rng, rng.choice(universe, total, replace=False).astype(np.int64), how)


ORDERS = ("run_desc", "run_asc", "asc", "desc", "random")


def make_case(seed: int, kind: str | None = None) -> Case:
    rng = np.random.default_rng(seed)
    kind = kind or str(rng.choice(["bug", "bug", "packed", "per_layer", "interleaved",
                                    "per_layer"]))
    bug = kind == "bug"  # the H100 crash's shape: whole rows back to back, descending runs
    world = 1 if bug else int(rng.choice([1, 1, 2, 3, 4, 8]))
    rank = int(rng.integers(world))
    bpc = int(rng.choice([1, 2, 3, 4, 8]))
    if kind in ("bug", "packed"):
        n_t = 1 if bug or rng.random() < 0.7 else 2
        pages = [int(rng.choice([64, 100, 192, 256, 512, 1000, 1024])) for _ in range(n_t)]
    else:
        n_t = int(rng.integers(1, 41))
        pages = [int(p) for p in rng.choice([7, 8, 13, 16, 32, 48, 64, 100, 128], n_t)]
    n_groups = int(rng.integers(1, min(n_t, 3) + 1)) if not bug else 1
    if kind == "packed" and rng.random() < 0.4:
        n_groups = int(rng.integers(1, 4))  # groups sharing one packed tensor
    # tensor refs: each tensor in one group, every group at least one; sometimes shared
    owner = rng.integers(0, n_groups, n_t)
    owner[rng.permutation(n_t)[:n_groups]] = np.arange(min(n_groups, n_t))
    refs: list[list[tuple[int, int]]] = [[] for _ in range(n_groups)]
    for t in rng.permutation(n_t).tolist():
        nb = pages[t] if bug or rng.random() < 0.8 else int(rng.integers(1, pages[t] + 1))
        refs[int(owner[t]) % n_groups].append((t, nb))
        if n_groups > 1 and rng.random() < 0.15:
            other = (int(owner[t]) + 1) % n_groups
            refs[other].append((t, pages[t]))
    for g in range(n_groups):  # more groups than tensors: groups share one (hybrid models)
        if not refs[g]:
            t = int(rng.integers(n_t))
            refs[g].append((t, pages[t]))

    # the job: per group its blocks and first logical block (a partial first chunk)
    group_sizes, block_indices, n_rows_needed = [], [], 0
    cap = 48
    for _ in range(n_groups):
        n = 0 if rng.random() < 0.15 else int(rng.integers(1, 17))
        if bug:  # several whole chunks
            n = int(rng.integers(2, max(3, 48 // bpc) + 1)) * bpc
        n = min(n, cap - sum(group_sizes))
        skip = 0 if bug else int(rng.integers(0, 4 * bpc + 3))
        group_sizes.append(n)
        block_indices.append(skip)
        if n:
            n_rows_needed += -(-(n + skip % bpc) // bpc)
    total = sum(group_sizes)
    num_blocks = total + int(rng.integers(1, 24))
    num_rows = n_rows_needed + int(rng.integers(1 if not bug else 0, 10)) + (1 if bug else 0)

    # device memory: tensors apart (padded strides, placed in random order), interleaved
    # views of one block-outermost storage, or one packed tensor
    strides, offs = [0] * n_t, [0] * n_t
    if kind == "interleaved":
        block = sum(pages) + (0 if rng.random() < 0.6 else int(rng.integers(1, 33)))
        pre = np.cumsum([0] + pages).tolist()
        for t in range(n_t):
            strides[t], offs[t] = block, pre[t]
        dev_bytes = block * num_blocks
    else:
        at = 0
        for t in rng.permutation(n_t).tolist():
            pad = 0 if bug or rng.random() < 0.6 else int(rng.integers(1, 33))
            strides[t], offs[t] = pages[t] + pad, at
            at += strides[t] * num_blocks + (0 if rng.random() < 0.5 else int(rng.integers(1, 65)))
        dev_bytes = at
    dev_mem = np.zeros(dev_bytes + 64, dtype=np.uint8)
    dbase = dev_mem.ctypes.data
    tensors = [TensorInfo(dbase + offs[t], strides[t], pages[t]) for t in range(n_t)]

    # the rows: a cell per worker, padded cells and rows (rows need not divide a segment)
    cell = sum(pages) * bpc + (0 if bug or rng.random() < 0.6 else int(rng.integers(1, 51)))
    row_bytes = world * cell + (0 if bug or rng.random() < 0.5 else int(rng.integers(1, 101)))
    span = num_rows * row_bytes
    lead = int(rng.integers(0, 64))  # a region base on no particular alignment
    host_mem = np.zeros(lead + span + 64, dtype=np.uint8)
    base = host_mem.ctypes.data + lead
    layout = CopyLayout(tensors, refs, base, row_bytes, rank, cell, bpc)

    blocks = _pick(rng, total, num_blocks, "run_desc" if bug else str(rng.choice(ORDERS)))
    rows = _pick(rng, n_rows_needed, num_rows, "run_desc" if bug else str(rng.choice(ORDERS)))

    # a segment: below a page, around a row, several rows, the whole region or more
    seg_choices = [int(rng.integers(1, min(pages) + 1)), min(pages), max(pages) + 1,
                   row_bytes - 1 if row_bytes > 1 else 1, row_bytes + 1, 2 * row_bytes + 3,
                   3 * row_bytes, cell, int(rng.integers(row_bytes // 2 + 1, 4 * row_bytes + 2)),
                   span, span + 1, 3 * span + 7, int(rng.integers(1, span + 1))]
    segment = max(1, int(rng.choice(seg_choices)))
    nbytes = sum(nb for g in range(n_groups) for _, nb in refs[g]) * max(group_sizes + [0])
    segment = max(segment, nbytes // 4000 + 1)  # keep the piece count (and the test) small

    expect = []
    blk_off = row_off = 0
    toff = np.cumsum([0] + [p * bpc for p in pages]).tolist()
    for g, n in enumerate(group_sizes):
        if not n:
            continue
        skip = block_indices[g] % bpc
        g_rows = rows[row_off:row_off + -(-(n + skip) // bpc)].tolist()
        for t, nb in refs[g]:
            for i in range(n):
                pos = skip + i
                b = int(blocks[blk_off + i])
                h = lead + rank * cell + g_rows[pos // bpc] * row_bytes + toff[t] \
                    + (bpc - 1 - pos % bpc) * pages[t]
                expect.append((offs[t] + b * strides[t], h, nb))
        blk_off += n
        row_off += len(g_rows)
    desc = (f"seed={seed} kind={kind} world={world} rank={rank} bpc={bpc} tensors={n_t} "
            f"groups={group_sizes} skips={block_indices} cell={cell} row={row_bytes} "
            f"rows={num_rows} lead={lead} segment={segment}")
    return Case(desc, layout, dev_mem, host_mem, lead, base, span, segment, blocks,
                group_sizes, block_indices, rows, expect, cell)


def fill(case: Case, store: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bytes on the source side, a random sentinel on the other; the expected memory
    (both sides) after the job."""
    rng = np.random.default_rng(seed)
    case.dev_mem[:] = rng.integers(0, 256, len(case.dev_mem), dtype=np.uint8)
    case.host_mem[:] = rng.integers(0, 256, len(case.host_mem), dtype=np.uint8)
    want_dev, want_host = case.dev_mem.copy(), case.host_mem.copy()
    written = np.zeros(len(want_host) if store else len(want_dev), dtype=np.int32)
    for dev_off, host_off, nb in case.expect:
        if store:
            want_host[host_off:host_off + nb] = case.dev_mem[dev_off:dev_off + nb]
            written[host_off:host_off + nb] += 1
        else:
            want_dev[dev_off:dev_off + nb] = case.host_mem[host_off:host_off + nb]
            written[dev_off:dev_off + nb] += 1
    assert written.max(initial=0) <= 1, f"the generator made overlapping pages: {case.desc}"
    return want_dev, want_host


def in_arena(arenas, p: int, n: int) -> bool:
    return any(lo <= p and p + n <= hi for lo, hi in arenas)


def execute(case: Case, s, d, n) -> None:
    """memmove each copy, after checking that both sides are in the buffers (no wild writes)."""
    arenas = case.arenas()
    for a, b, k in zip(np.asarray(s).tolist(), np.asarray(d).tolist(), np.asarray(n).tolist(),
                       strict=True):
        assert in_arena(arenas, a, k) and in_arena(arenas, b, k), \
            f"copy {a:#x} -> {b:#x} ({k}) out of bounds: {case.desc}"
        ctypes.memmove(b, a, k)


def prepare(case: Case, store: bool):
    """What ``CudaCopier.submit`` and ``_copy`` do to a job's descriptors before the batch call."""
    dev, host, size = case.layout.descriptors(case.blocks, case.group_sizes, case.block_indices,
                                              case.rows)
    src, dst = (dev, host) if store else (host, dev)
    merged = merge_runs(src, dst, size, by="dst" if store else "src")
    return (dev, host, size), merged, split_at_segments(*merged, case.base, case.span,
                                                        case.segment)


SEEDS = range(150)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_layouts_cut_and_copy_exactly(seed):
    """Random layout, job and segment: the layout's descriptors are the definition's pages; after
    merge and cut no copy crosses a segment on the host side, the cut loses, adds and moves no
    byte, destinations never overlap, and both directions move exactly the pages the layout
    defines (the rest of both memories unchanged)."""
    case = make_case(seed)
    for store in (True, False):
        (dev, host, size), merged, out = prepare(case, store)
        dbase = case.dev_mem.ctypes.data
        hbase = case.host_mem.ctypes.data
        got = sorted(zip((dev - dbase).tolist(), (host - hbase).tolist(), size.tolist(),
                         strict=True))
        assert got == sorted(case.expect), case.desc
        check_split(merged, out, case.base, case.span, case.segment)
        s, d, n = out
        host_side = d if store else s
        assert not crosses(host_side, n, case.base, case.span, case.segment).any(), case.desc
        rel = np.asarray(host_side, dtype=np.int64) - case.base
        assert np.all((rel >= 0) & (rel + n <= case.span)), case.desc
        assert disjoint(d, n), f"overlapping destinations: {case.desc}"
        assert int(np.sum(n)) == int(np.sum(size)), case.desc
        want_dev, want_host = fill(case, store, seed * 2 + store)
        execute(case, s, d, n)
        assert np.array_equal(case.host_mem, want_host), f"host bytes: {case.desc}"
        assert np.array_equal(case.dev_mem, want_dev), f"device bytes: {case.desc}"


def test_the_random_cases_do_reach_the_hazard():
    """The random suite is only worth something if merged runs actually cross boundaries (and
    rows straddle them) before the cut: count them."""
    crossing_cases = merged_across_rows = 0
    for seed in SEEDS:
        case = make_case(seed)
        for store in (True, False):
            (_, _, size), merged, _ = prepare(case, store)
            host_side = merged[1] if store else merged[0]
            if crosses(host_side, merged[2], case.base, case.span, case.segment).any():
                crossing_cases += 1
            merged_across_rows += int((merged[2] > case.layout.cell_bytes).any())
    assert crossing_cases >= 100, crossing_cases
    assert merged_across_rows >= 50, merged_across_rows


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 2)])
def test_packed_descending_runs_with_rows_that_do_not_divide_the_segment(world, rank):
    """The H100 crash's shape, harder: packed pages, chunks in descending blocks stored in
    descending rows, rows of a size that does not divide the segment (so rows and pages
    straddle boundaries), a second worker's cell, a base on no alignment. Checked exactly."""
    page, bpc = 96, 4
    cell = page * bpc
    row_bytes = world * cell + (0 if world == 1 else 40)
    num_rows, n_chunks = 20, 12
    span = num_rows * row_bytes
    dev_mem = np.zeros(200 * page, dtype=np.uint8)
    host_mem = np.zeros(span + 64 + 5, dtype=np.uint8)
    base = host_mem.ctypes.data + 5
    layout = CopyLayout([TensorInfo(dev_mem.ctypes.data, page, page)], [[(0, page)]], base,
                        row_bytes, rank, cell, bpc)
    blocks = np.arange(150, 150 - n_chunks * bpc, -1, dtype=np.int64)
    rows = np.arange(16, 16 - n_chunks, -1, dtype=np.int64)
    expect = [(int(b) * page, 5 + rank * cell + int(rows[i // bpc]) * row_bytes
               + (bpc - 1 - i % bpc) * page, page) for i, b in enumerate(blocks)]
    case = Case("packed-desc", layout, dev_mem, host_mem, 5, base, span, 0, blocks,
                [len(blocks)], [0], rows, expect, cell)
    for segment in (7, page - 1, page, page + 1, cell - 1, cell + 3, row_bytes + 1,
                    5 * row_bytes - 11, span - 1):
        case.segment = segment
        for store in (True, False):
            _, merged, out = prepare(case, store)
            if world == 1:
                assert len(merged[2]) == 1  # one run over twelve rows: the hazard
            check_split(merged, out, base, span, segment)
            want_dev, want_host = fill(case, store, segment)
            execute(case, *out)
            assert np.array_equal(host_mem, want_host), (segment, store)
            assert np.array_equal(dev_mem, want_dev), (segment, store)


# -- split_at_segments itself ----------------------------------------------------------------------

BASE, SPAN, SEG = 1 << 20, 10 << 16, 1 << 16
DEV = 1 << 40


def split1(host: int, size: int, host_is_src: bool = False, base=BASE, span=SPAN, seg=SEG):
    src, dst = ([host], [DEV]) if host_is_src else ([DEV], [host])
    s, d, n = split_at_segments(np.array(src), np.array(dst), np.array([size]), base, span, seg)
    return (s if host_is_src else d).tolist(), n.tolist()


@pytest.mark.parametrize("host_is_src", [False, True])
def test_split_edges_at_boundaries(host_is_src):
    b = BASE
    # exactly one whole segment, from a boundary to the next: untouched
    assert split1(b, SEG, host_is_src) == ([b], [SEG])
    # ending exactly at a boundary
    assert split1(b + SEG - 10, 10, host_is_src) == ([b + SEG - 10], [10])
    # starting exactly at a boundary, one byte over the next
    assert split1(b + SEG, SEG + 1, host_is_src) == ([b + SEG, b + 2 * SEG], [SEG, 1])
    # one byte on each side of a boundary
    assert split1(b + SEG - 1, 2, host_is_src) == ([b + SEG - 1, b + SEG], [1, 1])
    # the last byte of the region
    assert split1(b + SPAN - 1, 1, host_is_src) == ([b + SPAN - 1], [1])
    # many segments: a piece per segment touched
    ptr, n = split1(b + 5, 7 * SEG, host_is_src)
    assert n == [SEG - 5] + [SEG] * 6 + [5]
    assert ptr == [b + 5] + [b + k * SEG for k in range(1, 8)]
    # the whole region at once
    ptr, n = split1(b, SPAN, host_is_src)
    assert n == [SEG] * 10 and ptr == [b + k * SEG for k in range(10)]
    # a segment of one byte: every byte its own copy
    ptr, n = split1(b + 3, 5, host_is_src, seg=1)
    assert n == [1] * 5 and ptr == [b + 3 + k for k in range(5)]
    # a segment that does not divide the span
    ptr, n = split1(b, SPAN, host_is_src, seg=3 * SEG + 1)
    assert n == [3 * SEG + 1] * 3 + [SPAN - 3 * (3 * SEG + 1)]


def test_split_leaves_pointers_outside_the_range_alone():
    """The device side is never cut on its own: below the base, at or past the end."""
    for ptr in (0, BASE - SEG, BASE - 1, BASE + SPAN, BASE + SPAN + 5, DEV):
        s, d, n = split_at_segments(np.array([ptr]), np.array([DEV + 3]), np.array([3 * SEG]),
                                    BASE, SPAN, SEG)
        assert (s.tolist(), d.tolist(), n.tolist()) == ([ptr], [DEV + 3], [3 * SEG]), ptr


def test_split_with_both_sides_in_the_range_cuts_at_both_sides_boundaries():
    src, dst, size = [BASE + 100], [BASE + 5 * SEG + 40_000], [2 * SEG]
    s, d, n = split_at_segments(np.array(src), np.array(dst), np.array(size), BASE, SPAN, SEG)
    check_split((src, dst, size), (s, d, n), BASE, SPAN, SEG)
    # cuts where the source meets a boundary (SEG - 100, 2 SEG - 100) and where the
    # destination does (SEG - 40000, 2 SEG - 40000), in order
    cuts = sorted({SEG - 100, 2 * SEG - 100, SEG - 40_000, 2 * SEG - 40_000})
    assert n.tolist() == np.diff([0, *cuts, 2 * SEG]).tolist()
    # both sides on the same phase: a cut serves both
    s, d, n = split_at_segments(np.array([BASE + 10]), np.array([BASE + 3 * SEG + 10]),
                                np.array([SEG]), BASE, SPAN, SEG)
    assert n.tolist() == [SEG - 10, 10]


def test_split_of_empty_and_zero_length_copies():
    e = np.empty(0, dtype=np.int64)
    s, d, n = split_at_segments(e, e, e, BASE, SPAN, SEG)
    assert len(s) == len(d) == len(n) == 0
    s, d, n = split_at_segments([], [], [], BASE, SPAN, SEG)
    assert len(n) == 0
    # zero-byte copies (one exactly on a boundary) beside real ones: kept as they are, no cut
    src = [DEV, DEV + 8, DEV + 100]
    dst = [BASE + SEG, BASE + SEG - 4, BASE + 2 * SEG]
    size = [0, 8, 0]
    s, d, n = split_at_segments(np.array(src), np.array(dst), np.array(size), BASE, SPAN, SEG)
    check_split((src, dst, size), (s, d, n), BASE, SPAN, SEG)
    assert n.tolist() == [0, 4, 4, 0]


def test_split_takes_any_integer_input_and_gives_the_same_copies():
    """int64 or uint64 arrays (the copier hands uint64), Python lists, numpy scalars for
    base/span/segment, addresses high in the user address space: the same pieces."""
    hi_base = 0x7F3A_1234_5000 + 12  # a high mmap address, on no alignment
    seg, span = 1 << 30, 40 << 30
    rng = np.random.default_rng(3)
    k = 300
    host = hi_base + rng.integers(0, span - (3 << 30), k)
    dev = 0x7E00_0000_0000 + rng.integers(0, 1 << 36, k)
    size = rng.integers(1, 3 << 30, k)
    ref = split_at_segments(dev, host, size, hi_base, span, seg)
    check_split((dev, host, size), ref, hi_base, span, seg)
    assert int(ref[2].sum()) == int(size.sum())
    variants = [
        (dev.astype(np.uint64), host.astype(np.uint64), size.astype(np.uint64), hi_base, span,
         seg),
        (dev.tolist(), host.tolist(), size.tolist(), hi_base, span, seg),
        (dev, host, size, np.int64(hi_base), np.int64(span), np.int64(seg)),
        (dev.astype(np.uint64), host.astype(np.uint64), size.astype(np.uint64),
         np.uint64(hi_base), np.uint64(span), np.uint64(seg)),
    ]
    for args in variants:
        out = split_at_segments(*args)
        for a, b in zip(out, ref, strict=True):
            assert np.asarray(a).dtype == np.int64
            assert np.asarray(a).tolist() == b.tolist()


def test_split_is_idempotent_and_a_no_op_where_nothing_crosses():
    rng = np.random.default_rng(11)
    for _ in range(100):
        k = int(rng.integers(1, 30))
        seg = int(rng.integers(1, 5000))
        span = int(rng.integers(1, 40_000))
        size = rng.integers(0, 3 * seg + 2, k)
        host = BASE + rng.integers(-seg, span + seg, k)  # some below, some past the range
        dev = DEV + rng.integers(0, 1 << 20, k)
        for src, dst in ((host, dev), (dev, host)):
            once = split_at_segments(src, dst, size, BASE, span, seg)
            check_split((src, dst, size), once, BASE, span, seg)
            twice = split_at_segments(*once, BASE, span, seg)
            assert all(np.array_equal(a, b) for a, b in zip(once, twice, strict=True))
    # within one segment (also: every copy outside the range): the input back
    s, d, n = split_at_segments(np.array([DEV, DEV + 64]), np.array([BASE + SEG, BASE + SEG + 64]),
                                np.array([64, SEG - 64]), BASE, SPAN, SEG)
    assert n.tolist() == [64, SEG - 64]


def test_a_copy_starting_below_the_range_that_reaches_into_it():
    """A side that starts below the base counts as outside (the device side's rule), even if it
    runs into the rows: pinned here so a change of the rule is seen. The other side, inside the
    range, is still cut."""
    s, d, n = split_at_segments(np.array([BASE - 10]), np.array([DEV]), np.array([2 * SEG]),
                                BASE, SPAN, SEG)
    assert n.tolist() == [2 * SEG]
    s, d, n = split_at_segments(np.array([BASE - 10]), np.array([BASE + SEG - 1]),
                                np.array([SEG]), BASE, SPAN, SEG)
    assert n.tolist() == [1, SEG - 1] and s.tolist() == [BASE - 10, BASE - 9]


def test_real_register_segment_on_a_large_packed_region():
    """The real registration size (1 GiB) over a ~38 GiB region of rows that do not divide it:
    an 8B-sized packed page (2 MiB a block, 16 blocks a chunk), a third worker of three (cells
    straddle boundaries) and one worker alone (runs over many rows). Arithmetic only."""
    from tiering.backends.cuda_copy import REGISTER_SEGMENT

    page, bpc = 2 << 20, 16
    cell = page * bpc
    base = 0x7F00_0000_0000 + 4096 * 7
    for world, rank, n_rows in ((3, 2, 400), (1, 0, 1200)):
        row_bytes = world * cell + (4096 if world == 3 else 0)
        span = n_rows * row_bytes
        layout = CopyLayout([TensorInfo(0x7E00_0000_0000, page, page)], [[(0, page)]], base,
                            row_bytes, rank, cell, bpc)
        n_chunks = 200
        blocks = np.arange(n_chunks * bpc + 100, 100, -1, dtype=np.int64)
        rows = np.arange(n_rows - 1, n_rows - 1 - n_chunks, -1, dtype=np.int64)
        for store in (True, False):
            dev, host, size = layout.descriptors(blocks, [len(blocks)], [0], rows)
            src, dst = (dev, host) if store else (host, dev)
            merged = merge_runs(src, dst, size, by="dst" if store else "src")
            out = split_at_segments(*(np.ascontiguousarray(a, dtype=np.uint64) for a in merged),
                                    base, span, REGISTER_SEGMENT)
            check_split(merged, out, base, span, REGISTER_SEGMENT)
            rel = np.asarray(merged[1] if store else merged[0], dtype=np.int64) - base
            inner = int(np.sum((rel + merged[2] - 1) // REGISTER_SEGMENT
                               - rel // REGISTER_SEGMENT))  # boundaries inside some run
            assert inner >= (5 if world == 1 else 1)
            assert len(out[2]) == len(merged[2]) + inner  # one cut per boundary crossed


# -- the real CudaCopier over stand-ins for torch and the CUDA runtime --------------------------


class FakeCuda:
    """The CUDA runtime as far as ``CudaCopier`` uses it: registrations are recorded; a copy is
    done (memmove) only if each side lies inside one registration or one device arena, and a
    copy whose pinned side spans two registrations, or leaves them, fails the whole batch with
    an invalid value, as the real ``cudaMemcpyBatchAsync`` did on the H100."""

    SUCCESS, INVALID = 0, 1

    def __init__(self, batch_api: bool) -> None:
        self.registered: list[tuple[int, int]] = []
        self.arenas: list[tuple[int, int]] = []
        self.bad: list[tuple[int, int, int]] = []
        self.calls = self.copies = 0
        self._starts: list[int] | None = None
        rt = types.ModuleType("cuda.bindings.runtime")
        rt.cudaError_t = types.SimpleNamespace(cudaSuccess=self.SUCCESS,
                                               cudaErrorInvalidValue=self.INVALID)
        rt.cudaHostRegisterDefault = 0
        rt.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyDefault=4)
        rt.cudaMemcpySrcAccessOrder = types.SimpleNamespace(cudaMemcpySrcAccessOrderStream=1)
        rt.cudaMemcpyAttributes = types.SimpleNamespace
        rt.cudaHostRegister = self._register
        rt.cudaHostGetDevicePointer = lambda ptr, flags: (self.SUCCESS, ptr)
        rt.cudaHostUnregister = lambda ptr: (self.SUCCESS,)
        rt.cudaMemcpyAsync = lambda d, s, n, kind, stream: (self._batch([d], [s], [n]),)
        if batch_api:
            rt.cudaMemcpyBatchAsync = \
                lambda d, s, n, count, attrs, idx, n_attrs, stream: (
                    self._batch(d[:count], s[:count], n[:count]), 0)
        self.rt = rt

    def _register(self, ptr: int, size: int, flags: int):
        self.registered.append((int(ptr), int(size)))
        return (self.SUCCESS,)

    def _ok(self, p: int, n: int) -> bool:
        if self._starts is None or len(self._starts) != len(self.registered):
            self.registered.sort()
            self._starts = [lo for lo, _ in self.registered]
        # the registrations this range touches (they never overlap): at most one, holding it
        k = bisect.bisect_right(self._starts, p + n - 1)
        touched = [(lo, size) for lo, size in self.registered[max(0, k - 2):k]
                   if p < lo + size and p + n > lo]
        if touched:
            lo, size = touched[-1]
            return len(touched) == 1 and lo <= p and p + n <= lo + size
        return in_arena(self.arenas, p, n)

    def _batch(self, d, s, n) -> int:
        self.calls += 1
        triples = [(int(a), int(b), int(k)) for a, b, k in zip(d, s, n, strict=True)]
        bad = [t for t in triples if not (self._ok(t[0], t[2]) and self._ok(t[1], t[2]))]
        if bad:
            self.bad.extend(bad)
            return self.INVALID
        for dst, src, k in triples:
            ctypes.memmove(dst, src, k)
            self.copies += 1
        return self.SUCCESS

    def ctypes_batch(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray,
                     stream: int) -> int:
        """Stands in for ``_CudartBatch.__call__`` (the path a real engine takes)."""
        for a in (dst, src, size):
            assert a.dtype == np.uint64 and a.flags.c_contiguous
        return self._batch(dst.tolist(), src.tolist(), size.tolist())


class _Stream:
    n = 0

    def __init__(self, device=None) -> None:
        _Stream.n += 1
        self.cuda_stream = 0x1000 + _Stream.n

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, ev) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def _fake_torch() -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.device = lambda d=None: d
    torch.version = types.SimpleNamespace(cuda="12.8")
    torch.cuda = types.SimpleNamespace(
        Stream=_Stream, Event=_Event, current_stream=lambda device=None: _Stream(),
        synchronize=lambda device=None: None, stream=lambda s: contextlib.nullcontext(),
        set_device=lambda device: None)
    return torch


def install_fake_cuda(monkeypatch, fake: FakeCuda, torch: types.ModuleType) -> None:
    """``torch`` and ``fake``'s runtime as ``cuda.bindings.runtime`` in ``sys.modules``, for
    a ``CudaCopier`` made next."""
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = fake.rt
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", fake.rt)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``make(host_base, host_bytes, api, **kw)``: a real ``CudaCopier`` over ``FakeCuda``."""
    from tiering.backends import cuda_copy

    def make(host_base: int, host_bytes: int, api: str, **kw):
        fake = FakeCuda(batch_api=api != "memcpy")
        install_fake_cuda(monkeypatch, fake, _fake_torch())
        copier = cuda_copy.CudaCopier(host_base, host_bytes, copy="dma",
                                      api="bindings" if api == "ctypes" else api, **kw)
        if api == "ctypes":
            copier._ctypes = fake.ctypes_batch
        return copier, fake

    return make


def _check_registrations(fake: FakeCuda, base: int, span: int, segment: int) -> None:
    regs = sorted(fake.registered)
    assert regs[0][0] == base and sum(n for _, n in regs) == span
    for (a, n), (b, _) in zip(regs, regs[1:], strict=False):
        assert a + n == b and n == segment
    assert len(regs) == -(-span // segment)


@pytest.mark.parametrize("api", ["ctypes", "bindings", "memcpy"])
@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("order", ["host", "device"])
def test_the_cuda_copier_never_submits_a_copy_across_registrations(fake_cuda, api, streams,
                                                                    order):
    """Random layouts through the real ``CudaCopier`` (``submit_job`` -> ``submit`` -> ``_copy``,
    small batches, one or three streams a direction, runs merged in host or device order):
    registrations as it makes them, no copy refused, and the bytes exact both ways."""
    hazards = 0
    for seed in range(1000, 1030):
        case = make_case(seed)
        for store in (True, False):
            _, merged, _ = prepare(case, store)
            hazards += int(crosses(merged[1] if store else merged[0], merged[2], case.base,
                                   case.span, case.segment).any())
        copier, fake = fake_cuda(case.base, case.span, api, register_segment=case.segment,
                                 batch_max=int(np.random.default_rng(seed).integers(1, 9)),
                                 streams_per_direction=streams, order=order)
        fake.arenas = case.arenas()
        _check_registrations(fake, case.base, case.span, case.segment)
        for job, direction in enumerate(("store", "load", "expedited"), start=1):
            store = direction == "store"
            want_dev, want_host = fill(case, store, seed * 3 + job)
            copier.submit_job(job, case.layout, case.blocks, case.group_sizes,
                              case.block_indices, case.rows, direction)
            assert not fake.bad, f"refused copies {fake.bad[:3]}: {case.desc}"
            assert np.array_equal(case.host_mem, want_host), f"{direction}: {case.desc}"
            assert np.array_equal(case.dev_mem, want_dev), f"{direction}: {case.desc}"
            (done,) = copier.get_finished()
            assert done.job_id == job
            assert done.size == sum(nb for _, _, nb in case.expect)
        copier.shutdown()
    assert hazards >= 15, hazards  # runs that would have crossed, uncut


def test_the_fake_runtime_does_refuse_a_run_across_registrations(fake_cuda):
    """The stand-in is strict enough to have caught the H100 crash: the merged run handed to the
    batch call uncut is refused."""
    case = make_case(0, kind="bug")
    case.segment = case.layout.row_bytes  # a registration per row: the run spans several
    copier, fake = fake_cuda(case.base, case.span, "ctypes", register_segment=case.segment)
    fake.arenas = case.arenas()
    _, merged, _ = prepare(case, True)
    assert crosses(merged[1], merged[2], case.base, case.span, case.segment).any()
    arrs = [np.ascontiguousarray(a, dtype=np.uint64) for a in merged]
    assert fake.ctypes_batch(arrs[1], arrs[0], arrs[2], 0) == FakeCuda.INVALID
    # and the copier, handed the same run, cuts it
    fake.bad.clear()
    copier.submit(1, *merged, "store")
    assert not fake.bad and fake.copies > len(merged[2])


@pytest.mark.parametrize("api", ["ctypes", "memcpy"])
def test_the_staged_paths_row_copies_stay_inside_registrations(fake_cuda, api):
    """The staged path's plan (whole-row copies and merged partial runs between a device buffer
    and the rows) through the real ``CudaCopier._copy``: gathers and scatters by memmove, the
    row copies through the fake runtime; rows straddling boundaries, bytes exact both ways."""
    hazards = 0
    for seed in range(2000, 2040):
        case = make_case(seed)
        rng = np.random.default_rng(seed)
        copier, fake = fake_cuda(case.base, case.span, api, register_segment=case.segment)
        per_buf = int(rng.integers(1, 6))
        bufs = [np.zeros(per_buf * case.cell + 16, dtype=np.uint8) for _ in range(2)]
        fake.arenas = case.arenas() + [(b.ctypes.data, b.ctypes.data + len(b)) for b in bufs]
        dev, host, size = case.layout.descriptors(case.blocks, case.group_sizes,
                                                  case.block_indices, case.rows)
        slot = case.layout.page_rows(case.group_sizes, case.block_indices)
        for store in (True, False):
            want_dev, want_host = fill(case, store, seed + store)
            plan = plan_staged(case.layout, dev, host, size, slot, per_buf,
                               [b.ctypes.data for b in bufs], int(rng.integers(2)))
            for lo, hi, b, (rs, rd, rn) in plan.pieces:
                hazards += int(crosses(rd, rn, case.base, case.span, case.segment).any())
                buf = [fake.arenas[2 + b]]  # the piece's pages lie in the piece's buffer
                assert all(in_arena(buf, int(plan.staged[i]), int(plan.size[i]))
                           for i in range(lo, hi))
                if store:
                    for i in range(lo, hi):
                        ctypes.memmove(int(plan.staged[i]), int(plan.dev[i]), int(plan.size[i]))
                    copier._copy(1, rs, rd, rn, 0)
                else:
                    copier._copy(2, rd, rs, rn, 0)
                    for i in range(lo, hi):
                        ctypes.memmove(int(plan.dev[i]), int(plan.staged[i]), int(plan.size[i]))
                assert not fake.bad, f"refused row copies {fake.bad[:3]}: {case.desc}"
            assert np.array_equal(case.host_mem, want_host), f"staged store: {case.desc}"
            assert np.array_equal(case.dev_mem, want_dev), f"staged load: {case.desc}"
    assert hazards >= 20, hazards  # row copies that would have crossed, uncut


def test_an_empty_job_submits_nothing(fake_cuda):
    case = make_case(5)
    copier, fake = fake_cuda(case.base, case.span, "ctypes", register_segment=case.segment)
    fake.arenas = case.arenas()
    empty = np.empty(0, dtype=np.int64)
    dev, host, size = case.layout.descriptors(empty, [0] * len(case.group_sizes),
                                              [3] * len(case.group_sizes), empty)
    assert len(dev) == len(host) == len(size) == 0
    assert all(len(a) == 0 for a in split_at_segments(dev, host, size, case.base, case.span,
                                                      case.segment))
    copier.submit_job(1, case.layout, empty, [0] * len(case.group_sizes),
                      [3] * len(case.group_sizes), empty, "store")
    (done,) = copier.get_finished()
    assert done.size == 0 and fake.copies == 0 and not fake.bad


def test_a_jobs_rows_must_match_its_blocks_and_empty_groups_take_none():
    """A zero-length group takes no row whatever its first logical block; a job naming a row
    too few or too many is refused before anything is copied."""
    pages = [16, 32, 48]
    refs = [[(0, 16)], [(1, 32)], [(2, 48)]]
    cell = sum(pages) * 4
    lay = CopyLayout([TensorInfo(1 << 40, p, p) for p in pages], refs, 1 << 30, cell, 0, cell,
                     4)
    blocks = np.arange(8, dtype=np.int64)
    gs, bi = [5, 0, 3], [2, 7, 0]  # group 0 from position 2: 2 rows; group 1: none; 2: 1
    dev, host, size = lay.descriptors(blocks, gs, bi, np.array([9, 4, 6]))
    assert len(size) == 8 and lay.page_rows(gs, bi).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert sorted(((host - (1 << 30)) // cell).tolist()) == [4, 4, 4, 6, 6, 6, 9, 9]
    for rows in ([9, 4], [9, 4, 6, 1]):
        with pytest.raises(ValueError):
            lay.descriptors(blocks, gs, bi, np.array(rows))


@pytest.mark.parametrize("waves", [True, False])
@pytest.mark.parametrize("direct", [True, False])
def test_a_fed_load_is_enqueued_by_the_caller_when_direct(fake_cuda, direct, waves):
    """With a feeder (``load_queue_bytes``) and ``load_direct``, a load that finds room is
    enqueued on the submitting thread before ``submit`` returns; without it, by the feeder
    thread. Either way, in waves or not, the bytes land and the job is reported finished
    once."""
    host = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
    dev = np.zeros(1 << 16, dtype=np.uint8)
    copier, fake = fake_cuda(host.ctypes.data, host.nbytes, "bindings",
                             load_queue_bytes=1 << 20, load_direct=direct,
                             load_waves=waves)
    fake.arenas.append((dev.ctypes.data, dev.ctypes.data + dev.nbytes))
    threads: list[str] = []
    batch = fake.rt.cudaMemcpyBatchAsync
    fake.rt.cudaMemcpyBatchAsync = lambda *a: (threads.append(threading.current_thread().name),
                                               batch(*a))[1]
    try:
        copier.submit(7, np.array([host.ctypes.data + 512], dtype=np.uint64),
                      np.array([dev.ctypes.data], dtype=np.uint64),
                      np.array([4096], dtype=np.uint64), "load")
        if direct:
            assert threads == [threading.current_thread().name]
        done: list = []
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            done = copier.get_finished()
            time.sleep(0.001)
        assert [(f.job_id, f.ok) for f in done] == [(7, True)]
        assert threads == [threading.current_thread().name if direct else "tier-feed-load"]
        assert bytes(dev[:4096]) == bytes(host[512:4608]) and copier.get_finished() == []
    finally:
        copier.shutdown()


@pytest.mark.parametrize("direct", [True, False])
def test_fed_loads_on_two_wave_streams_take_the_load_stream_and_a_second_in_turn(fake_cuda,
                                                                                  direct):
    """``load_wave_streams`` 2: the feeder's waves take the load stream and a stream of their
    own in turn (here every load is done as soon as enqueued, so each begins a wave); the bytes
    land and each load is reported finished once. Two wave streams without ``load_waves``, or
    none, are refused."""
    host = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
    dev = np.zeros(1 << 16, dtype=np.uint8)
    with pytest.raises(ValueError, match="load_wave_streams"):
        fake_cuda(host.ctypes.data, host.nbytes, "bindings", load_queue_bytes=1 << 20,
                  load_waves=False, load_wave_streams=2)
    with pytest.raises(ValueError, match="load_wave_streams"):
        fake_cuda(host.ctypes.data, host.nbytes, "bindings", load_queue_bytes=1 << 20,
                  load_waves=True, load_wave_streams=0)
    copier, fake = fake_cuda(host.ctypes.data, host.nbytes, "bindings",
                             load_queue_bytes=1 << 20, load_direct=direct, load_waves=True,
                             load_wave_streams=2)
    fake.arenas.append((dev.ctypes.data, dev.ctypes.data + dev.nbytes))
    handles: list[int] = []
    batch = fake.rt.cudaMemcpyBatchAsync
    fake.rt.cudaMemcpyBatchAsync = lambda *a: (handles.append(a[-1]), batch(*a))[1]
    load, second = copier.streams["load"], copier._load_wave_streams[1]
    others = {s.cuda_stream for s in copier.streams.values()} - {load.cuda_stream}
    assert second.cuda_stream not in others
    try:
        for k in range(4):
            copier.submit(10 + k, np.array([host.ctypes.data + 4096 * k], dtype=np.uint64),
                          np.array([dev.ctypes.data + 4096 * k], dtype=np.uint64),
                          np.array([4096], dtype=np.uint64), "load")
            copier._feeder.wait_fed({10 + k})
        done: list = []
        deadline = time.monotonic() + 5
        while len(done) < 4 and time.monotonic() < deadline:
            done += copier.get_finished()
            time.sleep(0.001)
        assert sorted((f.job_id, f.ok) for f in done) == [(10 + k, True) for k in range(4)]
        assert handles == [load.cuda_stream, second.cuda_stream] * 2
        assert bytes(dev[:4 * 4096]) == bytes(host[:4 * 4096]) and copier.get_finished() == []
    finally:
        copier.shutdown()


def test_each_mark_carries_the_allocators_running_counts(fake_cuda, monkeypatch):
    """Each mark row carries PyTorch's running counts of its allocators' CUDA calls as they were
    when the mark's event was recorded (the step trace names the calls made between two marks);
    a PyTorch with device statistics but none for the host carries the device's alone."""
    from tiering import step_trace

    rows: list[dict] = []
    monkeypatch.setattr(step_trace.TRACE, "on", True)
    monkeypatch.setattr(step_trace.TRACE, "add", lambda kind, **f: rows.append({"k": kind, **f}))
    copier, _ = fake_cuda(1 << 20, 1 << 20, "memcpy")
    device = {"num_device_alloc": 3, "num_device_free": 1, "num_sync_all_streams": 0,
              "num_alloc_retries": 0, "allocated_bytes": {"all": {"current": 1}}}
    host = {"num_host_alloc": 7, "num_host_free": 0}
    cuda = copier.torch.cuda
    monkeypatch.setattr(cuda, "memory_stats_as_nested_dict", lambda d=None: dict(device),
                        raising=False)
    monkeypatch.setattr(cuda, "memory", types.SimpleNamespace(
        host_memory_stats_as_nested_dict=lambda: dict(host)), raising=False)
    try:
        copier.get_finished()
        device["num_device_alloc"], host["num_host_alloc"] = 5, 8
        copier.get_finished()
        monkeypatch.delattr(cuda, "memory")
        copier.get_finished()
        copier.get_finished()
    finally:
        copier.shutdown()
    marks = [{k: v for k, v in r.items() if k not in ("k", "t", "g")} for r in rows]
    assert marks == [
        {"malloc": 3, "free": 1, "sync_all": 0, "retries": 0, "host_alloc": 7},
        {"malloc": 5, "free": 1, "sync_all": 0, "retries": 0, "host_alloc": 8},
        {"malloc": 5, "free": 1, "sync_all": 0, "retries": 0}]


def test_a_traced_copier_marks_each_step_and_a_mark_that_fails_never_reaches_vllm(
        fake_cuda, monkeypatch, caplog):
    """Traced, each ``get_finished`` (once a vLLM step) records an event on the compute stream
    and reports the one before as a ``mark`` row; if marking fails (any CUDA error), the worker
    still gets its finished jobs, marks stop, and one line says so: a trace never raises into
    vLLM's worker."""
    import logging

    from tiering import step_trace

    rows: list[dict] = []
    monkeypatch.setattr(step_trace.TRACE, "on", True)
    monkeypatch.setattr(step_trace.TRACE, "add", lambda kind, **f: rows.append({"k": kind, **f}))
    copier, _ = fake_cuda(1 << 20, 1 << 20, "memcpy")
    try:
        for _ in range(3):
            assert copier.get_finished() == []
        assert [r["k"] for r in rows] == ["mark", "mark"]
        assert all(r["g"] >= 0 and r["t"] > 0 for r in rows)

        class Broken(_Event):
            def record(self, stream=None) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        # no allocator statistics in this stand-in: marks carry no counts
        assert not set(rows[0]) & {"malloc", "free", "sync_all", "retries", "host_alloc"}

        monkeypatch.setattr(copier.torch.cuda, "Event", Broken)
        caplog.set_level(logging.ERROR, logger="tiering.backends.cuda_copy")
        for _ in range(3):
            assert copier.get_finished() == []
        assert len([r for r in caplog.records if "marks are off" in r.getMessage()]) == 1
        assert not copier._marks
    finally:
        copier.shutdown()
