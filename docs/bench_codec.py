"""Compression ratio and speed of the zstd codec on KV-like data (one core).

    python docs/bench_codec.py
"""

from __future__ import annotations

import time

import numpy as np

from tiering.backends.codec import ZstdCodec


def bf16_normal(nbytes: int, seed: int = 0) -> memoryview:
    v = np.random.default_rng(seed).normal(0, 1, nbytes // 2).astype(np.float32)
    return memoryview((v.view(np.uint32) >> 16).astype(np.uint16).tobytes())


def main() -> None:
    print(f"{'row':>8} {'shuffle':>7} {'ratio':>6} {'compress GB/s':>13} {'decompress GB/s':>15}")
    for nbytes in (256 << 10, 2 << 20, 8 << 20):
        row = bf16_normal(nbytes)
        for eb in (1, 2):
            c = ZstdCodec(1, eb)
            out = memoryview(bytearray(nbytes))
            packed = c.encode(row)
            reps = max(3, (64 << 20) // nbytes)
            t0 = time.perf_counter()
            for _ in range(reps):
                c.encode(row)
            tc = (time.perf_counter() - t0) / reps
            t0 = time.perf_counter()
            for _ in range(reps):
                c.decode(packed, out)
            td = (time.perf_counter() - t0) / reps
            assert bytes(out) == bytes(row)
            print(f"{nbytes >> 10:>6}Ki {'yes' if eb == 2 else 'no':>7} "
                  f"{nbytes / len(packed):>6.2f} {nbytes / tc / 1e9:>13.2f} "
                  f"{nbytes / td / 1e9:>15.2f}")


if __name__ == "__main__":
    main()
