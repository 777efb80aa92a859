"""The file tier's in-memory state around its index: rebuilt at open, guarded by a lock file.

* ``acquire_writer_lock`` — the one-writer rule (an ``flock`` on the namespace folder that the
  kernel drops if the writer dies), with the holder's pid in ``writer.lock`` for messages.
* ``load_slot_state`` — the whole index read in one snapshot and turned into the owner's
  tables: key → slot, per-slot record fields (plain lists: a million small objects would make
  reopening slow), free slots, and keys oldest-access-first for the policy. Records beyond a
  shrunk capacity, and slots claimed by two keys, are dropped (never trusted).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tiering.backends.index import Index
from tiering.backends.namespace import NamespaceError

log = logging.getLogger(__name__)

class NamespaceLocked(RuntimeError):
    """Another process is the writer of this namespace."""


class Entry(NamedTuple):
    """A snapshot of one key's slot record (for tools and tests)."""

    slot: int
    length: int
    codec: int
    checksum: int
    created: float
    last_access: float
    hits: int
    ready: bool


def acquire_writer_lock(folder: Path) -> int:
    """Become the one writer of ``folder``; returns the fd to close when done.

    The lock is an ``flock`` on the namespace folder itself: a folder cannot be unlinked
    while it holds files, so removing ``writer.lock`` (or planting a link there) cannot let a
    second writer in. ``writer.lock`` only tells other processes who holds the lock; failing to
    write it (a full disk) is logged, never fatal. Nothing is opened through a link.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise NamespaceError(f"{folder}: cannot open the namespace folder ({exc.strerror}); "
                             "it must be a real folder, not a link") from None
    for attempt in range(10):  # a tool may hold the lock for a moment to test it: retry briefly
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt < 9:
                time.sleep(0.1)
    else:
        os.close(fd)
        raise NamespaceLocked(f"{folder}: namespace is already open for writing by pid "
                              f"{lock_holder(folder)}; one writer per namespace (read-only tools "
                              "may run alongside)") from None
    try:
        _write_holder(folder)
    except NamespaceError:
        os.close(fd)
        raise
    return fd


def _write_holder(folder: Path) -> None:
    path = folder / "writer.lock"
    try:
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NamespaceError(f"{path}: writer.lock is a symbolic link; refusing a cache "
                                 "folder with links in it") from None
        log.warning("%s: cannot record the writer's pid (%s)", path, exc)
        return
    try:
        os.ftruncate(lock, 0)
        os.pwrite(lock, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:  # a full disk: the pid is only for messages
        log.warning("%s: cannot record the writer's pid (%s)", path, exc)
    finally:
        os.close(lock)


def lock_holder(folder: Path) -> str:
    """The pid recorded in ``writer.lock`` (for messages), or 'unknown'."""
    try:
        fd = os.open(folder / "writer.lock", os.O_RDONLY | os.O_NOFOLLOW)
        try:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
    except OSError:
        text = ""
    return text or "unknown"


def writer_alive(folder: Path) -> bool:
    """True if a process holds the namespace's writer lock (tested without keeping it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


@dataclass
class SlotState:
    entries: dict[bytes, int]
    free: list[int]
    length: list[int]
    codec: list[int]
    checksum: list[int]
    created: list[float]
    last: list[float]
    hits: list[int]
    ready: list[bool]
    ordered_keys: list[bytes]  # oldest access first
    reused: list[bool]  # per ordered key: hit at least once
    dropped_unusable: int = 0  # rows dropped at load: they were in a damaged slab file


def load_slot_state(index: Index, n_slots: int, folder: Path,
                    unusable: Sequence[range] = ()) -> SlotState:
    """``unusable``: slots of damaged slab files; their records are dropped (misses) and the
    slots are never handed out (``SlotState.dropped_unusable`` says how many rows went)."""
    # Millions of new objects would trigger repeated full garbage collections for nothing
    # (none of them can be cyclic garbage yet): pause the collector while loading.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(index, n_slots, folder, unusable)
    finally:
        if enabled:
            gc.enable()


def _load(index: Index, n_slots: int, folder: Path, unusable: Sequence[range]) -> SlotState:
    keys, recs = index.load_all()
    slots = recs["slot"] if len(recs) else np.empty(0, np.uint64)
    bad = slots >= n_slots  # capacity shrank
    uniq, counts = np.unique(slots, return_counts=True)
    dup = np.isin(slots, uniq[counts > 1])  # never trust a slot claimed twice
    lost = np.zeros(len(slots), dtype=bool)
    for r in unusable:  # rows in a damaged slab file: misses
        lost |= (slots >= r.start) & (slots < r.stop)
    lost &= ~(bad | dup)
    drop = [keys[i] for i in np.nonzero(bad | dup | lost)[0]]
    if drop:
        log.warning("%s: dropping %d index entries (beyond capacity, sharing a slot, or in a "
                    "damaged slab file: %d)", folder, len(drop), int(lost.sum()))
        index.publish([], [], drop_keys=drop)
    bad |= lost
    keep = np.nonzero(~(bad | dup))[0]
    order = keep[np.argsort(recs["last_access"][keep], kind="stable")]
    r = recs[order]
    slot_list = r["slot"].astype(np.int64)
    columns = {}
    for name, col in (("length", "length"), ("codec", "codec"), ("checksum", "checksum"),
                      ("created", "created"), ("last", "last_access"), ("hits", "hits")):
        arr = np.zeros(n_slots, dtype=r[col].dtype)
        arr[slot_list] = r[col]
        columns[name] = arr.tolist()
    ready = np.zeros(n_slots, dtype=bool)
    ready[slot_list] = True
    ordered_keys = np.array(keys, dtype=object)[order].tolist() if len(keys) else []
    usable = ~ready
    for rng in unusable:
        usable[rng.start:rng.stop] = False
    free = np.nonzero(usable)[0][::-1].tolist()  # pop() hands out low slots first
    return SlotState(dict(zip(ordered_keys, slot_list.tolist(), strict=True)), free,
                     ready=ready.tolist(), ordered_keys=ordered_keys,
                     reused=(r["hits"] > 0).tolist(), dropped_unusable=int(lost.sum()),
                     **columns)


def announce(tier: Any) -> None:
    """Say who writes this namespace and how: ``writer.json`` (read by ``tiering inspect``)
    and one log line."""
    from tiering.backends.namespace import write_json

    cfg = tier.cfg
    try:
        write_json(tier.folder / "writer.json", {
            "pid": os.getpid(), "opened": time.time(), "engine": tier.engine.describe(),
            "capacity_bytes": tier.capacity, "slots": tier.n_slots, "policy": cfg.policy,
            "store_threshold": cfg.store_threshold, "compression": cfg.compression,
            "verify": cfg.verify, "sparse_slabs": tier.slabs.sparse})
    except OSError as exc:  # a full disk must not stop a restart: it is only for display
        log.warning("%s: cannot write writer.json (%s)", tier.folder, exc)
    log.info("file tier %s: %d slots of %d bytes, %d resident, engine %s, policy %s, "
             "store_threshold %d", tier.folder, tier.n_slots, tier.row_bytes,
             len(tier.entries), tier.engine.describe(), cfg.policy, cfg.store_threshold)
