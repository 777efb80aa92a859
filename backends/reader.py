"""Read-only access to a cache folder, for the CLI and for a second engine's tools.

A reader opens the LMDB index read-only (an MVCC snapshot per transaction: it never blocks the
writer and the writer never blocks it) and reads slab files with plain ``pread``. It never takes
the writer lock, never writes, and never trusts a slot whose record changed under it: a checksum
mismatch is re-checked against a fresh snapshot before it is reported as corruption.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiering.backends.checksum import checksum_of, namespace_seed
from tiering.backends.index import Index, Record
from tiering.backends.namespace import (
    check_folder,
    is_candidate,
    list_namespaces,
    read_meta,
    read_writer_info,
)
from tiering.backends.slab import damage_of, slab_name

HIT_BUCKETS = (0, 1, 2, 5, 10, 100)
AGE_BUCKETS = (60, 3600, 86400, 7 * 86400)  # seconds


@dataclass
class Corrupt:
    key: bytes
    slot: int
    reason: str


class NamespaceReader:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.foreign = check_folder(self.folder, allow_foreign=True)  # never read, only named
        self.meta = read_meta(self.folder)
        self.row_bytes = int(self.meta["row_bytes"])
        self.index = Index(self.folder, map_size=0, readonly=True)
        # the layout recorded at creation, never guessed from a (possibly damaged) file's size
        self._per_file = max(1, int(self.meta["slab_file_bytes"]) // self.row_bytes)
        self.writer = read_writer_info(self.folder)

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> NamespaceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def capacity_slots(self) -> int:
        return int(self.meta["slots"])

    def damaged_slabs(self) -> dict[str, str]:
        """Slab files of the recorded layout that are there but are not regular files
        (``slab.damage_of``): file name -> what it is."""
        n_files = -(-self.capacity_slots() // self._per_file)
        out = {}
        for i in range(n_files):
            problem = damage_of(self.folder / slab_name(i))
            if problem:
                out[slab_name(i)] = problem
        return out

    def summary(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        _, recs = self.index.load_all()
        n = len(recs)
        slots = self.capacity_slots()
        hits = recs["hits"] if n else np.empty(0)
        ages = now - recs["last_access"] if n else np.empty(0)
        stored = int(recs["length"].sum()) if n else 0
        return {
            "namespace": self.folder.name,
            "path": str(self.folder),
            "model": self.meta.get("model"), "dtype": self.meta.get("dtype"),
            "layout": self.meta.get("layout"), "row_bytes": self.row_bytes,
            "chunk_tokens": self.meta.get("chunk_tokens"), "parallel": self.meta.get("parallel"),
            # how a row orders a chunk's blocks, where the engine recorded it (our spec, chunks of
            # more than one block); None: in order (rows written before it was recorded, or
            # vLLM's own CPU layout under its tiering spec, or one-block chunks)
            "block_order": (self.meta.get("extra") or {}).get("block_order"),
            "format_version": self.meta.get("format_version"),
            "restart_safe": self.meta.get("restart_safe"),
            "capacity_bytes": slots * self.row_bytes, "slots": slots,
            "entries": n, "usage_bytes": n * self.row_bytes, "stored_bytes": stored,
            "usage_perc": round(n / slots, 4) if slots else 0.0,
            "compressed_entries": int((recs["codec"] != 0).sum()) if n else 0,
            "reserved_slots": len(self.index.reservations()),
            "hit_histogram": _histogram(hits, HIT_BUCKETS, lambda b: f">={b}"),
            "age_histogram": _histogram(ages, AGE_BUCKETS, lambda b: f">={b}s", first="<60s"),
            "io_engine": self.writer.get("engine"),
            "writer": self.writer,
            "stats": self.index.read_stats(),
            "foreign_entries": self.foreign,  # names the tier does not write (left alone)
        }

    def _read(self, fds: dict[int, int], slot: int, length: int) -> bytes:
        f, s = divmod(slot, self._per_file)
        if f not in fds:
            fds[f] = os.open(self.folder / slab_name(f), os.O_RDONLY | os.O_NOFOLLOW)
        return os.pread(fds[f], length, s * self.row_bytes)

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[Corrupt]:
        """Checksum every published slot; returns the corrupt ones (re-checked, see above)."""
        keys, recs = self.index.load_all()
        seed = namespace_seed(self.folder.name)
        bad: list[Corrupt] = []
        fds: dict[int, int] = {}
        damaged = {int(name[5:-4]) for name in self.damaged_slabs()}
        try:
            for i, key in enumerate(keys):
                r = recs[i]
                slot, length, checksum = int(r["slot"]), int(r["length"]), int(r["checksum"])
                if slot // self._per_file in damaged:  # never opened: not a file of ours
                    reason = "damaged_slab"
                else:
                    reason = self._check_slot(fds, seed, key, slot, length, checksum)
                if reason and self._still_same(key, r):
                    bad.append(Corrupt(key, slot, reason))
                if progress:
                    progress(i + 1, len(keys))
        finally:
            for fd in fds.values():
                os.close(fd)
        return bad

    def _check_slot(self, fds: dict[int, int], seed: int, key: bytes, slot: int, length: int,
                    checksum: int) -> str:
        """'' if the slot holds the bytes its record describes, else the reason."""
        if not 0 < length <= self.row_bytes:  # a damaged record: never read past a slot
            return "corrupt"
        try:
            data = self._read(fds, slot, length)
        except OSError:
            return "missing"  # its slab file is gone or unreadable
        if len(data) < length:
            return "short_read"
        return "checksum" if checksum_of(seed, key, data) != checksum else ""

    def _still_same(self, key: bytes, r: np.void) -> bool:
        """True if the record is unchanged in a fresh snapshot (so the mismatch is real)."""
        now = self.index.get(key)
        return now is not None and now[0] == int(r["slot"]) and now[4] == int(r["checksum"])

    def iter_records(self) -> Iterator[tuple[bytes, Record]]:
        return self.index.iter_records()


def _histogram(values: np.ndarray, bounds: tuple[float, ...], label: Callable[[float], str],
               first: str | None = None) -> dict[str, int]:
    edges = list(bounds) + [np.inf]
    out = {}
    if first is not None:
        out[first] = int((values < bounds[0]).sum())
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        out[label(lo)] = int(((values >= lo) & (values < hi)).sum())
    return out


def find_namespaces(path: Path) -> list[Path]:
    """``path`` may be a cache root (several namespaces) or one namespace folder."""
    path = Path(path)
    if is_candidate(path):  # a namespace folder itself (named by its id, with a meta.json)
        return [path]
    found: list[Path] = list_namespaces(path)
    if not found:
        raise FileNotFoundError(f"{path}: no vllm-tiering namespace found "
                                "(expected <path>/<namespace>/meta.json)")
    return found
