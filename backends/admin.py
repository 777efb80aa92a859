"""Admin operations on a cache folder (evict, clear), safe while a server is using it.

A namespace has one writer, and only the writer may change its index: its in-memory state
(policy, free slots, pins) must agree with LMDB. So a tool never edits a live namespace behind
the writer's back. Instead:

* if nobody holds ``writer.lock``, the tool becomes the writer for a moment (opens the
  namespace, applies the operation through the normal eviction path, closes it);
* if a server holds it, the tool drops a request file in ``<namespace>/requests/``; the writer's
  committer thread picks it up between batches, the owner thread applies it in ``poll()`` like
  any eviction (pinned chunks are skipped), and the committer writes ``<id>.done`` once the
  deletions are committed. The tool waits for that reply.

Operations (JSON): ``{"op": "evict", "bytes": N}`` (by policy order),
``{"op": "evict", "older_than": SECONDS}`` (by last access), ``{"op": "clear"}``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from tiering.backends.namespace import NamespaceFacts, read_meta, write_json

log = logging.getLogger(__name__)
REQUESTS = "requests"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"--older-than: expected a duration like 90s, 30m, 12h or 7d, "
                         f"got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def check_op(op: dict[str, Any]) -> dict[str, Any]:
    kind = op.get("op")
    if kind == "clear":
        return {"op": "clear"}
    if kind == "evict":
        if "bytes" in op and int(op["bytes"]) > 0:
            return {"op": "evict", "bytes": int(op["bytes"])}
        if "older_than" in op and float(op["older_than"]) >= 0:
            return {"op": "evict", "older_than": float(op["older_than"])}
    raise ValueError(f"admin request: expected evict (bytes or older_than) or clear, got {op!r}")


def apply(tier: Any, op: dict[str, Any]) -> dict[str, Any]:
    """Apply an operation on the owner thread of a FileTier; returns what was removed."""
    op = check_op(op)
    if op["op"] == "clear":
        removed = tier.clear()
    elif "bytes" in op:
        n = -(-op["bytes"] // tier.row_bytes)
        removed = len(tier.evict(n))
    else:
        removed = tier.clear(last_access_before=time.time() - op["older_than"])
    return {"removed_entries": removed, "removed_bytes": removed * tier.row_bytes,
            "entries": len(tier.entries)}


def apply_request(tier: Any, op: dict[str, Any]) -> dict[str, Any]:
    """A tool's request, applied by the writer's owner thread; errors become the reply."""
    try:
        reply = apply(tier, op)
    except ValueError as exc:
        reply = {"error": str(exc)}
    log.info("file tier %s: admin request %s -> %s", tier.folder, op, reply)
    return reply


def writer_alive(folder: Path) -> bool:
    import fcntl

    path = folder / "writer.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def submit_request(folder: Path, op: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Hand an operation to the live writer and wait for its reply."""
    op = check_op(op)
    req_dir = folder / REQUESTS
    req_dir.mkdir(mode=0o700, exist_ok=True)
    rid = uuid.uuid4().hex[:12]
    write_json(req_dir / f"{rid}.json", op)
    done = req_dir / f"{rid}.done"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done.exists():
            reply = json.loads(done.read_text())
            done.unlink(missing_ok=True)
            return reply
        time.sleep(0.1)
    raise TimeoutError(f"{folder}: the writer (pid in writer.lock) did not answer request "
                       f"{rid} within {timeout:.0f}s")


def run_offline(folder: Path, op: dict[str, Any]) -> dict[str, Any]:
    """No live writer: open the namespace as its writer, apply, close."""
    from tiering.backends.file_tier import FileTier

    meta = read_meta(folder)
    facts = NamespaceFacts(meta["model"], meta["dtype"], meta["layout"], int(meta["row_bytes"]),
                           int(meta["chunk_tokens"]), meta.get("parallel", {}),
                           meta.get("extra", {}))
    slots = sum(p.stat().st_size for p in folder.glob("slab-*.dat")) // facts.row_bytes
    writer = folder / "writer.json"
    policy = json.loads(writer.read_text()).get("policy", "lru") if writer.exists() else "lru"
    cfg = {"path": str(folder.parent), "capacity": slots * facts.row_bytes, "policy": policy,
           "io": "posix", "io_threads": 2}
    tier = FileTier(cfg, facts)
    try:
        reply = apply(tier, op)
        tier.wait_idle()
    finally:
        tier.close()
    return reply


def run(folder: Path, op: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    if writer_alive(folder):
        return {**submit_request(folder, op, timeout), "via": "live writer"}
    return {**run_offline(folder, op), "via": "offline"}
