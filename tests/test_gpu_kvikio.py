"""The file tier through kvikio on a GPU machine: byte-exact in every row layout (small and large
rows, several rows per group commit, compressed or raw, O_DIRECT or buffered), and the files it
writes are the same format the POSIX slab I/O reads (and the other way round).

GPU only (marker ``gpu``; ``scripts/gpu_tests.sh``); skipped, never passed, elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tierutil import facts, key, read, row_for

from tiering.backends.file_tier import FileTier
from tiering.backends.slab_io import cuda_driver_present

pytestmark = pytest.mark.gpu
if not cuda_driver_present():
    pytest.skip("needs a CUDA driver (run scripts/gpu_tests.sh on a GPU machine)",
                allow_module_level=True)
pytest.importorskip("kvikio")

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    # name: (row bytes, extra file-tier settings)
    "small-rows": (8192, {}),
    "2MiB-rows": (2 << 20, {}),
    "odd-rows-buffered": (3 * 4096, {"direct": False}),
    "zstd": (256 << 10, {"compression": "zstd"}),
    "one-row-batches": (64 << 10, {"max_batch": 1}),
}


def tier(path: Path, io: str, row_bytes: int, **cfg: Any) -> FileTier:
    conf = {"path": str(path), "capacity": 32 * row_bytes, "policy": "lru", "io": io,
            "io_threads": 4, "slab_file_bytes": 8 * row_bytes, **cfg}
    return FileTier(conf, facts(row_bytes))


def kv_like(k: bytes, row_bytes: int) -> memoryview:
    """bf16-like random-normal rows (compressible a little, like real KV)."""
    buf = row_for(k, row_bytes)
    seed = int.from_bytes(k[:8], "little")
    vals = np.random.default_rng(seed).standard_normal(row_bytes // 2).astype(np.float32)
    np.frombuffer(buf, np.uint16)[:] = (vals.view(np.uint32) >> 16).astype(np.uint16)
    return buf


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kvikio_round_trip_and_same_format_as_posix(tmp_path: Path, layout: str) -> None:
    row_bytes, cfg = LAYOUTS[layout]
    keys = [key(f"{layout}-{i}") for i in range(12)]
    rows = {k: bytes(kv_like(k, row_bytes)) for k in keys}
    with tier(tmp_path / "a", "kvikio", row_bytes, **cfg) as t:
        assert t.io.name == "kvikio"
        put = t.put(keys, [memoryview(bytearray(rows[k])) for k in keys])
        assert put.admitted == keys and not put.rejected and not put.evicted
        assert all(d.ok for d in t.wait_idle())
        for k in keys:
            got, _ = read(t, k)
            assert got == rows[k], f"{layout}: kvikio read back other bytes"
    with tier(tmp_path / "a", "posix", row_bytes, **cfg) as t:  # reopen: same files, other slab I/O
        for k in keys:
            got, _ = read(t, k)
            assert got == rows[k], f"{layout}: posix reads kvikio's rows differently"
    # and the other way: written by posix, read by kvikio
    with tier(tmp_path / "b", "posix", row_bytes, **cfg) as t:
        assert t.put(keys, [memoryview(bytearray(rows[k])) for k in keys]).admitted == keys
        assert all(d.ok for d in t.wait_idle())
    with tier(tmp_path / "b", "kvikio", row_bytes, **cfg) as t:
        for k in keys:
            got, _ = read(t, k)
            assert got == rows[k]
