"""Admin operations on a cache folder (evict, clear), safe while a server is using it.

A namespace has one writer, and only the writer may change its index: its in-memory state
(policy, free slots, pins) must agree with LMDB. So a tool never edits a live namespace behind
the writer's back. Instead:

* if nobody holds the writer lock (``file_state.writer_alive``), the tool becomes the writer
  for a moment (opens the
  namespace, applies the operation through the normal eviction path, closes it);
* if a server holds it, the tool drops a request file in ``<namespace>/requests/``; the writer's
  committer thread picks it up between batches, the owner thread applies it in ``poll()`` like
  any eviction (pinned chunks are skipped), and the committer writes ``<id>.done`` once the
  deletions are committed. The tool waits for that reply.

Operations (JSON): ``{"op": "evict", "bytes": N}`` (by policy order),
``{"op": "evict", "older_than": SECONDS}`` (by last access), ``{"op": "clear"}``.

Before anything, ``run`` proves the folder is a namespace of ours (``ownership.identify``);
anything else is refused (NamespaceError: exit 2), and a format-1 namespace of ours is only ever
cleared, file by file (``ownership.remove_format_1``). ``preview`` answers a dry run from a
read-only snapshot of the index: it never writes, never takes the lock, never asks a writer.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from tiering.backends.admin_ops import apply, check_op
from tiering.backends.file_state import lock_holder, writer_alive
from tiering.backends.namespace import (
    OtherFormatVersion,
    facts_from_meta,
    load_json,
    read_meta,
    read_writer_info,
    write_json,
)
from tiering.backends.ownership import FORMAT_1, Owned, identify, remove_format_1

log = logging.getLogger(__name__)
REQUESTS = "requests"
_DURATION = re.compile(r"^\s*(\d{1,12}(?:\.\d{1,9})?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


MAX_DURATION = 100 * 365 * 86400.0


def parse_duration(text: str) -> float:
    m = _DURATION.match(str(text))
    seconds = float(m.group(1)) * _UNITS[m.group(2)] if m else -1.0
    if not 0 <= seconds <= MAX_DURATION:
        raise ValueError(f"--older-than: expected a duration like 90s, 30m, 12h or 7d (at most "
                         f"100 years), got {text!r:.40}")
    return seconds


def submit_request(folder: Path, op: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Hand an operation to the live writer and wait for its reply.

    On timeout the request is withdrawn if the writer has not taken it yet; one it took but
    did not apply before ``expires`` is never applied (see ``apply_request``).
    """
    op = check_op(op)
    req_dir = folder / REQUESTS
    try:
        req_dir.mkdir(mode=0o700, exist_ok=True)
    except FileExistsError:
        raise RuntimeError(f"{req_dir}: not a folder") from None
    if req_dir.is_symlink():
        raise RuntimeError(f"{req_dir}: is a symbolic link; refusing to write requests there")
    rid = uuid.uuid4().hex[:12]
    request, done = req_dir / f"{rid}.json", req_dir / f"{rid}.done"
    write_json(request, {**op, "expires": time.time() + timeout})
    deadline = time.monotonic() + timeout
    grace = deadline + min(timeout, 10.0)  # a request taken in time: its reply may follow
    while True:
        reply = _read_reply(done)
        if reply is not None:
            return reply
        now = time.monotonic()
        if now >= deadline:
            try:
                request.unlink()
                raise TimeoutError(f"{folder}: the writer (pid {lock_holder(folder)}) did not "
                                   f"take request {rid} within {timeout:g}s; withdrawn, nothing "
                                   "was changed")
            except FileNotFoundError:  # taken: wait a little for its reply
                if now >= grace:
                    raise TimeoutError(f"{folder}: the writer (pid {lock_holder(folder)}) took "
                                       f"request {rid} but did not answer within {timeout:g}s; "
                                       "it is not applied after that") from None
        time.sleep(0.05)


def _read_reply(done: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(done, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            reply = load_json(fh.read(1 << 20))
    except ValueError:
        return None  # never half-written (atomic rename), but never trust it either
    finally:
        done.unlink(missing_ok=True)
    return reply if isinstance(reply, dict) else {"error": f"malformed reply {reply!r:.80}"}


def run_offline(folder: Path, op: dict[str, Any]) -> dict[str, Any]:
    """No live writer: open the namespace as its writer, apply, close.

    Everything comes from the namespace itself: its facts and slab layout from ``meta.json``
    (checked against the folder's name), so the tool reopens it exactly as it was created and
    refuses when the slab files do not match (a writer would resize them). The policy is a
    registered name from ``writer.json`` or LRU: a tool never imports code a cache file names.
    """
    from tiering.backends.file_tier import FileTier
    from tiering.backends.slab import SlabSet
    from tiering.policies import REGISTRY

    meta = read_meta(folder)
    facts = facts_from_meta(meta)
    slots = meta["slots"]
    problem = SlabSet(folder, facts.row_bytes, slots, meta["slab_file_bytes"]).mismatch()
    if problem:
        raise RuntimeError(f"{folder}: {problem}; refusing to change this namespace offline "
                           "(its server repairs it when it opens)")
    policy = _recorded_policy(folder)
    if policy not in REGISTRY:
        policy = "lru"
    cfg = {"path": str(folder.parent), "capacity": slots * facts.row_bytes, "policy": policy,
           "io": "posix", "io_threads": 2, "slab_file_bytes": meta["slab_file_bytes"]}
    tier = FileTier(cfg, facts)
    try:
        reply = apply(tier, op)
        tier.wait_idle()
    finally:
        tier.close()
    return reply


def _recorded_policy(folder: Path) -> str:
    policy = read_writer_info(folder).get("policy", "lru")
    return policy.lower() if isinstance(policy, str) else "lru"


def run(folder: Path, op: dict[str, Any], timeout: float = 30.0,
        dry_run: bool = False) -> dict[str, Any]:
    """Apply ``op`` to the namespace ``folder`` (or, ``dry_run``, say what it would remove).

    NamespaceError (exit 2) unless ``folder`` is proven ours; a format-1 namespace of ours is
    only cleared (never opened), an evict of one is refused."""
    op = check_op(op)
    owned = identify(folder)
    if owned.format_version == FORMAT_1:
        if op["op"] != "clear":
            raise OtherFormatVersion(f"{folder}: a format-1 namespace of vllm-tiering; this "
                                     "version cannot evict from it, only clear it")
        return clear_format_1(owned, dry_run)
    if dry_run:
        return {**preview(folder, op), "via": "dry run"}
    if writer_alive(folder):
        return {**submit_request(folder, op, timeout), "via": "live writer"}
    return {**run_offline(folder, op), "via": "offline"}


def preview(folder: Path, op: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """What ``op`` would remove, from the index as last committed (read-only). A live server
    skips chunks pinned at the moment it applies it, so the real run may remove fewer."""
    from tiering.backends.reader import NamespaceReader

    now = time.time() if now is None else now
    with NamespaceReader(folder) as r:
        _, recs = r.index.load_all()
        row = r.row_bytes
    total = len(recs)
    if op["op"] == "clear":
        n = total
    elif "bytes" in op:
        n = min(total, -(-op["bytes"] // row))
    else:
        n = int((recs["last_access"] < now - op["older_than"]).sum()) if total else 0
    return {"removed_entries": n, "removed_bytes": n * row, "entries": total - n,
            "dry_run": True}


def clear_format_1(owned: Owned, dry_run: bool = False) -> dict[str, Any]:
    """``clear`` of a proven format-1 namespace: nothing in it can be read by this version, so
    the files that version wrote go, one by one (what it did not write stays, named)."""
    done = remove_format_1(owned, dry_run)
    return {"removed_entries": 0, "removed_bytes": 0, "entries": 0,
            "format_version": FORMAT_1, "removed_files": done.removed, "kept": done.kept,
            "folder_removed": done.folder_removed, "dry_run": dry_run,
            "via": "dry run" if dry_run else "offline",
            "note": "namespace of format version 1 " + ("would be removed" if dry_run
                                                         else "removed")}
