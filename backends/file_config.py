"""File-tier settings and their validation.

Every check runs before anything is created on disk, and each failure is one ``ValueError``
naming the setting and what was expected, so a bad config never leaves half a cache behind.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tiering.backends.codec import check_codec
from tiering.backends.namespace import SLAB_FILE as SLAB_NAME
from tiering.backends.paths import check_path
from tiering.backends.sizes import parse_size
from tiering.backends.slab_io import ALIGN, IO_KINDS
from tiering.policies import resolve

DEMOTE_MODES = ("on_store", "on_evict")


@dataclass
class FileTierConfig:
    path: str
    capacity: int | str
    policy: str = "arc"
    store_threshold: int = 0
    tracker_size: int = 64_000
    io: str = "auto"
    # 16, not 8: on the H200 machine's virtual disk 16 threads read 4 MiB runs at 1.59 / 1.58
    # GB/s against 1.21 / 1.11 with 8 (docs/bench_disk_hit.py, 2026-12-04b), and on an H100
    # host's a 32k disk hit in the engine read at ~2.0 GB/s, 0.92x vLLM's fs tier's time, where
    # 8 threads had been 1.06x on another host (docs/benchmarks.md, 2026-12-07 and -07b);
    # vLLM's fs tier runs 32
    io_threads: int = 16
    compression: str = "none"
    compression_level: int = 1
    element_bytes: int = 2
    verify: bool = True
    slab_file_bytes: int | str = "4GiB"
    preallocate: bool = True
    direct: bool = True
    max_batch: int = 0  # rows per group commit; 0 = about 64 MiB worth
    # when a chunk is written here: "on_store" (as soon as the CPU tier has it: write-through)
    # or "on_evict" (only when the CPU tier is about to evict it: write-back, fewer SSD writes)
    demote: str = "on_store"

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "file tier") -> FileTierConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known keys: {', '.join(sorted(known))}")
        for required in ("path", "capacity"):
            if required not in d:
                raise ValueError(f"{where}: {required!r} is required")
        return cls(**d)


# name -> (low, high) of the integer settings
_INT_RANGES = {"store_threshold": (0, 10**6), "tracker_size": (1, 10**9), "io_threads": (1, 1024),
               "max_batch": (0, 10**6), "compression_level": (1, 22)}


def check_types(cfg: FileTierConfig) -> None:
    """Types and ranges of the plain settings; ValueError naming the first bad one."""
    if not isinstance(cfg.path, str | os.PathLike) or not str(cfg.path):
        raise ValueError(f"path: expected a folder path, got {cfg.path!r:.80}")
    check_path(cfg.path, "path")  # a link loop, a name or path too long: one error, here
    for name, (low, high) in _INT_RANGES.items():
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"{name}: expected an integer from {low} to {high}, got {v!r:.40}")
    if cfg.element_bytes not in (1, 2, 4, 8) or isinstance(cfg.element_bytes, bool):
        raise ValueError(f"element_bytes: expected 1, 2, 4 or 8 (bytes per KV element), got "
                         f"{cfg.element_bytes!r:.40}")
    for name in ("verify", "preallocate", "direct"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name}: expected true or false, got {getattr(cfg, name)!r:.40}")


def nearest_existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists: the folder whose file system a tier
    still to be made in ``path`` will live on."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def allocated_bytes(root: Path, namespace_id: str | None) -> int:
    """Disk space the cache already holds under ``root``: its slab files (one namespace's, or
    every namespace's when the namespace is not known yet). Links are not followed."""
    pattern = f"{namespace_id}/slab-*.dat" if namespace_id else "*/slab-*.dat"
    total = 0
    for p in root.glob(pattern):
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and SLAB_NAME.match(p.name):  # not a look-alike name
            total += st.st_blocks * 512
    return total


def _other_namespaces(root: Path, namespace_id: str | None) -> str:
    """For a refusal for want of space: the other namespaces whose slabs hold space under
    ``root`` (rows another engine setup wrote, or this engine before an upgrade changed its
    namespace: never served to this one), and how to reclaim them; "" if none."""
    if namespace_id is None or not root.is_dir():
        return ""
    held: dict[str, int] = {}
    for p in root.glob("*/slab-*.dat"):
        name = p.parent.name
        if name != namespace_id and name not in held:
            held[name] = allocated_bytes(root, name)
    held = {k: v for k, v in held.items() if v}
    if not held:
        return ""
    listed = ", ".join(f"{k} ({v} bytes)" for k, v in sorted(held.items())[:4])
    more = f" and {len(held) - 4} more" if len(held) > 4 else ""
    return (f"; other namespaces under {root} hold slabs: {listed}{more} (another engine "
            "setup's, or this engine's before an upgrade changed its namespace; never served "
            f"to this one; `tiering inspect {root}` shows them): `tiering drop {root} "
            "--namespace ID` frees the disk of one no engine uses (`tiering clear` empties a "
            "namespace but keeps its preallocated slabs)")


def validate(cfg: FileTierConfig, row_bytes: int, namespace_id: str | None = None
             ) -> dict[str, int]:
    """Check every setting; returns the parsed numbers. Creates nothing.

    The one place a file tier's settings are checked (engine start, ``tiering config``, the
    tier's own open). The free-space check counts the slabs this cache already owns under the
    path as available to it: a tier sized to most of its drive must still restart.
    """
    if not isinstance(row_bytes, int) or row_bytes <= 0 or row_bytes % ALIGN:
        raise ValueError(f"row_bytes: must be a positive multiple of {ALIGN} (slots are "
                         f"O_DIRECT-aligned), got {row_bytes!r}")
    capacity = parse_size(cfg.capacity, "capacity")
    slab_file_bytes = parse_size(cfg.slab_file_bytes, "slab_file_bytes")
    if capacity < row_bytes:
        raise ValueError(f"capacity: {capacity} bytes holds no row of {row_bytes} bytes; "
                         "give at least one row")
    if slab_file_bytes < row_bytes:
        raise ValueError(f"slab_file_bytes: {slab_file_bytes} is smaller than one row "
                         f"({row_bytes} bytes)")
    if cfg.io not in IO_KINDS:
        raise ValueError(f"io: unknown I/O kind {cfg.io!r}; expected one of {', '.join(IO_KINDS)}")
    check_codec(cfg.compression)
    if cfg.demote not in DEMOTE_MODES:
        raise ValueError(f"demote: expected one of {', '.join(DEMOTE_MODES)}, got {cfg.demote!r}")
    resolve(cfg.policy)
    check_types(cfg)
    root = Path(cfg.path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"path: {root} exists and is not a folder")
    anchor = nearest_existing(root.resolve())
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise ValueError(f"path: {root} is not writable (checked {anchor})")
    free = shutil.disk_usage(anchor).free
    existing_bytes = allocated_bytes(root, namespace_id) if root.is_dir() else 0
    n_slots = capacity // row_bytes
    needed = n_slots * row_bytes - existing_bytes
    if cfg.preallocate and needed > free:
        raise ValueError(f"capacity: {capacity} bytes requested but {anchor} has only {free} "
                         f"bytes free (plus {existing_bytes} already allocated by this cache)"
                         + _other_namespaces(root, namespace_id))
    return {"capacity": capacity, "n_slots": n_slots, "slab_file_bytes": slab_file_bytes}
