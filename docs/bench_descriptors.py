"""Worker-side CPU work of one load or store job, without a GPU (issue 15).

    python docs/bench_descriptors.py

What ``CudaCopier.submit_job`` computes before its first CUDA call, for the prefill
sweep's jobs: one request's 31 blocks (a 512-token prompt served from the CPU tier) and a
16-request step's 496 blocks, at the 1b (16 layers, 32 KiB pages), 8b (32 layers, 64 KiB) and
32b (64 layers, 64 KiB) shapes' per-layer layouts: ``CopyLayout.descriptors`` (one entry per
block and layer) and ``merge_runs`` plus the casts the CUDA call takes. Random blocks and rows;
numpy only (median of 5 rounds).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from tiering.backends.block_copy import CopyLayout, TensorInfo, merge_runs

SHAPES = {"1b": (16, 32 << 10), "8b": (32, 64 << 10), "32b": (64, 64 << 10)}


def layout(layers: int, page: int, blocks: int = 60000) -> CopyLayout:
    infos = [TensorInfo(0x7F0000000000 + i * blocks * page, page, page) for i in range(layers)]
    return CopyLayout(infos, [[(i, page) for i in range(layers)]], 0x100000000, layers * page,
                      0, layers * page, 1)


def timed(fn, n: int) -> float:
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n)
    return statistics.median(rounds)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'shape':<5} {'blocks':>6} {'descriptors':>11} {'build us':>9} {'merge us':>9} "
          f"{'us/block':>9}")
    for name, (layers, page) in SHAPES.items():
        lay = layout(layers, page)
        for nb in (31, 496):
            blocks = rng.choice(50000, nb, replace=False).astype(np.int64)
            rows = rng.choice(100000, nb, replace=False).astype(np.int64)
            n = 400 if nb == 31 else 40
            build = timed(lambda: lay.descriptors(blocks, [nb], [0], rows), n)  # noqa: B023
            dev, host, size = lay.descriptors(blocks, [nb], [0], rows)

            def merge() -> None:
                s, d, k = merge_runs(host, dev, size, by="src")  # noqa: B023
                for a in (s, d, k):
                    np.ascontiguousarray(a, dtype=np.uint64)
            m = timed(merge, n)
            print(f"{name:<5} {nb:>6} {len(size):>11} {build * 1e6:>9.0f} {m * 1e6:>9.0f} "
                  f"{(build + m) * 1e6 / nb:>9.1f}")


if __name__ == "__main__":
    main()
