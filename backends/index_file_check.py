"""Is an LMDB ``data.mdb`` safe to map? Checked before anything opens an index.

LMDB maps the file and touches the pages its B-tree references: a file shorter than that is a
SIGBUS in whatever process reads it, which no ``except`` can catch. ``check_data_file`` reads
the two meta pages with ``pread`` (never a mapping): they must be LMDB's, and the file must reach
the last page they name. A healthy file may end before that page (a transaction's last pages can
be freed again before commit and are then never written), so a file that looks short is walked
by LMDB itself in a child process: a SIGBUS there means truncated, a clean walk means healthy.
Used by ``backends/index.py`` (every open, writer and readers alike).
"""

from __future__ import annotations

import os
import signal
import stat
import struct
import subprocess
import sys
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


def _walk_in_child(env_dir: Path, short: str) -> str | None:
    """Walk the index in a child process; None if every referenced page is readable, else
    ``short`` (the size check's finding) or what went wrong. Only for files that look short."""
    try:
        proc = subprocess.run([sys.executable, "-c", _WALK, str(env_dir)], capture_output=True,
                              text=True, timeout=INDEX_WALK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{short}; walking it to be sure took over {INDEX_WALK_TIMEOUT_S} s"
    except OSError as exc:
        return f"{short}; could not walk it ({exc})"
    if proc.returncode == 0:
        return None
    if proc.returncode == -signal.SIGBUS:
        return short
    last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return f"{short}; walking it failed: {last}"
