"""Row codecs: how a row is stored in its slot.

``none`` stores the row as is. ``zstd`` first shuffles bytes into planes (all first bytes of
each ``element_bytes``-wide value, then all second bytes, ...) and then compresses with zstd:
the high byte of a bf16/fp16 value (sign + exponent) repeats a lot across a row while the low
byte is close to noise, and zstd finds far more in the separated planes than in the interleaved
values. A row that does not shrink is stored raw (codec ``none`` in its record), so the worst
case costs only the compression attempt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import zstandard

CODECS = {"none": 0, "zstd": 1}


def check_codec(name: str) -> int:
    if name not in CODECS:
        raise ValueError(f"compression: unknown codec {name!r}; expected one of "
                         f"{', '.join(CODECS)}")
    return CODECS[name]


def shuffle(row: memoryview | bytes, element_bytes: int) -> bytes:
    a = np.frombuffer(row, dtype=np.uint8)
    if element_bytes <= 1 or a.size % element_bytes:
        return a.tobytes()
    n = a.size // element_bytes
    out = np.empty_like(a)
    for k in range(element_bytes):  # one strided copy per plane (a transpose is much slower)
        out[k * n:(k + 1) * n] = a[k::element_bytes]
    return out.tobytes()


def unshuffle(data: bytes, element_bytes: int, out: memoryview) -> None:
    dst = np.frombuffer(out, dtype=np.uint8)
    src = np.frombuffer(data, dtype=np.uint8)
    if element_bytes <= 1 or src.size % element_bytes:
        dst[: src.size] = src
        return
    n = src.size // element_bytes
    for k in range(element_bytes):
        dst[k:src.size:element_bytes] = src[k * n:(k + 1) * n]


class ZstdCodec:
    """Thread-safe wrapper: zstandard (de)compressor objects are per thread."""

    def __init__(self, level: int = 1, element_bytes: int = 2) -> None:
        import threading

        self.level = level
        self.element_bytes = element_bytes
        self._local = threading.local()

    def _c(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        pair = getattr(self._local, "pair", None)
        if pair is None:
            # imported here, not with the module: only a tier that compresses (or reads a row
            # stored compressed) needs zstandard, so a machine without it serves the rest
            import zstandard

            pair = (zstandard.ZstdCompressor(level=self.level), zstandard.ZstdDecompressor())
            self._local.pair = pair
        return pair

    def encode(self, row: memoryview) -> bytes:
        return self._c()[0].compress(shuffle(row, self.element_bytes))

    def decode(self, data: memoryview | bytes, out: memoryview) -> None:
        raw = self._c()[1].decompress(bytes(data), max_output_size=len(out))
        if len(raw) != len(out):
            raise ValueError(f"decompressed {len(raw)} bytes, expected {len(out)}")
        unshuffle(raw, self.element_bytes, out)
