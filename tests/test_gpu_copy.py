"""The CUDA copier on a real GPU, every path (descriptor DMA, staged kernel, direct kernel,
auto) in every layout: byte-exact rows after a store, byte-exact blocks after a load, stores
ordered after the compute that wrote the blocks, loads complete when reported finished.

GPU only (marker ``gpu``; ``scripts/gpu_tests.sh``); skipped, never passed, elsewhere.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (run scripts/gpu_tests.sh on a GPU machine)",
                allow_module_level=True)

from tiering.backends.block_copy import CopyLayout, TensorInfo  # noqa: E402
from tiering.backends.cuda_copy import CudaCopier  # noqa: E402
from tiering.backends.slab_io import aligned_buffer  # noqa: E402

PATHS = ["dma", "staged", "direct", "auto"]


class Setup:
    """KV tensors on the GPU, a pinned row region, the layout and a copier."""

    def __init__(self, copy, pages, num_blocks=96, bpc=1, rows=48, rank=0, world=1,
                 groups=1, staging_bytes=64 << 20, engine_kw=None):
        self.pages, self.bpc, self.rank = pages, bpc, rank
        self.tensors = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8,
                                      device="cuda") for p in pages]
        self.cell = sum(pages) * bpc
        self.row_bytes = -(-self.cell * world // 4096) * 4096
        self.host = aligned_buffer(rows * self.row_bytes)
        self.region = np.frombuffer(self.host, np.uint8)
        self.region[:] = 0xA5
        base = self.region.ctypes.data
        infos = [TensorInfo(t.data_ptr(), t.stride(0), p) for t, p in zip(self.tensors, pages,
                                                                          strict=True)]
        refs = [[(i, p) for i, p in enumerate(pages)] for _ in range(groups)]
        self.layout = CopyLayout(infos, refs, base, self.row_bytes, rank, self.cell, bpc,
                                 torch_tensors=self.tensors)
        self.copier = CudaCopier(base, len(self.region), copy=copy,
                                     staging_bytes=staging_bytes, **(engine_kw or {}))
        self.job = 0

    def submit(self, blocks, group_sizes, block_indices, rows, direction):
        self.job += 1
        self.copier.submit_job(self.job, self.layout, np.asarray(blocks, dtype=np.int64),
                               group_sizes, block_indices, np.asarray(rows, dtype=np.int64),
                               direction)
        return self.job

    def finish(self, job_ids):
        self.copier.wait(set(job_ids))
        done = {f.job_id for f in self.copier.get_finished()}
        assert set(job_ids) <= done

    def row_cell(self, row):
        start = row * self.row_bytes + self.rank * self.cell
        return self.region[start:start + self.cell]

    def expected_cell(self, blocks_of_chunk, skip=0):
        """The cell a chunk's blocks make: tensor after tensor, and in each the chunk's blocks
        last position first (``CopyLayout``; positions before ``skip`` not part of the job:
        None)."""
        parts: list[np.ndarray | None] = []
        for t in self.tensors:
            for k in reversed(range(self.bpc)):
                if k < skip:
                    parts.append(None)
                else:
                    parts.append(t[blocks_of_chunk[k - skip]].cpu().numpy().view(np.uint8))
        return parts

    def check_cell(self, row, blocks_of_chunk, skip=0):
        cell = self.row_cell(row)
        off = 0
        parts = self.expected_cell(blocks_of_chunk, skip)
        i = 0
        for p in self.pages:
            for _ in range(self.bpc):
                part = parts[i]
                got = cell[off:off + p]
                if part is None:
                    assert np.all(got == 0xA5), f"row {row}: bytes outside the job were written"
                else:
                    assert np.array_equal(got, part), f"row {row}: page {i} differs"
                off += p
                i += 1

    def close(self):
        self.copier.shutdown()


LAYOUTS = {
    # name: (pages, bpc, rank, world, groups)
    "per-layer": ([16384] * 32, 1, 0, 1, 1),
    "per-layer-odd": ([4096 + 48, 8192, 16], 1, 0, 1, 1),
    "packed": ([1 << 20], 1, 0, 1, 1),
    "chunks-of-4": ([8192] * 6, 4, 0, 1, 1),
    "rank-1-of-2": ([8192] * 4, 2, 1, 2, 1),
    "two-groups": ([4096] * 4, 1, 0, 1, 2),
    "unaligned": ([1000, 3000], 1, 0, 1, 1),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("path", PATHS)
def test_store_then_load_is_byte_exact(path, layout):
    pages, bpc, rank, world, groups = LAYOUTS[layout]
    s = Setup(path, pages, bpc=bpc, rank=rank, world=world, groups=groups)
    try:
        rng = np.random.default_rng(zlib.crc32(f"{path}{layout}".encode()))
        n_rows = 9
        n = n_rows * bpc
        src = rng.choice(40, n * groups, replace=False)
        rows = rng.choice(48, n_rows * groups, replace=False)
        sizes = [n] * groups
        first = [0] * groups
        j = s.submit(src, sizes, first, rows, "store")
        s.finish([j])
        for g in range(groups):
            for c in range(n_rows):
                blk = src[g * n + c * bpc:g * n + (c + 1) * bpc]
                s.check_cell(rows[g * n_rows + c], blk)
        untouched = np.setdiff1d(np.arange(48), rows)
        assert np.all(s.region.reshape(48, -1)[untouched] == 0xA5)
        dst = 48 + rng.choice(48, n * groups, replace=False)
        before = [t[torch.as_tensor(src, device="cuda")].clone() for t in s.tensors]
        j = s.submit(dst, sizes, first, rows, "load")
        s.finish([j])
        for t, b in zip(s.tensors, before, strict=True):
            assert torch.equal(t[torch.as_tensor(dst, device="cuda")], b)
        if layout == "unaligned" or layout == "packed":
            assert s.copier.jobs_by_path["dma"] == 2  # kernels take only small aligned pages
        else:
            expect = "dma" if path == "auto" else path
            assert s.copier.jobs_by_path[expect] == 2, s.copier.jobs_by_path
    finally:
        s.close()


@pytest.mark.parametrize("engine_kw", [{"streams_per_direction": 2},
                                       {"streams_per_direction": 3, "access_order": "any"},
                                       {"access_order": "any"}, {"copy_flags": 1},
                                       {"load_queue_bytes": 1 << 20},
                                       {"load_queue_bytes": 1 << 20, "load_direct": True},
                                       {"load_queue_bytes": 1 << 20, "load_direct": True,
                                        "load_waves": True, "load_wave_streams": 2}],
                         ids=["2-streams", "3-streams-any-order", "any-order", "flag-1",
                              "load-queue-1MiB", "load-queue-1MiB-direct",
                              "load-waves-2-streams"])
@pytest.mark.parametrize("layout", ["per-layer", "packed", "chunks-of-4"])
def test_descriptor_options_move_the_same_bytes(layout, engine_kw):
    """A job split over several streams per direction, or read in any order, stores and
    loads every byte exactly, and is finished only when all its parts are."""
    pages, bpc, rank, world, groups = LAYOUTS[layout]
    s = Setup("dma", pages, bpc=bpc, rank=rank, world=world, groups=groups, engine_kw=engine_kw)
    try:
        rng = np.random.default_rng(7)
        n_rows = min(11, 40 // bpc)  # distinct source blocks among the first 40
        src = rng.choice(40, n_rows * bpc, replace=False)
        rows = rng.choice(48, n_rows, replace=False)
        j = s.submit(src, [n_rows * bpc], [0], rows, "store")
        s.finish([j])
        for c in range(n_rows):
            s.check_cell(rows[c], src[c * bpc:(c + 1) * bpc])
        dst = 48 + rng.choice(48, n_rows * bpc, replace=False)
        before = [t[torch.as_tensor(src, device="cuda")].clone() for t in s.tensors]
        j = s.submit(dst, [n_rows * bpc], [0], rows, "load")
        s.finish([j])
        for t, b in zip(s.tensors, before, strict=True):
            assert torch.equal(t[torch.as_tensor(dst, device="cuda")], b)
    finally:
        s.close()


@pytest.mark.parametrize("path", PATHS)
def test_partial_first_chunk_leaves_the_rest_of_the_row(path):
    s = Setup(path, [8192] * 4, bpc=4)
    try:
        blocks = [5, 9, 13, 2, 7]  # skip 3 in the first chunk, then one whole chunk
        j = s.submit(blocks, [5], [3], [4, 11], "store")
        s.finish([j])
        s.check_cell(4, [5], skip=3)
        s.check_cell(11, [9, 13, 2, 7])
    finally:
        s.close()


@pytest.mark.parametrize("path", ["staged", "direct", "dma"])
def test_many_jobs_back_to_back_through_small_buffers(path):
    """Staging buffers of two rows, jobs of many rows queued without waiting: buffers are
    reused within and across jobs, in both directions at once."""
    s = Setup(path, [16384] * 8, num_blocks=256, rows=128, staging_bytes=4 * 8 * 16384)
    try:
        rng = np.random.default_rng(3)
        jobs, stored = [], []
        for k in range(6):
            blocks = rng.choice(100, 10, replace=False)
            rows = np.arange(k * 10, k * 10 + 10)
            jobs.append(s.submit(blocks, [10], [0], rows, "store"))
            stored.append((blocks, rows))
        s.finish(jobs)
        for blocks, rows in stored:
            for b, r in zip(blocks, rows, strict=True):
                s.check_cell(r, [b])
        snaps = [[t[torch.as_tensor(b, device="cuda")].clone() for t in s.tensors]
                 for b, _ in stored]
        jobs = []
        targets = []
        for k, (_, rows) in enumerate(stored):
            dst = np.arange(128 + k * 10, 128 + k * 10 + 10)
            targets.append(dst)
            jobs.append(s.submit(dst, [10], [0], rows, "load"))
            # a store in the other direction at the same time, into fresh rows
            jobs.append(s.submit(rng.choice(100, 10, replace=False), [10], [0],
                                 np.arange(64 + k * 10, 64 + k * 10 + 10), "store"))
        s.finish(jobs)
        for dst, snap in zip(targets, snaps, strict=True):
            for t, b in zip(s.tensors, snap, strict=True):
                assert torch.equal(t[torch.as_tensor(dst, device="cuda")], b)
    finally:
        s.close()


@pytest.mark.parametrize("path", PATHS)
def test_store_waits_for_the_compute_that_wrote_the_blocks(path):
    """The blocks are rewritten on the compute stream behind a long GPU sleep; the store is
    submitted at once, without synchronizing: it must copy the new contents."""
    s = Setup(path, [16384] * 8)
    try:
        blocks = np.array([3, 8, 21, 30])
        new = [torch.randint(-128, 127, (4, 16384), dtype=torch.int8, device="cuda")
               for _ in s.tensors]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
        idx = torch.as_tensor(blocks, device="cuda")
        for t, v in zip(s.tensors, new, strict=True):
            t.index_copy_(0, idx, v)
        j = s.submit(blocks, [4], [0], [0, 1, 2, 3], "store")
        s.finish([j])
        for r, b in enumerate(blocks):
            s.check_cell(r, [b])
    finally:
        s.close()


@pytest.mark.parametrize("queue,direct,lanes", [(0, False, 0), (1 << 20, False, 0),
                                                (1 << 20, True, 0), (64 << 20, True, 0),
                                                (1 << 20, True, 2)],
                         ids=["all-at-once", "fed-1MiB", "fed-1MiB-direct", "direct",
                              "fed-1MiB-waves-2-streams"])
def test_a_load_waits_for_the_compute_that_read_its_blocks(queue, direct, lanes):
    """The compute stream reads the target blocks behind a long GPU sleep (as a step reads
    blocks freed after it); the load is submitted at once, with loads queued ahead of it when
    fed (or, with a large queue and ``load_direct``, every load enqueued by the caller; with
    ``lanes``, in waves over that many load streams): the step must read the old contents, the
    blocks end with the row's."""
    waves = {"load_waves": True, "load_wave_streams": lanes} if lanes else {}
    s = Setup("dma", [16384] * 8, num_blocks=200, rows=100,
              engine_kw={"load_queue_bytes": queue, "load_direct": direct, **waves})
    try:
        rng = np.random.default_rng(11)
        src = rng.choice(60, 40, replace=False)
        s.finish([s.submit(src, [40], [0], np.arange(40), "store")])
        rows_data = [t[torch.as_tensor(src, device="cuda")].clone() for t in s.tensors]
        ahead = [s.submit(100 + np.arange(k * 10, k * 10 + 10), [10], [0],
                          np.arange(k * 10, k * 10 + 10), "load") for k in range(4)]
        dst = np.array([70, 75, 80, 85])
        idx = torch.as_tensor(dst, device="cuda")
        old = [t[idx].clone() for t in s.tensors]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
        seen = [t[idx].clone() for t in s.tensors]  # the step's read, after the sleep
        j = s.submit(dst, [4], [0], [0, 1, 2, 3], "load")
        s.finish([*ahead, j])
        torch.cuda.synchronize()
        for t, o, v, r in zip(s.tensors, old, seen, rows_data, strict=True):
            assert torch.equal(v, o)  # the load did not overtake the read
            assert torch.equal(t[idx], r[:4])
    finally:
        s.close()


@pytest.mark.parametrize("path", PATHS)
def test_load_is_complete_when_reported_finished(path):
    """Poll ``get_finished`` (no ``wait``): once the job is reported, its blocks are whole."""
    s = Setup(path, [16384] * 32, num_blocks=600, rows=520)
    try:
        rng = np.random.default_rng(5)
        src = rng.choice(280, 256, replace=False)
        rows = rng.choice(520, 256, replace=False)
        s.finish([s.submit(src, [256], [0], rows, "store")])
        snap = [t[torch.as_tensor(src, device="cuda")].clone() for t in s.tensors]
        dst = 300 + rng.choice(280, 256, replace=False)
        j = s.submit(dst, [256], [0], rows, "load")
        while not any(f.job_id == j for f in s.copier.get_finished()):
            pass
        # read on another stream than the copier's, with no further synchronization
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            ok = all(torch.equal(t[torch.as_tensor(dst, device="cuda")], b)
                     for t, b in zip(s.tensors, snap, strict=True))
        assert ok
    finally:
        s.close()


def test_unknown_copy_path_is_refused():
    with pytest.raises(ValueError, match="copy: expected one of"):
        Setup("fast", [4096])


def test_a_run_across_rows_in_two_registrations_is_copied_in_two():
    """Packed layout (vLLM's BLHNC: one tensor of whole blocks), 4 blocks a chunk, chunks in
    descending blocks kept in descending rows: the job's pages merge into one run across six
    rows, and the rows are registered in segments of three. One copy may not span two
    registrations (on an H100, 2026-12-05c: cudaMemcpyBatchAsync failed with an invalid value
    and the engine stopped); the copier cuts the run at the boundary, bytes exact both ways."""
    page, bpc = 64 << 10, 4
    s = Setup("dma", [page], num_blocks=96, bpc=bpc, rows=12,
              engine_kw={"register_segment": 3 * page * bpc})
    try:
        assert len(s.copier.registered) == 4
        src = np.arange(40, 16, -1)  # 24 blocks descending: 6 chunks
        rows = np.arange(5, -1, -1)
        j = s.submit(src, [len(src)], [0], rows, "store")
        s.finish([j])
        for c in range(6):
            s.check_cell(rows[c], src[c * bpc:(c + 1) * bpc])
        dst = np.arange(90, 66, -1)
        before = s.tensors[0][torch.as_tensor(src, device="cuda")].clone()
        j = s.submit(dst, [len(dst)], [0], rows, "load")
        s.finish([j])
        assert torch.equal(s.tensors[0][torch.as_tensor(dst, device="cuda")], before)
    finally:
        s.close()


@pytest.fixture
def rows(monkeypatch) -> list[dict]:
    """The step trace on (tiering/step_trace.py), its rows kept here instead of written."""
    from tiering import step_trace

    kept: list[dict] = []
    monkeypatch.setattr(step_trace.TRACE, "on", True)
    monkeypatch.setattr(step_trace.TRACE, "add",
                        lambda kind, **f: kept.append({"k": kind, **f}))
    return kept


def test_a_traced_copier_marks_when_the_gpu_ran_each_steps_forward(rows):
    """Traced (tiering/step_trace.py), each ``get_finished`` (once a vLLM step, after its
    forward pass was enqueued) records an event on the compute stream; a later call reports it
    as a ``mark`` row whose GPU time is past the host time by the work queued ahead of it: here
    a kernel that spins 2e8 GPU cycles (0.1-0.2 s at an H100's or H200's clocks), enqueued just
    before the first call. (Its first version queued matmuls timed by the first one, which
    carries cuBLAS's set-up: on the H100 of 2026-12-07e too few were queued and it failed.)"""
    s = Setup("dma", [16384] * 4)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        s.copier.get_finished()
        torch.cuda.synchronize()
        s.copier.get_finished()
        marks = [r for r in rows if r["k"] == "mark"]
        assert len(marks) == 1
        assert 0.05 < marks[0]["g"] - marks[0]["t"] < 5.0
    finally:
        s.close()


def test_marks_count_the_allocators_cuda_calls_between_steps(rows):
    """Each mark carries PyTorch's running counts of its allocators' CUDA calls (the step
    trace names those made before a held pass): a device block of a size not cached before
    (cudaMalloc) and a page-locked host block (cudaHostAlloc) made between two steps show up
    in the second mark's counts."""
    s = Setup("dma", [16384] * 4)
    try:
        s.copier.get_finished()
        dev = torch.empty((1 << 30) + 4096 * 7, dtype=torch.uint8, device="cuda")
        host = torch.empty((1 << 26) + 4096 * 3, dtype=torch.uint8, pin_memory=True)
        s.copier.get_finished()
        torch.cuda.synchronize()
        s.copier.get_finished()
        del dev, host
    finally:
        s.close()
    first, second = [r for r in rows if r["k"] == "mark"][:2]
    assert second["malloc"] >= first["malloc"] + 1
    assert second["host_alloc"] >= first["host_alloc"] + 1
    assert {"free", "sync_all", "retries"} <= set(second)
