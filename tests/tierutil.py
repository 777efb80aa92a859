"""Helpers shared by the tier and chain tests."""

from __future__ import annotations

import hashlib

import numpy as np

from tiering.backends.file_tier import FileTier
from tiering.backends.namespace import NamespaceFacts
from tiering.backends.slab_io import aligned_buffer

ROW = 8192


def facts(row_bytes: int = ROW, model: str = "tiny") -> NamespaceFacts:
    return NamespaceFacts(model=model, dtype="bfloat16", layout="LBHNC", row_bytes=row_bytes,
                          chunk_tokens=16, parallel={"tp": 1, "pp": 1})


def key(i: int | str) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() + (0).to_bytes(4, "big")


def row_for(k: bytes, row_bytes: int = ROW) -> memoryview:
    """Deterministic, incompressible-ish content derived from the key (page-aligned buffer)."""
    seed = int.from_bytes(hashlib.sha256(k).digest()[:8], "little")
    buf = aligned_buffer(row_bytes)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(seed).integers(
        0, 256, row_bytes, dtype=np.uint8)
    return buf


class CheckedFileTier(FileTier):
    """A FileTier that checks its books (``check(index=True)``) when it closes normally: every
    scenario of the file-tier and fault tests that opens a tier through ``open_tier`` ends with
    the slot table, the policy's pins and the LMDB index agreeing."""

    def close(self) -> None:
        try:
            if not self.closed:
                self.wait_idle()
                self.check(index=True)
        finally:  # closed even when the check fails: later tests need the lock and threads gone
            super().close()

    def __exit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:  # the test already failed: keep its error, skip the check
            FileTier.close(self)
        else:
            self.close()


def open_tier(path, slots: int = 16, row_bytes: int = ROW, **cfg) -> FileTier:
    conf = {"path": str(path), "capacity": slots * row_bytes, "policy": "lru", "io": "posix",
            "io_threads": 4, "slab_file_bytes": 4 * row_bytes, **cfg}
    model = conf.pop("model", "tiny")
    return CheckedFileTier(conf, facts(row_bytes, model))


def store(tier: FileTier, keys: list[bytes]) -> list[bytes]:
    rows = [row_for(k, tier.row_bytes) for k in keys]
    accepted = tier.put(keys, rows).admitted
    done = tier.wait_idle()
    assert all(d.ok for d in done), done
    return accepted


def read(tier: FileTier, k: bytes):
    """Read a key synchronously; returns (bytes or None, the read's completions)."""
    out = aligned_buffer(tier.row_bytes)
    if not tier.get([(k, out, None)])[0]:
        return None, []
    done = tier.wait_idle()
    ok = all(d.ok for d in done)
    return (bytes(out) if ok else None), done


def hit_prefix(chain, keys: list[bytes]) -> list[bytes]:
    """One request's lookups of ``keys`` in prefix order (each protecting those before it), as
    vLLM asks: the leading keys that are HITs, up to the first that is not."""
    from tiering.tier import Lookup

    seen: set[bytes] = set()
    hits: list[bytes] = []
    for k in keys:
        r = chain.lookup(k, protect=seen)
        seen.add(k)
        if r is not Lookup.HIT:
            break
        hits.append(k)
    return hits
