"""The LMDB index of a file-tier namespace: key -> slot record, reservations, counters.

Databases inside ``index.lmdb/``:

* ``records``  — chunk key (bytes) -> :data:`RECORD` (44 bytes, little-endian, fixed layout):
  slot, stored length, codec, flags, checksum (xxh3-64 of the stored bytes, seeded by key and
  namespace: ``checksum.py``), created, last access, hit count. Never pickle: a record is plain numbers, so a hostile cache folder cannot make us
  run code.
* ``reserved`` — slot (u64 big-endian) -> owner pid (u32): slots being written and not yet
  published. A crash leaves them here; the next writer reclaims those of dead owners.
* ``stats``    — counter name -> u64, persisted so ``tiering stats`` can read them offline.

LMDB gives us crash-safe transactions and MVCC: read-only openers (the CLI) see a consistent
snapshot and never block the writer. A killed reader leaves its slot in LMDB's reader table and
would pin its snapshot forever (every page freed since then stays unusable until the map is
full); the writer clears dead readers when it opens and then periodically
(``clear_stale_readers``).

The index is rebuildable state, and LMDB trusts its files: a data.mdb shorter than the pages
its meta pages reference is a SIGBUS on first touch, a damaged tree an ``lmdb.Error``.
So ``check_data_file`` (``index_file_check.py``) validates the meta pages before anything is
mapped, every LMDB error is turned into :class:`IndexDamaged`, and the writer
(``Index.open_for_writer``) scans the whole index once at open and rewrites it into a fresh
environment (so damage the scan cannot see never survives an open); a damaged one is set aside
(``index.lmdb.damaged-<time>-<pid>``) and the tier starts empty, with one log line and the
``index_resets`` counter. Slot checksums are bound to their key, so no damage to the index can
make a key read another key's bytes. The env is opened with ``metasync=False``: a system crash
may lose the last committed transaction but never corrupts the tree; the writer forces a full
sync where losing a transaction would matter (before reusing an evicted slot).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import stat
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb
import numpy as np

from tiering.backends.index_file_check import INDEX_TABLES, check_data_file

RECORD = np.dtype([
    ("slot", "<u8"), ("length", "<u4"), ("codec", "u1"), ("flags", "u1"), ("_pad", "<u2"),
    ("checksum", "<u8"), ("created", "<f8"), ("last_access", "<f8"), ("hits", "<u4"),
])
RECORD_SIZE = RECORD.itemsize  # 44
_RECORD = struct.Struct("<QIBBHQddI")
assert _RECORD.size == RECORD_SIZE
MAX_KEY_BYTES = 511  # LMDB's default key limit

log = logging.getLogger(__name__)

INDEX_DIR = "index.lmdb"


class IndexDamaged(RuntimeError):
    """The index cannot be used as it is (damaged, truncated, half-created, not ours).

    The writer sets it aside and starts empty; read-only tools report it (CLI exit 1)."""


_FALLOC_FL_KEEP_SIZE = 1


def _fallocate_keep_size(fd: int, offset: int, length: int) -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return -1
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return int(fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length))


def pack_record(slot: int, length: int, codec: int, checksum: int, created: float,
                last_access: float, hits: int, flags: int = 0) -> bytes:
    return _RECORD.pack(slot, length, codec, flags, 0, checksum, created, last_access, hits)


#: an index record: (slot, length, codec, flags, checksum, created, last_access, hits)
Record = tuple[int, int, int, int, int, float, float, int]


def unpack_record(value: bytes) -> Record:
    """(slot, length, codec, flags, checksum, created, last_access, hits)."""
    slot, length, codec, flags, _, checksum, created, last_access, hits = _RECORD.unpack(value)
    return slot, length, codec, flags, checksum, created, last_access, hits


LOCK_FILE_BYTES = 64 << 10  # LMDB needs ~8 KiB for 126 reader slots; it never shrinks it


def prepare_lock_file(env_dir: Path) -> None:
    """Create LMDB's lock file with its blocks allocated. LMDB writes it through a shared
    mapping: on a full filesystem a sparse lock file is a SIGBUS, not an error. OSError
    (ENOSPC) here instead."""
    path = env_dir / "lock.mdb"
    if os.path.lexists(path):
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


ENV_FILES = ("data.mdb", "lock.mdb")  # all LMDB writes in an environment folder (subdir=True)


def remove_env_dir(env_dir: Path) -> bool:
    """Remove an LMDB environment folder this writer made (a rebuild's ``.new``/``.old``/
    ``.tmp-PID``): its two files, then the folder if that emptied it. Never a recursive delete:
    anything else in it (not ours) stays, and so does the folder (logged). True if it is gone."""
    try:
        dfd = os.open(env_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError as exc:  # a link or a file where our folder should be: not ours, keep it
        log.warning("%s: not removing it (%s)", env_dir, exc.strerror or exc)
        return False
    try:
        for name in ENV_FILES:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(name, dir_fd=dfd).st_mode):
                    os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        os.rmdir(env_dir)
    except OSError as exc:
        log.warning("%s: left in place, it holds files vllm-tiering did not write (%s)",
                    env_dir, exc.strerror or exc)
        return False
    return True


def _finish_swap(folder: Path) -> None:
    """Complete or undo a rebuild that a crash interrupted (see ``_rebuild``)."""
    path, new, old = folder / INDEX_DIR, folder / f"{INDEX_DIR}.new", folder / f"{INDEX_DIR}.old"
    if os.path.isdir(new) and not os.path.islink(new):
        if os.path.lexists(path):
            remove_env_dir(new)  # the swap had not started: the old index is current
        else:
            os.rename(new, path)
    for stale in folder.glob(f"{INDEX_DIR}.tmp-*"):
        if re.fullmatch(rf"{re.escape(INDEX_DIR)}\.tmp-\d+", stale.name):  # a rebuild's, not a
            remove_env_dir(stale)  # look-alike (foreign names are allowed in the folder)
    if os.path.isdir(old) and not os.path.islink(old):
        remove_env_dir(old)


def _rebuild(folder: Path, map_size: int, tables: dict[str, tuple[list[bytes], list[bytes]]]
             ) -> None:
    """Write ``tables`` into a fresh environment and make it the index.

    Built in ``index.lmdb.tmp-<pid>``, synced, renamed to ``index.lmdb.new``; then the old one
    moves to ``index.lmdb.old`` and the new one into place. ``_finish_swap`` completes a swap
    that a crash cut short, so there is always exactly one index.
    """
    tmp = folder / f"{INDEX_DIR}.tmp-{os.getpid()}"
    remove_env_dir(tmp)
    tmp.mkdir(mode=0o700)
    try:
        prepare_lock_file(tmp)
        env = lmdb.open(str(tmp), map_size=map_size, max_dbs=4, metasync=False, sync=False,
                        mode=0o600, subdir=True, lock=True)
        try:
            with env.begin(write=True) as txn:
                for name, (keys, values) in tables.items():
                    db = env.open_db(name.encode(), txn=txn, create=True)
                    txn.cursor(db=db).putmulti(zip(keys, values, strict=True), append=True)
            env.sync(True)
        finally:
            env.close()
        os.rename(tmp, folder / f"{INDEX_DIR}.new")
    except BaseException:
        remove_env_dir(tmp)
        raise
    os.rename(folder / INDEX_DIR, folder / f"{INDEX_DIR}.old")
    os.rename(folder / f"{INDEX_DIR}.new", folder / INDEX_DIR)
    remove_env_dir(folder / f"{INDEX_DIR}.old")


def _slot_key(slot: int) -> bytes:
    return slot.to_bytes(8, "big")


class Index:
    """One LMDB environment. Writes come from one thread (the tier's committer)."""

    def __init__(self, folder: Path, map_size: int, readonly: bool = False,
                 records: tuple[list[bytes], list[bytes]] | None = None) -> None:
        """``records``: the records table as already read (keys, values), so that the first
        ``load_all`` does not read it again (the writer's open has just scanned it)."""
        self.path = folder / INDEX_DIR
        self._snapshot = records
        if os.path.islink(self.path) or (self.path.exists() and not self.path.is_dir()):
            raise IndexDamaged(f"{self.path}: not a folder (a link or a file); refusing it")
        if not readonly:
            self.path.mkdir(mode=0o700, exist_ok=True)
        elif not self.path.is_dir():
            raise IndexDamaged(f"{self.path}: no index yet (its writer died during its first "
                               "open?); open it with a writer to start it")
        for name in ("data.mdb", "lock.mdb"):
            if os.path.islink(self.path / name):
                raise IndexDamaged(f"{self.path / name}: is a link; refusing it")
        # the lock file first: the check may walk the index with LMDB in a child, which would
        # otherwise create a sparse one (on a full disk: a SIGBUS there, read as truncation)
        try:
            prepare_lock_file(self.path)
        except FileExistsError:
            pass  # another process created it meanwhile
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: cannot create the index lock file "
                          f"({exc.strerror})") from None
        problem = check_data_file(self.path / "data.mdb")
        if problem:
            raise IndexDamaged(f"{self.path}: {problem}")
        try:
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4,
                                 readonly=readonly, metasync=False, mode=0o600, subdir=True,
                                 lock=True)
        except lmdb.Error as exc:
            raise IndexDamaged(f"{self.path}: cannot open ({exc})") from None
        try:
            self.records, self.reserved, self.stats = (
                self.env.open_db(name, create=not readonly) for name in INDEX_TABLES)
        except lmdb.NotFoundError:
            self.env.close()
            raise IndexDamaged(f"{self.path}: has no tables yet (its writer died during its "
                               "first open?); open it with a writer to start it") from None
        except lmdb.Error as exc:
            self.env.close()
            raise IndexDamaged(f"{self.path}: damaged ({exc})") from None

    @classmethod
    def open_for_writer(cls, folder: Path, map_size: int) -> Index:
        """The writer's index, checked end to end and rebuilt; a damaged one is set aside.

        Only the lock holder calls this. The scan reads every record, reservation and counter
        (the records are kept for the first ``load_all``), so damage in the trees shows up
        here. LMDB keeps no page checksums, so damage the scan cannot see (its free-page list,
        page headers) would surface later, in a commit or as an LMDB assertion that aborts the
        process; so the scanned entries are written into a fresh environment that replaces the
        old one (sorted appends: ~0.4 s per million entries). If that cannot be done for lack
        of room (a full disk), the scanned index is used as it is; if an entry cannot be
        written again (damage the scan read past), the index is damaged.
        """
        _finish_swap(folder)
        try:
            index = cls(folder, map_size)
        except IndexDamaged as exc:
            reason = str(exc)
        else:
            try:
                tables = index.scan()
                index.close()
                try:
                    _rebuild(folder, map_size, tables)
                except (OSError, lmdb.DiskError, lmdb.MapFullError) as exc:
                    # no room for the copy: the scanned index is the best there is
                    log.warning("%s: cannot rebuild the index (%s); using it as it is",
                                folder, exc)
                except lmdb.KeyExistsError:  # keys out of order: damaged
                    raise IndexDamaged(f"{folder / INDEX_DIR}: keys out of order") from None
                except lmdb.Error as exc:
                    # an entry LMDB will not store again (a flipped key length: a key empty
                    # or too long) is damage the scan read past; the old environment holds
                    # more of it, which its next reads or commits meet
                    raise IndexDamaged(f"{folder / INDEX_DIR}: cannot be rebuilt "
                                       f"({exc})") from None
                index = cls(folder, map_size, records=tables["records"])
                index.clear_stale_readers()
                return index
            except IndexDamaged as exc:
                with contextlib.suppress(lmdb.Error):
                    index.close()
                reason = str(exc)
        path = folder / INDEX_DIR
        aside = folder / f"{INDEX_DIR}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        if os.path.lexists(path):
            os.rename(path, aside)
        log.warning("%s: index damaged (%s); set aside as %s and starting with an empty index "
                    "(stored rows become unreachable and their slots are reused)",
                    folder, reason, aside.name)
        index = cls(folder, map_size)
        index.publish([], [], stat_delta={"index_resets": 1})
        return index

    def reserve_headroom(self, extra: int = 16 << 20) -> None:
        """Reserve disk blocks past the end of data.mdb without growing it (fallocate
        KEEP_SIZE), so that the index can keep committing when the filesystem fills up (the
        slabs are preallocated; LMDB grows its file page by page). Best effort."""
        path = self.path / "data.mdb"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            want = min(max(extra, size // 4), max(0, self.env.info()["map_size"] - size))
            while want >= 256 << 10:  # a nearly full disk: take what there is
                if _fallocate_keep_size(fd, size, want) == 0:
                    return
                if ctypes.get_errno() != errno.ENOSPC:
                    log.info("%s: cannot reserve headroom for the index (%s)", path,
                             os.strerror(ctypes.get_errno()))
                    return
                want //= 2
        finally:
            os.close(fd)

    def scan(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        """Read every entry of every table once; IndexDamaged on anything malformed."""
        tables = {}
        with self._reading(), self.env.begin(buffers=False) as txn:
            for name, db in (("records", self.records), ("reserved", self.reserved),
                             ("stats", self.stats)):
                keys = list(txn.cursor(db=db).iternext(keys=True, values=False))
                values = list(txn.cursor(db=db).iternext(keys=False, values=True))
                tables[name] = (keys, values)
        keys, values = tables["records"]
        if len(keys) != len(values) or (values and set(map(len, values)) != {RECORD_SIZE}):
            raise IndexDamaged(f"{self.path}: records of the wrong size")
        keys, values = tables["reserved"]
        if any(len(k) != 8 for k in keys) or any(len(v) != 4 for v in values):
            raise IndexDamaged(f"{self.path}: a malformed reservation")
        keys, values = tables["stats"]
        if any(len(v) != 8 for v in values) or not all(k.isascii() for k in keys):
            raise IndexDamaged(f"{self.path}: a malformed counter")
        return tables

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Any LMDB error while reading means the index is damaged: say which index."""
        try:
            yield
        except lmdb.Error as exc:
            raise IndexDamaged(f"{self.path}: damaged ({exc})") from None

    def clear_stale_readers(self) -> int:
        """Free reader slots of dead processes (a tool killed mid-read); returns how many."""
        try:
            return self.env.reader_check()
        except lmdb.Error as exc:
            log.warning("%s: clearing stale readers failed: %s", self.path, exc)
            return 0

    def close(self) -> None:
        self.env.close()

    # -- reads -------------------------------------------------------------------------------
    def load_all(self) -> tuple[list[bytes], np.ndarray]:
        """Every (key, record) in one snapshot; records as a structured array (fast reopen)."""
        if self._snapshot is not None:  # the writer's open scan already read them
            (keys, values), self._snapshot = self._snapshot, None
        else:
            with self._reading(), self.env.begin(db=self.records, buffers=False) as txn:
                keys = list(txn.cursor().iternext(keys=True, values=False))
                values = list(txn.cursor().iternext(keys=False, values=True))
            if values and set(map(len, values)) != {RECORD_SIZE}:
                raise IndexDamaged(f"{self.path}: records of the wrong size")
        if not keys:
            return [], np.empty(0, RECORD)
        return keys, np.frombuffer(b"".join(values), dtype=RECORD)

    def get(self, key: bytes) -> Record | None:
        with self._reading(), self.env.begin(db=self.records) as txn:
            v = txn.get(key)
            if v is not None and len(v) != RECORD_SIZE:
                raise IndexDamaged(f"{self.path}: a record of the wrong size")
            return unpack_record(v) if v is not None else None

    def iter_records(self) -> Iterator[tuple[bytes, Record]]:
        with self._reading(), self.env.begin(db=self.records) as txn:
            for k, v in txn.cursor():
                if len(v) != RECORD_SIZE:
                    raise IndexDamaged(f"{self.path}: a record of the wrong size")
                yield k, unpack_record(v)

    def count(self) -> int:
        with self._reading(), self.env.begin(db=self.records) as txn:
            return txn.stat(self.records)["entries"]

    def reservations(self) -> dict[int, int]:
        with self._reading(), self.env.begin(db=self.reserved) as txn:
            return {int.from_bytes(k, "big"): int.from_bytes(v, "little") for k, v in txn.cursor()}

    def read_stats(self) -> dict[str, int]:
        """The persisted counters, by their flat registry names (``tiering.stats``)."""
        from tiering.stats import from_persisted

        out: dict[str, int] = {}
        with self._reading(), self.env.begin(db=self.stats) as txn:
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

    def clear(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self.records, delete=False)
            txn.drop(self.reserved, delete=False)
