"""An admin operation (evict, clear) as the writer of a namespace applies it: checked, then run
on the owner thread of its ``FileTier``. The tools' side (request files, waiting for the reply,
the offline writer) is ``admin.py``; this module imports no tier, so the tier can import it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class AdminTarget(Protocol):
    """What an operation needs of the tier it runs on (``FileTier`` is one); called on the
    tier's owner thread only."""

    folder: Path
    row_bytes: int

    def __len__(self) -> int: ...

    def evict(self, n: int) -> list[bytes]: ...

    def clear(self, last_access_before: float | None = None) -> int: ...


def check_op(op: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(op, dict):
        raise ValueError(f"admin request: expected a JSON object, got {op!r:.80}")
    kind = op.get("op")
    out: dict[str, Any] | None = None
    try:
        if kind == "clear":
            out = {"op": "clear"}
        elif kind == "evict" and "bytes" in op and int(op["bytes"]) > 0:
            out = {"op": "evict", "bytes": int(op["bytes"])}
        elif kind == "evict" and "older_than" in op and 0 <= float(op["older_than"]) < 1e12:
            out = {"op": "evict", "older_than": float(op["older_than"])}
        if out is not None and "expires" in op:
            out["expires"] = float(op["expires"])
    except (TypeError, ValueError, OverflowError):
        out = None
    if out is None:
        raise ValueError(f"admin request: expected evict (bytes or older_than) or clear, "
                         f"got {op!r:.200}")
    return out


def apply(tier: AdminTarget, op: dict[str, Any]) -> dict[str, Any]:
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
            "entries": len(tier)}


def apply_request(tier: AdminTarget, op: dict[str, Any]) -> dict[str, Any]:
    """A tool's request, applied by the writer's owner thread; errors become the reply.

    A request carries the time its tool stops waiting (``expires``): later it is answered
    with an error and not applied, so a tool that reported failure changed nothing.
    """
    try:
        expires = check_op(op).get("expires")
        if expires is not None and time.time() > expires:
            reply = {"error": "request expired before the writer reached it; nothing removed"}
        else:
            reply = apply(tier, op)
    except ValueError as exc:
        reply = {"error": str(exc)}
    log.info("file tier %s: admin request %s -> %s", tier.folder, op, reply)
    return reply
