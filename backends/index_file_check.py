"""Is an LMDB ``data.mdb`` safe to map? Checked before anything opens an index.

LMDB maps the file and touches the pages its B-tree references: a file shorter than that is a
SIGBUS in whatever process reads it, which no ``except`` can catch. ``check_data_file`` reads
the two meta pages with ``pread`` (never a mapping): they must be LMDB's, and the file must reach
the last page they name. A healthy file may end before that page (a transaction's last pages can
be freed again before commit and are then never written), so a file that looks short is walked
by LMDB itself in a child process: a SIGBUS there means truncated, a clean walk means healthy.
The child also opens a copy of it as the writer opens an index (read-write, its tables created
where missing): that reaches pages a read-only walk never does (LMDB's free list, read when a
write transaction allocates a page). Used by ``backends/index.py`` (every open, writer and
readers alike).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from tiering.settings import INDEX_WALK_TIMEOUT_S

# LMDB's meta pages (pages 0 and 1): a 16-byte page header, then MDB_meta: magic u32,
# version u32, address, map size, two MDB_db of 48 bytes (the first one's leading u32 holds the
# page size), last used page number, transaction id.
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_META_HEAD = struct.Struct("<IIQQ")  # at offset 16
_META_PSIZE = struct.Struct("<I")  # at offset 40
_META_TAIL = struct.Struct("<QQ")  # last page, txn id: at offset 136
# The index's tables (``backends/index.py`` opens them by these names)
INDEX_TABLES = (b"records", b"reserved", b"stats")


def check_data_file(path: Path) -> str | None:
    """Why ``data.mdb`` cannot be mapped safely, or None (also None when it does not exist).

    LMDB maps the file and touches pages its B-tree references: a file shorter than that is a
    SIGBUS in whatever process reads it, which no ``except`` can catch. Checked before opening:
    the meta pages must be LMDB's, and the file must reach the last page they name. A healthy
    file may end before that page (a transaction's last pages can be freed again before commit
    and never written), so a file that looks short is walked by LMDB itself in a child process
    (``_walk_in_child``): a SIGBUS there means truncated, a clean walk means healthy.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is not a regular file"
    if st.st_size == 0:
        return f"{path.name} is empty (no meta pages)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            first = os.pread(fd, 4096, 0)
            if len(first) < 152:
                return f"{path.name} is {st.st_size} bytes, shorter than a meta page"
            psize = _META_PSIZE.unpack_from(first, 40)[0]
            if psize < 512 or psize > 65536 or psize & (psize - 1):
                return f"{path.name}: meta page 0 names page size {psize}"
            pages = [first, os.pread(fd, 4096, psize)]
            # the size after the meta pages: a writer extends the file before it commits a
            # meta page naming the new pages, and LMDB never shrinks it
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{path.name}: unreadable ({exc})"
    short = None
    for i, page in enumerate(pages):
        if len(page) < 152:
            return f"{path.name} is {size} bytes, shorter than its two meta pages"
        magic, version, _, _ = _META_HEAD.unpack_from(page, 16)
        if magic != _LMDB_MAGIC or version != _LMDB_DATA_VERSION:
            return f"{path.name}: meta page {i} is not an LMDB meta page"
        last_page, _ = _META_TAIL.unpack_from(page, 136)
        if short is None and (last_page + 1) * psize > size:
            short = (f"{path.name} is {size} bytes but meta page {i} uses pages up to "
                     f"{last_page} of {psize} bytes (truncated)")
    if short is None:
        return None
    return _walk_in_child(path.parent, short)


# Opens the environment read-only and reads every key and value of every table: touches every
# page the B-tree references, as any later reader could.
_WALK = """
import sys
sys.path = [p for p in sys.path if p not in ("", ".")]  # never a module planted in the cwd
import lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, subdir=True, lock=True)
with env.begin() as txn:
    for name, _ in list(txn.cursor()):
        try:
            db = env.open_db(name, txn=txn, create=False)
        except lmdb.Error:
            continue
        for _k, _v in txn.cursor(db=db):
            pass
"""


# What the writer does to an index before it has read it all: opens it read-write and creates
# each of its tables that is missing (a committed write transaction: LMDB's page allocation
# reads its free list, which the walk above never touches), then reads every table. Run on a
# copy, so that no check ever writes the index it checks. A 400-trial fault run found a truncated
# file whose walk read clean (a main table of nameless entries) and whose writer died of SIGBUS.
_WRITER_OPEN = """
import sys
sys.path = [p for p in sys.path if p not in ("", ".")]  # never a module planted in the cwd
import lmdb
env = lmdb.open(sys.argv[1], max_dbs=4, subdir=True, lock=True, metasync=False, sync=False)
dbs = [env.open_db(name.encode(), create=True) for name in sys.argv[2:]]
with env.begin() as txn:
    for db in dbs:
        for _k, _v in txn.cursor(db=db):
            pass
"""


def _run_child(script: str, args: list[str], short: str, what: str) -> str | None:
    """Run ``script`` in a child; None if it ended cleanly, ``short`` if it died of SIGBUS,
    else what went wrong."""
    try:
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                              text=True, timeout=INDEX_WALK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{short}; {what} to be sure took over {INDEX_WALK_TIMEOUT_S} s"
    except OSError as exc:
        return f"{short}; could not finish {what} ({exc})"
    if proc.returncode == 0:
        return None
    if proc.returncode == -signal.SIGBUS:
        return short
    last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return f"{short}; {what} failed: {last}"


def _walk_in_child(env_dir: Path, short: str) -> str | None:
    """Walk the index in a child process, then open a copy of it as its writer does; None if
    every page either reaches is readable, else ``short`` (the size check's finding) or what
    went wrong. Only for files that look short (a copy of one costs its size in the system's
    temporary folder; where that fails the index counts as damaged: a SIGBUS kills the
    engine, a reset only empties the cache)."""
    problem = _run_child(_WALK, [str(env_dir)], short, "walking it")
    if problem is not None:
        return problem
    try:
        with tempfile.TemporaryDirectory(prefix="tiering-index-check-") as tmp:
            shutil.copyfile(env_dir / "data.mdb", Path(tmp) / "data.mdb")  # no mapping here
            return _run_child(_WRITER_OPEN, [tmp, *(n.decode() for n in INDEX_TABLES)], short,
                              "opening a copy as its writer does")
    except OSError as exc:
        return f"{short}; could not copy it to open as its writer does ({exc})"
