"""The LMDB index of a file-tier namespace: key -> slot record, reservations, counters.

Databases inside ``index.lmdb/``:

* ``records``  — chunk key (bytes) -> :data:`RECORD` (44 bytes, little-endian, fixed layout):
  slot, stored length, codec, flags, checksum (xxh3-64 of the stored bytes), created, last access,
  hit count. Never pickle: a record is plain numbers, so a hostile cache folder cannot make us
  run code.
* ``reserved`` — slot (u64 big-endian) -> owner pid (u32): slots being written and not yet
  published. A crash leaves them here; the next writer reclaims those of dead owners.
* ``stats``    — counter name -> u64, persisted so ``tiering stats`` can read them offline.

LMDB gives us crash-safe transactions and MVCC: read-only openers (the CLI) see a consistent
snapshot and never block the writer. The env is opened with ``metasync=False``: a system crash
may lose the last committed transaction but never corrupts the tree; the writer forces a full
sync where losing a transaction would matter (before reusing an evicted slot).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb
import numpy as np

RECORD = np.dtype([
    ("slot", "<u8"), ("length", "<u4"), ("codec", "u1"), ("flags", "u1"), ("_pad", "<u2"),
    ("checksum", "<u8"), ("created", "<f8"), ("last_access", "<f8"), ("hits", "<u4"),
])
RECORD_SIZE = RECORD.itemsize  # 44
_RECORD = struct.Struct("<QIBBHQddI")
assert _RECORD.size == RECORD_SIZE
MAX_KEY_BYTES = 511  # LMDB's default key limit



def pack_record(slot: int, length: int, codec: int, checksum: int, created: float,
                last_access: float, hits: int, flags: int = 0) -> bytes:
    return _RECORD.pack(slot, length, codec, flags, 0, checksum, created, last_access, hits)


def unpack_record(value: bytes) -> tuple:
    """(slot, length, codec, flags, checksum, created, last_access, hits)."""
    slot, length, codec, flags, _, checksum, created, last_access, hits = _RECORD.unpack(value)
    return slot, length, codec, flags, checksum, created, last_access, hits


def _slot_key(slot: int) -> bytes:
    return slot.to_bytes(8, "big")


class Index:
    """One LMDB environment. Writes come from one thread (the tier's committer)."""

    def __init__(self, folder: Path, map_size: int, readonly: bool = False) -> None:
        self.path = folder / "index.lmdb"
        if not readonly:
            self.path.mkdir(mode=0o700, exist_ok=True)
        elif not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no index (not a vllm-tiering namespace?)")
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4, readonly=readonly,
                             metasync=False, mode=0o600, subdir=True, lock=True)
        self.records = self.env.open_db(b"records", create=not readonly)
        self.reserved = self.env.open_db(b"reserved", create=not readonly)
        self.stats = self.env.open_db(b"stats", create=not readonly)

    def close(self) -> None:
        self.env.close()

    # -- reads -------------------------------------------------------------------------------
    def load_all(self) -> tuple[list[bytes], np.ndarray]:
        """Every (key, record) in one snapshot; records as a structured array (fast reopen)."""
        with self.env.begin(db=self.records, buffers=False) as txn:  # one snapshot, two passes
            keys = list(txn.cursor().iternext(keys=True, values=False))
            values = list(txn.cursor().iternext(keys=False, values=True))
        if not keys:
            return [], np.empty(0, RECORD)
        return keys, np.frombuffer(b"".join(values), dtype=RECORD)

    def get(self, key: bytes) -> tuple | None:
        with self.env.begin(db=self.records) as txn:
            v = txn.get(key)
        return unpack_record(v) if v is not None else None

    def iter_records(self) -> Iterator[tuple[bytes, tuple]]:
        with self.env.begin(db=self.records) as txn:
            for k, v in txn.cursor():
                yield k, unpack_record(v)

    def count(self) -> int:
        with self.env.begin(db=self.records) as txn:
            return txn.stat(self.records)["entries"]

    def reservations(self) -> dict[int, int]:
        with self.env.begin(db=self.reserved) as txn:
            return {int.from_bytes(k, "big"): int.from_bytes(v, "little") for k, v in txn.cursor()}

    def read_stats(self) -> dict[str, int]:
        """The persisted counters, by their flat registry names (``tiering.stats``)."""
        from tiering.stats import from_persisted

        out: dict[str, int] = {}
        with self.env.begin(db=self.stats) as txn:
            for k, v in txn.cursor():
                out[k.decode(errors="replace")] = int.from_bytes(v, "little")
        return from_persisted(out)

    # -- writes (committer thread only) -----------------------------------------------------
    def reserve(self, slots: Iterable[int], drop_keys: Iterable[bytes], pid: int,
                durable: bool) -> None:
        """One txn: delete evicted/dropped keys and mark ``slots`` reserved by ``pid``.

        ``durable`` forces the commit to disk before returning: needed when a slot that a
        deleted key pointed at is about to be overwritten.
        """
        owner = pid.to_bytes(4, "little")
        with self.env.begin(write=True) as txn:
            for key in drop_keys:
                txn.delete(key, db=self.records)
            for slot in slots:
                txn.put(_slot_key(slot), owner, db=self.reserved)
        if durable:
            self.env.sync(True)

    def publish(self, records: Iterable[tuple[bytes, bytes]], release: Iterable[int],
                drop_keys: Iterable[bytes] = (), stat_delta: dict[str, int] | None = None) -> None:
        """One txn: publish records, clear reservations, drop keys, add to counters."""
        with self.env.begin(write=True) as txn:
            for key in drop_keys:
                txn.delete(key, db=self.records)
            for key, value in records:
                txn.put(key, value, db=self.records)
            for slot in release:
                txn.delete(_slot_key(slot), db=self.reserved)
            if stat_delta:
                for name, delta in stat_delta.items():
                    if delta:
                        k = name.encode()
                        old = txn.get(k, db=self.stats)
                        base = int.from_bytes(old, "little") if old else 0
                        txn.put(k, (base + delta).to_bytes(8, "little"), db=self.stats)

    def reclaim_reservations(self) -> list[int]:
        """Drop every reservation; returns the freed slots.

        Only the writer calls this, right after taking the namespace lock: holding the lock
        proves that whoever made these reservations is gone (a crash mid-write), so their
        half-written slots are free again. No record points at them, so nothing is lost.
        """
        stale = list(self.reservations())
        if stale:
            with self.env.begin(write=True, db=self.reserved) as txn:
                for slot in stale:
                    txn.delete(_slot_key(slot))
        return stale

    def drop_slots_from(self, n_slots: int) -> list[bytes]:
        """Delete records whose slot is >= n_slots (capacity shrank); returns their keys."""
        gone = [k for k, rec in self.iter_records() if rec[0] >= n_slots]
        if gone:
            with self.env.begin(write=True, db=self.records) as txn:
                for k in gone:
                    txn.delete(k)
        return gone

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self.records, delete=False)
            txn.drop(self.reserved, delete=False)
