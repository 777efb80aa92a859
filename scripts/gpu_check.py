"""GPU checks and benchmarks in one run (prints a short table, writes JSON).

Run on a machine with an NVIDIA GPU: ``bash scripts/gpu_check.sh [OUT_DIR]``.

1. GPU <-> CPU copies (``backends/cuda_copy.py`` CudaCopier, each ``copy`` path) for a
   Llama-3.1-8B-shaped cache: 32 layers, 8 KV heads, head 128, bf16, 16-token blocks → 64 KiB
   per-layer pages (per-layer layout, 32 tensors) and 2 MiB per block (packed layout, one
   tensor). 512 random non-contiguous blocks (1 GiB) per job into random rows of a pinned
   staging region; store, load, and both at once, against one large ``copy_`` of the same bytes
   measured in the same run. Every moved byte is checked: the stored rows against the blocks,
   then a load into other blocks against the originals. The ``chunk`` variants group 4 adjacent
   blocks a row, as the product's default 64-token chunk does: in a cycled cache's descending
   block order each tensor's part of a chunk is one 256 KiB copy, in a fresh cache's ascending
   order four 64 KiB ones.
2. The file tier with ``io=kvikio`` against ``io=posix`` on the same disk (``tiering bench``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build-gpu"))

import torch  # noqa: E402

from tiering.backends.block_copy import CopyLayout, TensorInfo, merge_runs  # noqa: E402
from tiering.backends.cuda_copy import CudaCopier  # noqa: E402
from tiering.backends.slab_io import aligned_buffer  # noqa: E402

LAYERS, PAGE, BLOCKS, JOB, ROWS, REPEAT = 32, 64 << 10, 2048, 512, 1024, 7
GB = 1e9


def median_time(fn, repeat=REPEAT) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunk_blocks(rng: np.random.Generator, lo: int, n_blocks: int, chunk: int, order: str
                 ) -> np.ndarray:
    """``n_blocks`` GPU block ids from ``[lo, lo + BLOCKS // 2)``, in chunks of ``chunk``
    adjacent blocks at random places: in the chunk's logical order, ``descending`` (b, b-1, ...:
    blocks vLLM hands out once its cache has cycled, freed tail first) or ``ascending`` (a fresh
    cache's)."""
    starts = lo + chunk * rng.choice(BLOCKS // 2 // chunk, n_blocks // chunk, replace=False)
    step = np.arange(chunk)
    runs = starts[:, None] + (step[::-1] if order == "descending" else step)[None, :]
    return runs.ravel()


def dma(layout_name: str, copy: str = "dma", staging: int = 64 << 20, api: str = "auto",
        batch_max: int = 1024, access_order: str = "stream", flags: int = 0,
        streams: int = 1, chunk: int = 1, order: str = "descending") -> dict:
    """One copy path's store, load and both at once, against one ``copy_`` of the same bytes.
    ``chunk`` > 1: ``chunk`` 16-token blocks per offloaded chunk (a row), as vLLM's offloading
    connector groups them with ``block_size`` ``16 * chunk``; its blocks adjacent in ``order``."""
    rows_total = ROWS // chunk  # the same 2 GiB of staging whatever the chunk
    row_bytes = LAYERS * PAGE * chunk
    host = aligned_buffer(rows_total * row_bytes)
    host_arr = np.frombuffer(host, np.uint8)
    host_base = host_arr.ctypes.data
    copier = CudaCopier(host_base, len(host_arr), api=api, batch_max=batch_max, copy=copy,
                            staging_bytes=staging, access_order=access_order, copy_flags=flags,
                            streams_per_direction=streams)
    if layout_name == "per-layer":
        tensors = [torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, device="cuda")
                   for _ in range(LAYERS)]
        infos = [TensorInfo(t.data_ptr(), t.stride(0), PAGE) for t in tensors]
        refs = [[(i, PAGE) for i in range(LAYERS)]]
    else:
        tensors = [torch.randint(-128, 127, (BLOCKS, row_bytes), dtype=torch.int8, device="cuda")]
        infos = [TensorInfo(tensors[0].data_ptr(), tensors[0].stride(0), row_bytes)]
        refs = [[(0, row_bytes)]]
    if chunk > 1 and layout_name != "per-layer":
        raise ValueError("chunks of several blocks: per-layer layout only")
    layout = CopyLayout(infos, refs, host_base, row_bytes, 0, row_bytes, chunk,
                        torch_tensors=tensors)
    rng = np.random.default_rng(0)
    if chunk == 1:
        blocks = rng.choice(BLOCKS // 2, JOB, replace=False)  # store from the first half
        other = BLOCKS // 2 + rng.choice(BLOCKS // 2, JOB, replace=False)  # load into the second
    else:
        blocks = chunk_blocks(rng, 0, JOB, chunk, order)
        other = chunk_blocks(rng, BLOCKS // 2, JOB, chunk, order)
    rows = rng.choice(rows_total, JOB // chunk, replace=False)
    dev_addr, host_addr, size = layout.descriptors(blocks, [JOB], [0], rows)
    nbytes = int(size.sum())
    copies = len(merge_runs(dev_addr, host_addr, size)[0])  # what the dma path submits
    job = [0]

    def submit(blk, direction):
        job[0] += 1
        copier.submit_job(job[0], layout, blk, [JOB], [0], rows, direction)
        return job[0]

    gpu_s = {"store": [], "load": []}  # the job's own span on the GPU (its CUDA events)

    def run(blk, direction):
        copier.wait({submit(blk, direction)})
        gpu_s[direction] += [f.seconds for f in copier.get_finished()]

    t_store = median_time(lambda: run(blocks, "store"))
    # correctness 1: each stored row holds its chunk's pages in the row layout: tensor by
    # tensor, within a tensor the chunk's blocks last position first (CopyLayout's doc)
    blk = torch.as_tensor(blocks, device="cuda")
    last_first = torch.as_tensor(blocks.reshape(-1, chunk)[:, ::-1].ravel().copy(), device="cuda")
    expect = torch.cat([t[last_first].reshape(len(rows), chunk * t.shape[1]) for t in tensors],
                       dim=1).cpu()
    got = torch.from_numpy(host_arr.reshape(rows_total, row_bytes)[rows].view(np.int8))
    rows_ok = torch.equal(expect, got)
    del expect, got
    snapshot = [t[blk].clone() for t in tensors]
    t_load = median_time(lambda: run(other, "load"))
    # correctness 2: what was stored from `blocks` is now in `other`
    oth = torch.as_tensor(other, device="cuda")
    ok = rows_ok and all(torch.equal(s, t[oth]) for s, t in zip(snapshot, tensors, strict=True))
    del snapshot

    def both():
        a = submit(blocks, "store")
        b = submit(other, "load")
        copier.wait({a, b})
        copier.get_finished()

    t_both = median_time(both)
    # ceiling: one large copy of the same bytes between pinned host and device memory
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    t_d2h = median_time(lambda: h.copy_(d, non_blocking=True))
    t_h2d = median_time(lambda: d.copy_(h, non_blocking=True))
    h2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def both_ceiling():
        with torch.cuda.stream(s1):
            h.copy_(d, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)

    t_both_ceiling = median_time(both_ceiling)
    res = {
        "layout": layout_name, "copy": copier.copy,
        "api": f"{copier.api}/{batch_max}" + (f"/{staging >> 20}M" if copier.copy == "staged"
                                               else "")
        + (f"/{access_order}" if access_order != "stream" else "")
        + (f"/f{flags}" if flags else "") + (f"/{streams}s" if streams > 1 else "")
        + (f"/chunk{chunk}-{order[:4]}" if chunk > 1 else ""),
        "chunk_blocks": chunk, "block_order": order if chunk > 1 else None,
        "access_order": access_order, "flags": flags, "streams_per_direction": streams,
        "jobs_by_path": dict(copier.jobs_by_path),
        "bytes": nbytes, "descriptors": len(size), "copies": copies,
        "store_GBps": nbytes / t_store / GB, "load_GBps": nbytes / t_load / GB,
        "store_gpu_GBps": nbytes / statistics.median(gpu_s["store"]) / GB,
        "load_gpu_GBps": nbytes / statistics.median(gpu_s["load"]) / GB,
        "both_GBps": 2 * nbytes / t_both / GB,
        "copy_d2h_GBps": nbytes / t_d2h / GB, "copy_h2d_GBps": nbytes / t_h2d / GB,
        "copy_both_GBps": 2 * nbytes / t_both_ceiling / GB,
        "correct": bool(ok), "batch_api": copier.batch_api,
        "register_failures": copier.register_failures,
    }
    res["store_vs_copy"] = res["store_GBps"] / res["copy_d2h_GBps"]
    res["load_vs_copy"] = res["load_GBps"] / res["copy_h2d_GBps"]
    copier.shutdown()
    del tensors
    torch.cuda.empty_cache()
    return res


def file_tier(folder: str) -> list[dict]:
    from tiering.bench import bench

    out = []
    for io in ("posix", "kvikio"):
        try:
            r = bench(folder, 2 << 20, 2 << 30, 16, 3, "tier", io, 0)  # the tier's io_threads
            out.append({"io": io, **{k: r[k] for k in ("tier_write_GBps", "tier_read_GBps",
                                                        "tier_cpu_s_per_GB", "io_engine")},
                        "bad_rows": r.get("tier_bad_rows")})
        except Exception as exc:  # report, keep going
            out.append({"io": io, "error": f"{type(exc).__name__}: {exc}"})
    return out


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(info), flush=True)
    results = {"info": info, "dma": [], "errors": []}
    # (layout, copy path, staging bytes): the descriptor path is the old default
    variants: list[tuple[str, str, int, dict]] = [
        ("per-layer", "dma", 0, {}), ("per-layer", "auto", 128 << 20, {}),
        ("per-layer", "staged", 64 << 20, {}), ("per-layer", "staged", 256 << 20, {}),
        ("per-layer", "direct", 0, {}), ("packed", "dma", 0, {}), ("packed", "auto", 128 << 20, {})]
    # both directions at once (issue 15): the descriptor path's options side by side
    both_ways: list[tuple[str, str, int, dict]] = [
        ("per-layer", "dma", 0, {"access_order": "any"}),
        ("per-layer", "dma", 0, {"flags": 1}),
        ("per-layer", "dma", 0, {"streams": 2}),
        ("per-layer", "dma", 0, {"streams": 2, "access_order": "any"}),
        ("per-layer", "dma", 0, {"streams": 4}),
        ("per-layer", "dma", 0, {"batch_max": 4096}),
        ("per-layer", "dma", 0, {"batch_max": 256}),
        ("packed", "dma", 0, {"streams": 2}),
        # the product's default chunk (64 tokens: 4 blocks a row), in recycled blocks (each
        # tensor's part of a chunk one 256 KiB copy) and in a fresh cache's (page by page)
        ("per-layer", "dma", 0, {"chunk": 4, "order": "descending"}),
        ("per-layer", "dma", 0, {"chunk": 4, "order": "descending", "streams": 2}),
        ("per-layer", "dma", 0, {"chunk": 4, "order": "ascending"}),
        # larger chunks (128 and 256 tokens): each tensor's part of a chunk one 512 KiB or
        # 1 MiB copy. Per-layer pages cannot join across rows (a row holds every tensor), so
        # the chunk bounds a copy; does the copy engine's both-ways rate follow the size?
        ("per-layer", "dma", 0, {"chunk": 8, "order": "descending"}),
        ("per-layer", "dma", 0, {"chunk": 16, "order": "descending"}),
    ]
    pick = os.environ.get("GPU_CHECK_VARIANTS", "all")
    if pick == "both":  # the baseline and the both-ways candidates only
        variants = variants[:1] + both_ways
    else:
        variants = variants + both_ways
    if os.environ.get("GPU_CHECK_QUICK"):
        variants = variants[:2]
    for name, copy, staging, opts in variants:
        try:
            results["dma"].append(dma(name, copy, staging, **opts))
        except Exception:
            import traceback

            traceback.print_exc()
            results["errors"].append(traceback.format_exc())
    print(f"{'layout':<10} {'path':<7} {'api/batch/staging':<24} {'desc':>6} {'copies':>6} {'store':>7} {'load':>7} {'both':>7} | {'copy d2h':>8} "
          f"{'copy h2d':>8} {'copy both':>9} | {'store%':>6} {'load%':>6} ok | gpu-side store% load%")
    for r in results["dma"]:
        print(f"{r['layout']:<10} {r['copy']:<7} {r['api']:<24} {r['descriptors']:>6} {r['copies']:>6} {r['store_GBps']:>7.1f} "
              f"{r['load_GBps']:>7.1f} {r['both_GBps']:>7.1f} | {r['copy_d2h_GBps']:>8.1f} "
              f"{r['copy_h2d_GBps']:>8.1f} {r['copy_both_GBps']:>9.1f} | "
              f"{100 * r['store_vs_copy']:>5.0f}% {100 * r['load_vs_copy']:>5.0f}% {r['correct']} | "
              f"{100 * r['store_gpu_GBps'] / r['copy_d2h_GBps']:>5.0f}% "
              f"{100 * r['load_gpu_GBps'] / r['copy_h2d_GBps']:>5.0f}%",
              flush=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2))
    if os.environ.get("GPU_CHECK_SKIP_FILE"):
        return
    scratch = os.environ.get("TIERING_BENCH_DIR") or tempfile.mkdtemp(prefix="tiering-bench-")
    results["file_tier"] = file_tier(scratch)
    for r in results["file_tier"]:
        print(json.dumps(r), flush=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
