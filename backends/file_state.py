"""The file tier's in-memory state around its index: rebuilt at open, guarded by a lock file.

* ``acquire_writer_lock`` — the one-writer rule (an ``flock`` the kernel drops if the writer
  dies), with the holder's pid in the file for the error message.
* ``load_slot_state`` — the whole index read in one snapshot and turned into the owner's
  tables: key → slot, per-slot record fields (plain lists: a million small objects would make
  reopening slow), free slots, and keys oldest-access-first for the policy. Records beyond a
  shrunk capacity, and slots claimed by two keys, are dropped (never trusted).
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tiering.backends.index import Index

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
    fd = os.open(folder / "writer.lock", os.O_RDWR | os.O_CREAT, 0o600)
    for attempt in range(10):  # a tool may hold the lock for a moment to test it: retry briefly
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt < 9:
                time.sleep(0.1)
    else:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise NamespaceLocked(f"{folder}: namespace is already open for writing by pid {holder}; "
                              "one writer per namespace (read-only tools may run alongside)"
                              ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd




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


def load_slot_state(index: Index, n_slots: int, folder: Path) -> SlotState:
    # Millions of new objects would trigger repeated full garbage collections for nothing
    # (none of them can be cyclic garbage yet): pause the collector while loading.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _load(index, n_slots, folder)
    finally:
        if enabled:
            gc.enable()


def _load(index: Index, n_slots: int, folder: Path) -> SlotState:
    keys, recs = index.load_all()
    slots = recs["slot"] if len(recs) else np.empty(0, np.uint64)
    bad = slots >= n_slots  # capacity shrank
    uniq, counts = np.unique(slots, return_counts=True)
    dup = np.isin(slots, uniq[counts > 1])  # never trust a slot claimed twice
    drop = [keys[i] for i in np.nonzero(bad | dup)[0]]
    if drop:
        log.warning("%s: dropping %d index entries (beyond capacity or sharing a slot)",
                    folder, len(drop))
        index.publish([], [], drop_keys=drop)
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
    free = np.nonzero(~ready)[0][::-1].tolist()  # pop() hands out low slots first
    return SlotState(dict(zip(ordered_keys, slot_list.tolist(), strict=True)), free,
                     ready=ready.tolist(), ordered_keys=ordered_keys,
                     reused=(r["hits"] > 0).tolist(), **columns)


def announce(tier: Any) -> None:
    """Say who writes this namespace and how: ``writer.json`` (read by ``tiering inspect``)
    and one log line."""
    from tiering.backends.namespace import write_json

    cfg = tier.cfg
    write_json(tier.folder / "writer.json", {
        "pid": os.getpid(), "opened": time.time(), "engine": tier.engine.describe(),
        "capacity_bytes": tier.capacity, "slots": tier.n_slots, "policy": cfg.policy,
        "store_threshold": cfg.store_threshold, "compression": cfg.compression,
        "verify": cfg.verify, "sparse_slabs": tier.slabs.sparse})
    log.info("file tier %s: %d slots of %d bytes, %d resident, engine %s, policy %s, "
             "store_threshold %d", tier.folder, tier.n_slots, tier.row_bytes,
             len(tier.entries), tier.engine.describe(), cfg.policy, cfg.store_threshold)
