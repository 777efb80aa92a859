"""Helpers of the fault suite (tests/test_faults_*.py): CLI runs in their own process, the
one-line rule for tool errors, seeded damage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``tiering ARGS`` in its own process: a crash (SIGBUS, SIGSEGV) cannot hide in pytest's."""
    return subprocess.run([sys.executable, "-m", "tiering.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def assert_tool_ok(proc: subprocess.CompletedProcess, allowed=(0, 1, 2)) -> None:
    """Every tool ends with an exit code it documents and at most one line on stderr."""
    err = proc.stderr.strip()
    assert proc.returncode in allowed, (proc.args, proc.returncode, err[-2000:])
    assert "Traceback" not in err, (proc.args, err[-2000:])
    assert len(err.splitlines()) <= 1, (proc.args, err[-2000:])
    if proc.returncode != 0:  # verify reports what it found on stdout, errors go to stderr
        assert err or proc.stdout.strip(), (proc.args, "failed without saying why")


def tree_bytes(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a folder's 'dir' (LMDB's lock file changes
    with every reader: not content)."""
    import hashlib

    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link"
        elif p.is_dir():
            out[rel] = "dir"
        elif p.name != "lock.mdb":
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def make_format_1_namespace(root: Path, model: str = "tiny", rows: int = 3) -> Path:
    """A namespace exactly as format 1 wrote it (before slot checksums were seeded by the
    namespace): its meta.json fields, folder name (the facts hashed with format version 1),
    writer.lock, writer.json, an LMDB index with records, slab files and a replied request."""
    import json
    import os
    import time

    import lmdb
    from tierutil import ROW, facts

    f = facts(model=model)
    ns = f.id_for(1)
    folder = root / ns
    folder.mkdir(parents=True, mode=0o700)
    meta = {"namespace": ns, **f.identity(1), "created": time.time(), "element_bytes": 2,
            "hash_algo": "sha256", "restart_safe": True}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    (folder / "writer.lock").write_text(f"{os.getpid()}\n")
    (folder / "writer.json").write_text(json.dumps({"pid": 1, "policy": "lru", "slots": 8}))
    env = lmdb.open(str(folder / "index.lmdb"), max_dbs=4, map_size=1 << 22, subdir=True)
    with env.begin(write=True) as txn:
        records = env.open_db(b"records", txn=txn)
        env.open_db(b"reserved", txn=txn)
        stats = env.open_db(b"stats", txn=txn)
        for i in range(rows):
            txn.put(bytes([i]) * 36, i.to_bytes(8, "little") + bytes(36), db=records)
        txn.put(b"stores", rows.to_bytes(8, "little"), db=stats)
    env.close()
    for i in range(2):
        (folder / f"slab-{i:04d}.dat").write_bytes(os.urandom(4 * ROW))
    (folder / "requests").mkdir(mode=0o700)
    (folder / "requests" / "0123456789ab.done").write_text('{"removed_entries": 0}')
    return folder
