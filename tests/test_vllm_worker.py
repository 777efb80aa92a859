"""The worker's copy descriptors on host tensors: random data, odd block ids, partial chunks."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

import tiering.backends.staging as staging  # noqa: E402
from tiering.backends.block_copy import MemcpyCopier, merge_runs  # noqa: E402
from tiering.backends.staging import StagingRegion  # noqa: E402
from tiering.vllm.compat import GPULoadStoreSpec  # noqa: E402
from tiering.vllm.worker import RowsSpec, TieredWorker, make_layout  # noqa: E402


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def make(num_blocks=32, pages=(512, 1024), bpc=1, groups=1, rows=16, rank=0, world=1):
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8), p)
               for p in pages]
    refs = [[CanonicalKVCacheRef(t, p) for t, p in enumerate(pages)] for _ in range(groups)]
    kv = CanonicalKVCaches(tensors, refs)
    cell = sum(pages) * bpc
    row_bytes = -(-cell * world // 4096) * 4096
    region = StagingRegion(f"w{bpc}{groups}{rank}", rows, row_bytes)
    layout = make_layout(kv, region, rank, cell, bpc)
    return kv, region, TieredWorker(layout, MemcpyCopier(), region)


def test_round_trip_random_blocks_one_block_per_chunk():
    kv, region, w = make()
    src_blocks = [7, 3, 19, 4]
    rows = [5, 0, 9, 2]
    snapshot = [t.tensor[src_blocks].clone() for t in kv.tensors]
    assert w.submit_store(1, GPULoadStoreSpec(src_blocks, [4], [0]), RowsSpec(rows))
    (res,) = w.get_finished()
    assert res.success and res.transfer_size == 4 * (512 + 1024)
    # row layout: tensor 0's page first, then tensor 1's
    r5 = torch.from_numpy(region.rows[5].copy()).view(torch.int8)
    assert torch.equal(r5[:512], kv.tensors[0].tensor[7])
    assert torch.equal(r5[512:1536], kv.tensors[1].tensor[7])
    dst_blocks = [30, 11, 12, 1]
    assert w.submit_load(2, RowsSpec(rows), GPULoadStoreSpec(dst_blocks, [4], [0]))
    w.get_finished()
    for t, snap in zip(kv.tensors, snapshot, strict=True):
        assert torch.equal(t.tensor[dst_blocks], snap)
    w.shutdown()


def test_partial_first_chunk_with_blocks_per_chunk_4():
    kv, region, w = make(bpc=4)
    # logical blocks 6..13 of a request: chunk 1 from its 3rd block (6 % 4 == 2), chunks 2, 3
    blocks = [20, 21, 22, 23, 24, 25, 26, 27]
    rows = [3, 8, 1]
    snap = [t.tensor[blocks].clone() for t in kv.tensors]
    w.submit_store(1, GPULoadStoreSpec(blocks, [8], [6]), RowsSpec(rows))
    w.get_finished()
    r3 = torch.from_numpy(region.rows[3].copy()).view(torch.int8)
    # block 20 is logical block 6 -> position 2 of row 3's chunk, stored last position first:
    # tensor 0's slot 1 (4 - 1 - 2), at offset 1*512; block 21 (position 3) in tensor 1's slot 0
    assert torch.equal(r3[1 * 512:2 * 512], kv.tensors[0].tensor[20])
    assert torch.equal(r3[4 * 512:4 * 512 + 1024], kv.tensors[1].tensor[21])
    assert not r3[3 * 512:4 * 512].any()  # position 0 of the chunk is not in the job
    for t in kv.tensors:
        t.tensor.zero_()
    w.submit_load(2, RowsSpec(rows), GPULoadStoreSpec(blocks, [8], [6]))
    w.get_finished()
    for t, s in zip(kv.tensors, snap, strict=True):
        assert torch.equal(t.tensor[blocks], s)
    w.shutdown()


def test_two_groups_one_empty_and_second_rank_cell():
    kv, region, w = make(groups=2, rank=1, world=2, rows=4)
    snap = [t.tensor[[9, 2]].clone() for t in kv.tensors]
    w.submit_store(1, GPULoadStoreSpec([9, 2], [0, 2], [0, 0]), RowsSpec([2, 3]))
    w.get_finished()
    cell = 512 + 1024
    r2 = torch.from_numpy(region.rows[2].copy()).view(torch.int8)
    assert not r2[:cell].any()  # rank 0's cell untouched
    assert torch.equal(r2[cell:cell + 512], kv.tensors[0].tensor[9])
    for t in kv.tensors:
        t.tensor.zero_()
    w.submit_load(2, RowsSpec([2, 3]), GPULoadStoreSpec([9, 2], [0, 2], [0, 0]))
    w.get_finished()
    for t, s in zip(kv.tensors, snap, strict=True):
        assert torch.equal(t.tensor[[9, 2]], s)
    w.shutdown()


def test_row_count_mismatch_is_an_error():
    kv, region, w = make()
    with pytest.raises(ValueError, match="rows"):
        w.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]), RowsSpec([0]))
    w.shutdown()


def test_merge_runs_joins_only_continuations():
    src = np.array([0, 100, 200, 1000], dtype=np.int64)
    dst = np.array([5000, 5100, 9000, 9100], dtype=np.int64)
    size = np.array([100, 100, 100, 100], dtype=np.int64)
    s, d, n = merge_runs(src, dst, size)
    assert s.tolist() == [0, 200, 1000] and d.tolist() == [5000, 9000, 9100]
    assert n.tolist() == [200, 100, 100]


def test_descriptors_of_groups_with_their_own_tensors_and_partial_chunks():
    """Each group copies only its own tensors' pages (a ref may copy less than the padded
    page), tensor by tensor, to the place each page has in its row: checked against the
    layout's definition, entry by entry, for a partial first chunk and a second rank's cell."""
    from tiering.backends.block_copy import CopyLayout, TensorInfo

    tensors = [TensorInfo(1 << 40, 8192, 4096), TensorInfo(2 << 40, 4096, 2048),
               TensorInfo(3 << 40, 16384, 8192)]
    refs = [[(0, 4096), (2, 8000)], [(1, 2048)]]
    bpc, rank = 2, 1
    cell = (4096 + 2048 + 8192) * bpc
    lay = CopyLayout(tensors, refs, 1 << 30, 2 * cell, rank, cell, bpc)
    blocks = np.array([5, 9, 2, 11, 7], dtype=np.int64)  # group 0: 5, 9, 2; group 1: 11, 7
    rows = np.array([4, 0, 3], dtype=np.int64)  # group 0 from logical block 1: rows 4, 0; g1: 3
    dev, host, size = lay.descriptors(blocks, [3, 2], [1, 0], rows)
    expect = []
    tensor_off = [0, 4096 * bpc, (4096 + 2048) * bpc]
    for g, (blks, first, grp_rows) in enumerate((([5, 9, 2], 1, [4, 0]), ([11, 7], 0, [3]))):
        for t_idx, nbytes in refs[g]:
            t = tensors[t_idx]
            for i, b in enumerate(blks):
                pos = first % bpc + i
                row = grp_rows[pos // bpc]
                expect.append((t.base + b * t.stride,
                               (1 << 30) + rank * cell + row * 2 * cell + tensor_off[t_idx]
                               + (bpc - 1 - pos % bpc) * t.page, nbytes))
    assert list(zip(dev.tolist(), host.tolist(), size.tolist(), strict=True)) == expect
    slots = lay.page_rows([3, 2], [1, 0])
    assert slots.tolist() == [0, 1, 1, 0, 1, 1, 2, 2]  # the job's row index of each entry


def _merged_count(layout, blocks, rows):
    dev, host, size = layout.descriptors(np.asarray(blocks, dtype=np.int64), [len(blocks)], [0],
                                         np.asarray(rows, dtype=np.int64))
    return len(merge_runs(host, dev, size)[0])


def test_a_chunk_of_descending_blocks_copies_as_one_run_per_tensor():
    """vLLM hands recycled GPU blocks out in descending order (pinned by
    tests/test_vllm_scheduler.py): the cell stores a chunk's blocks last position first, so
    such a chunk's pages merge to one copy per tensor (2 chunks x 2 tensors = 4 copies, not 16);
    ascending blocks copy page by page. Both round-trip their bytes exactly."""
    for blocks, copies in (([23, 22, 21, 20, 11, 10, 9, 8], 4), ([20, 21, 22, 23, 8, 9, 10, 11], 16)):
        kv, region, w = make(bpc=4)
        rows = [6, 2]
        assert _merged_count(w.layout, blocks, rows) == copies, blocks
        snap = [t.tensor[blocks].clone() for t in kv.tensors]
        w.submit_store(1, GPULoadStoreSpec(blocks, [8], [0]), RowsSpec(rows))
        w.get_finished()
        for t in kv.tensors:
            t.tensor.zero_()
        back = [30, 29, 28, 27, 3, 2, 1, 0]
        w.submit_load(2, RowsSpec(rows), GPULoadStoreSpec(back, [8], [0]))
        w.get_finished()
        for t, s in zip(kv.tensors, snap, strict=True):
            assert torch.equal(t.tensor[back], s)
        w.shutdown()


def test_a_block_outermost_layout_copies_a_descending_chunk_in_one_descriptor():
    """vLLM's block-outermost layouts (``VLLM_KV_CACHE_LAYOUT=BLHNC``, ``gpu-bench --kv-layout``)
    keep every layer of a block in one run of memory, and vLLM hands the worker that as one
    packed tensor whose page is the whole block. A chunk in recycled (descending) blocks is
    then a single copy each way: 2 chunks, 2 descriptors (against 2 per tensor and chunk in
    the per-layer layout). Bytes round-trip exactly."""
    layers, page, num_blocks = 6, 1024, 32
    storage = torch.randint(-128, 127, (num_blocks * layers * page,), dtype=torch.int8)
    # what vLLM's offloading worker builds for a packed layout: (blocks, block stride)
    packed = storage.as_strided((num_blocks, layers * page), (layers * page, 1))
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(packed, layers * page)],
                           [[CanonicalKVCacheRef(0, layers * page)]])
    bpc, cell = 4, layers * page * 4
    region = StagingRegion("packed", 8, -(-cell // 4096) * 4096)
    w = TieredWorker(make_layout(kv, region, 0, cell, bpc), MemcpyCopier(), region)
    blocks, rows = [23, 22, 21, 20, 11, 10, 9, 8], [6, 2]
    assert _merged_count(w.layout, blocks, rows) == 2
    assert _merged_count(w.layout, sorted(blocks), rows) == 8
    snap = packed[blocks].clone()
    w.submit_store(1, GPULoadStoreSpec(blocks, [8], [0]), RowsSpec(rows))
    (res,) = w.get_finished()
    assert res.success and res.transfer_size == 8 * layers * page
    storage.zero_()
    back = [31, 30, 29, 28, 3, 2, 1, 0]
    w.submit_load(2, RowsSpec(rows), GPULoadStoreSpec(back, [8], [0]))
    w.get_finished()
    assert torch.equal(packed[back], snap)
    assert int(packed[4:28].abs().sum()) == 0  # no other block written
    w.shutdown()


def _block_order(rng: np.random.Generator, pool: list[int], n: int, mode: str) -> list[int]:
    """``n`` distinct GPU block ids from ``pool`` in one of the orders vLLM hands them out in:
    a fresh cache (ascending), recycled blocks (descending), or anything (shuffled, and runs of
    both)."""
    start = int(rng.integers(0, len(pool) - n + 1))
    ids = pool[start:start + n]
    if mode == "descending":
        return ids[::-1]
    if mode == "shuffled":
        return [int(b) for b in rng.permutation(ids)]
    if mode == "mixed":  # runs of either direction, in shuffled run order
        runs, i = [], 0
        while i < n:
            k = int(rng.integers(1, 6))
            run = ids[i:i + k]
            runs.append(run[::-1] if rng.random() < 0.5 else run)
            i += k
        return [b for r in (runs[j] for j in rng.permutation(len(runs))) for b in r]
    return ids


def _random_kv(rng: np.random.Generator, num_blocks: int, bpc: int, rank: int, world: int,
               name: str):
    """KV tensors of padded pages of different sizes; 1 to 3 groups, each with refs to its
    own tensors or to shared ones, a ref copying its page in full or less (unpadded)."""
    n_tensors = int(rng.integers(1, 5))
    padded = [int(rng.choice([256, 512, 768, 1024, 2048])) for _ in range(n_tensors)]
    tensors = [CanonicalKVCacheTensor(
        torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8), p) for p in padded]
    groups = []
    for _ in range(int(rng.integers(1, 4))):
        which = sorted(rng.choice(n_tensors, int(rng.integers(1, n_tensors + 1)), replace=False))
        groups.append([CanonicalKVCacheRef(int(t), int(rng.choice([padded[t], padded[t] - 128])))
                       for t in which])
    kv = CanonicalKVCaches(tensors, groups)
    cell = sum(padded) * bpc
    row_bytes = -(-cell * world // 4096) * 4096
    region = StagingRegion(name, 40, row_bytes)
    layout = make_layout(kv, region, rank, cell, bpc)
    return kv, region, TieredWorker(layout, MemcpyCopier(), region), padded


@pytest.mark.parametrize("seed", range(24))
def test_random_block_orders_round_trip_exactly_and_touch_nothing_else(seed):
    """Whatever order a job's GPU blocks come in (ascending, descending, shuffled, runs of
    both), with partial first chunks, several groups, padded pages and a second rank's cell:
    a store puts each page where the cell layout says (tensor by tensor, the chunk's blocks
    last position first), leaves every other byte of the region as it was, and a load into
    other blocks in another order brings back exactly the stored bytes, touching no other
    byte of the GPU tensors."""
    rng = np.random.default_rng(seed)
    bpc = int(rng.choice([1, 2, 4, 8]))
    world = int(rng.choice([1, 2]))
    rank = int(rng.integers(0, world))
    num_blocks = 96
    kv, region, w, padded = _random_kv(rng, num_blocks, bpc, rank, world, f"rnd{seed}")
    cell = sum(padded) * bpc
    tensor_off = np.cumsum([0] + [p * bpc for p in padded]).tolist()
    region.rows[:] = rng.integers(0, 256, region.rows.shape, dtype=np.uint8)
    modes = ("ascending", "descending", "shuffled", "mixed")
    # the job: per group, a first logical block (partial first chunk or not) and its blocks;
    # every group draws its blocks from its own part of the GPU cache (distinct ids)
    pools = np.array_split(np.arange(num_blocks // 2), len(kv.group_data_refs))
    src, dst, sizes, firsts, rows_of_group = [], [], [], [], []
    free_rows = [int(r) for r in rng.permutation(region.rows.shape[0])]
    for pool in pools:
        n = int(rng.integers(0, min(len(pool), 3 * bpc) + 1))
        first = int(rng.integers(0, 3 * bpc))
        src.append(_block_order(rng, pool.tolist(), n, str(rng.choice(modes))))
        back = (pool + num_blocks // 2).tolist()  # load into the other half of the cache
        dst.append(_block_order(rng, back, n, str(rng.choice(modes))))
        sizes.append(n)
        firsts.append(first)
        n_rows = -(-(n + first % bpc) // bpc) if n else 0
        rows_of_group.append([free_rows.pop() for _ in range(n_rows)])
    rows = [r for rs in rows_of_group for r in rs]
    before_rows = region.rows.copy()
    before_gpu = [t.tensor.clone() for t in kv.tensors]
    flat_src = [b for bs in src for b in bs]
    w.submit_store(1, GPULoadStoreSpec(flat_src, sizes, firsts), RowsSpec(rows))
    (res,) = w.get_finished()
    expect_bytes = sum(n * sum(r.page_size_bytes for r in kv.group_data_refs[g])
                       for g, n in enumerate(sizes))
    assert res.success and res.transfer_size == expect_bytes
    # the oracle: which bytes of the region the job owns, and what they hold
    expected = before_rows.copy()
    for g, refs in enumerate(kv.group_data_refs):
        skip = firsts[g] % bpc
        for i, block in enumerate(src[g]):
            pos = i + skip
            row = rows_of_group[g][pos // bpc]
            slot = bpc - 1 - pos % bpc
            for ref in refs:
                t = ref.tensor_idx
                at = rank * cell + tensor_off[t] + slot * padded[t]
                page = kv.tensors[t].tensor[block].numpy().view(np.uint8)
                expected[row, at:at + ref.page_size_bytes] = page[:ref.page_size_bytes]
    assert np.array_equal(region.rows, expected)
    for t, b in zip(kv.tensors, before_gpu, strict=True):
        assert torch.equal(t.tensor, b)  # a store reads the GPU blocks only
    # load into other blocks, in another order
    flat_dst = [b for bs in dst for b in bs]
    w.submit_load(2, RowsSpec(rows), GPULoadStoreSpec(flat_dst, sizes, firsts))
    w.get_finished()
    assert np.array_equal(region.rows, expected)  # a load reads the rows only
    for g, refs in enumerate(kv.group_data_refs):
        for s_block, d_block in zip(src[g], dst[g], strict=True):
            for ref in refs:
                t, p = ref.tensor_idx, ref.page_size_bytes
                before_gpu[t][d_block, :p] = before_gpu[t][s_block, :p]
    for t, b in zip(kv.tensors, before_gpu, strict=True):
        assert torch.equal(t.tensor, b)
    w.shutdown()


def _crosses(ptr: np.ndarray, size: np.ndarray, base: int, span: int, segment: int) -> np.ndarray:
    rel = ptr - base
    inside = (rel >= 0) & (rel < span)
    return inside & (rel // segment != (rel + size - 1) // segment)


def test_a_packed_layouts_merged_run_is_cut_where_the_rows_registration_ends():
    """The GPU run of 2026-12-05c (H100): in the packed layout (one tensor of whole blocks:
    vLLM's BLHNC, what our connector asks for) a store of chunks in descending blocks kept in
    descending rows merged into one run across rows, over the 1 GiB boundary between two CUDA
    registrations of the staging rows, and cudaMemcpyBatchAsync failed (invalid value). The
    runs the CUDA copier submits are cut there, and copy the same bytes."""
    from tiering.backends.block_copy import CopyLayout, TensorInfo, split_at_segments

    page, bpc = 4096, 4
    row = page * bpc  # one rank, the whole row is the cell: rows sit back to back
    n_rows, n_blocks = 8, 64
    segment = 3 * row  # a registration boundary inside the run (rows 3 and 6 start one)
    host = np.zeros(n_rows * row, dtype=np.uint8)
    gpu = np.random.default_rng(1).integers(0, 255, n_blocks * page, dtype=np.uint8)
    base = host.ctypes.data
    lay = CopyLayout([TensorInfo(gpu.ctypes.data, page, page)], [[(0, page)]], base, row, 0,
                     row, bpc)
    blocks = np.arange(40, 16, -1, dtype=np.int64)  # 24 blocks, descending (recycled)
    rows = np.arange(5, -1, -1, dtype=np.int64)  # 6 chunks in descending rows
    dev, hst, size = lay.descriptors(blocks, [len(blocks)], [0], rows)
    s, d, n = merge_runs(dev, hst, size, by="dst")
    assert len(n) == 1 and _crosses(d, n, base, host.nbytes, segment).any()  # the bug's run
    s2, d2, n2 = split_at_segments(s, d, n, base, host.nbytes, segment)
    assert not _crosses(d2, n2, base, host.nbytes, segment).any()
    assert len(n2) == 2 and int(n2.sum()) == int(n.sum())
    for a, b, k in zip(s2.tolist(), d2.tolist(), n2.tolist(), strict=True):
        ctypes.memmove(b, a, k)
    for i, b in enumerate(blocks.tolist()):  # every block's page where the layout puts it
        r, pos = rows[i // bpc], i % bpc
        at = r * row + (bpc - 1 - pos) * page
        assert bytes(host[at:at + page]) == bytes(gpu[b * page:(b + 1) * page])


def test_cutting_at_segments_keeps_every_byte_and_cuts_only_the_registered_side():
    from tiering.backends.block_copy import split_at_segments

    rng = np.random.default_rng(7)
    base, span, segment = 1 << 20, 1 << 22, 1 << 16
    for _ in range(200):
        k = int(rng.integers(1, 20))
        size = rng.integers(1, 5 * segment, k)
        host = base + rng.integers(0, span - 5 * segment, k)
        dev = (1 << 40) + rng.integers(0, 1 << 30, k)  # the device side: never cut on its own
        for src, dst in ((host, dev), (dev, host)):
            s, d, n = split_at_segments(src, dst, size, base, span, segment)
            h = s if src is host else d
            assert not _crosses(h, n, base, span, segment).any()
            assert (n > 0).all() and int(n.sum()) == int(size.sum())
            # the pieces of each copy follow each other on both sides, in order
            starts = np.concatenate(([True], (s[1:] != s[:-1] + n[:-1])
                                     | (d[1:] != d[:-1] + n[:-1])))
            assert s[starts].tolist() == list(src) and d[starts].tolist() == list(dst)
    # a device pointer below the registered range is left whole
    s, d, n = split_at_segments(np.array([0]), np.array([base]), np.array([segment]), base,
                                span, segment)
    assert n.tolist() == [segment]


class _FailingCopier(MemcpyCopier):
    """The host copier, except that the jobs named in ``fail`` cannot be enqueued."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail = fail

    def submit_job(self, job_id, *args, **kwargs):
        if job_id in self.fail:
            from tiering.backends.block_copy import CopyFailed

            raise CopyFailed(f"job {job_id}: injected")
        return super().submit_job(job_id, *args, **kwargs)


def test_a_load_that_cannot_be_copied_becomes_vllms_load_errors_not_a_crash():
    """Under our connector (load errors reported): the failed load is reported finished (vLLM
    asserts success), its GPU blocks are handed over once as load errors, the other jobs copy
    their bytes exactly, and waiting for the failed job returns."""
    kv, region, w = make()
    w = TieredWorker(w.layout, _FailingCopier({2}), region, load_errors_reported=True)
    src = kv.tensors[0].tensor
    assert w.submit_store(1, GPULoadStoreSpec([7, 3], [2], [0]), RowsSpec([0, 1]))
    before = src[[20, 21]].clone()
    assert w.submit_load(2, RowsSpec([0, 1]), GPULoadStoreSpec([20, 21], [2], [0]))
    assert w.submit_load(3, RowsSpec([0, 1]), GPULoadStoreSpec([22, 23], [2], [0]))
    w.wait({2, 3})
    done = w.get_finished()
    assert sorted(r.job_id for r in done) == [1, 2, 3] and all(r.success for r in done)
    assert w.take_load_error_blocks() == {20, 21}
    assert w.take_load_error_blocks() == set()  # handed over once
    assert w.failed_loads == 1
    assert torch.equal(src[[20, 21]], before)  # the failed load wrote nothing
    assert torch.equal(src[[22, 23]], src[[7, 3]])  # the next load copied exactly
    assert w.get_finished() == []  # each job reported once
    w.shutdown()


def test_a_store_that_cannot_be_copied_is_reported_done_with_its_rows_marked_failed():
    """A failed store is reported finished (vLLM asserts success) with its rows marked failed in
    the staging region, for the scheduler side to drop; the next store copies exactly. A failed
    load where no connector asks for load errors (vLLM's own) still raises."""
    from tiering.backends.block_copy import CopyFailed

    kv, region, w = make()
    w = TieredWorker(w.layout, _FailingCopier({1}), region, load_errors_reported=True)
    assert w.submit_store(1, GPULoadStoreSpec([7, 3], [2], [0]), RowsSpec([4, 5]))
    assert w.submit_store(2, GPULoadStoreSpec([8], [1], [0]), RowsSpec([6]))
    w.wait({1, 2})
    done = w.get_finished()
    assert sorted(r.job_id for r in done) == [1, 2] and all(r.success for r in done)
    assert w.failed_stores == 1 and w.take_load_error_blocks() == set()
    assert [region.take_store_failed(r) for r in (4, 5, 6)] == [True, True, False]
    assert [region.take_store_failed(r) for r in (4, 5)] == [False, False]  # taken once
    plain = TieredWorker(w.layout, _FailingCopier({3}), region)  # vLLM's own connector
    with pytest.raises(CopyFailed):
        plain.submit_load(3, RowsSpec([0]), GPULoadStoreSpec([20], [1], [0]))
    w.shutdown()


def test_with_the_step_trace_on_each_submission_records_its_wall_and_cpu_time(monkeypatch):
    """tiering/step_trace.py: a submission's row says how long it took and how much of that the
    worker thread ran (a wall time far above it means the thread waited, e.g. for the GIL)."""
    from tiering import step_trace

    monkeypatch.setattr(step_trace.TRACE, "on", True)
    monkeypatch.setattr(step_trace.TRACE, "path", None)  # flush writes nothing
    monkeypatch.setattr(step_trace.TRACE, "_rows", [])
    monkeypatch.setattr(step_trace.TRACE, "_writer", object())  # no writer thread
    kv, region, w = make()
    assert w.submit_store(1, GPULoadStoreSpec([7, 3], [2], [0]), RowsSpec([5, 0]))
    assert w.submit_load(2, RowsSpec([5, 0]), GPULoadStoreSpec([30, 11], [2], [0]))
    rows = [r for r in step_trace.TRACE._rows if r["k"] == "submit"]
    assert [(r["job"], r["dir"], r["blocks"]) for r in rows] == [(1, "store", 2), (2, "load", 2)]
    assert all(0 <= r["cpu"] <= r["dt"] + 1e-3 for r in rows)
    w.get_finished()
    w.shutdown()
