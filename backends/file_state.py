"""The file tier's writer: the one-writer lock around a namespace, and what it announces.

* ``acquire_writer_lock`` — the one-writer rule (an ``flock`` on the namespace folder that the
  kernel drops if the writer dies), with the holder's pid in ``writer.lock`` for messages.
* ``announce`` — who writes this namespace and how (``writer.json``, one log line).
* ``load_advisor_state`` / ``save_advisor_state`` — what the promotion advisor measured on this
  tier (``advisor.json``), so that a restarted engine decides its first disk hits as the last
  one would have; ``AdvisorStateKeeper`` writes it while serving, off the scheduler thread.

(The in-memory slot table rebuilt from the index at open is ``slot_table.py``.)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiering.backends.namespace import NamespaceError, hard_link_problem, load_json

log = logging.getLogger(__name__)

class NamespaceLocked(RuntimeError):
    """Another process is the writer of this namespace."""


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
        links = os.fstat(lock).st_nlink
        if links != 1:  # never truncate a file that has another name (someone's file)
            raise NamespaceError(hard_link_problem(path, path.name, links))
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


ADVISOR_FILE = "advisor.json"
# advisor.json's marker and the most of it read (a few hundred bytes are written)
ADVISOR_MAGIC = "vllm-tiering advisor state"
_ADVISOR_MAX_BYTES = 64 << 10


def load_advisor_state(folder: Path) -> dict[str, Any] | None:
    """``advisor.json`` as the last writer saved it, or None: none there, or not one of ours
    (no marker, unreadable, too large, a link: one warning naming the file). Its values are
    checked by the advisor (``PromotionAdvisor.restore_tier``)."""
    path = folder / ADVISOR_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s: not read (%s); the promotion advisor measures afresh", path, exc)
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(_ADVISOR_MAX_BYTES + 1)
        if len(data) > _ADVISOR_MAX_BYTES:
            raise ValueError(f"larger than {_ADVISOR_MAX_BYTES} bytes")
        state = load_json(data)
        if not isinstance(state, dict) or state.get("magic") != ADVISOR_MAGIC:
            raise ValueError(f"expected an object with \"magic\": \"{ADVISOR_MAGIC}\"")
    except (OSError, ValueError) as exc:
        log.warning("%s: ignored (%s); the promotion advisor measures afresh", path, exc)
        return None
    return state


def save_advisor_state(folder: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (JSON values) as ``advisor.json``, atomically (never through a link);
    a failure is logged, never raised: the next engine measures afresh."""
    from tiering.backends.namespace import write_json

    try:
        write_json(folder / ADVISOR_FILE, {**state, "magic": ADVISOR_MAGIC})
    except (OSError, ValueError, TypeError) as exc:
        log.warning("%s: cannot save the promotion advisor's state (%s)", folder, exc)


class AdvisorStateKeeper:
    """``advisor.json`` kept while serving: the scheduler thread hands the latest state over
    (``offer``, never waiting for a write), the tier's committer thread writes it between jobs
    (``write_offer``), and the shutdown's ``save`` replaces any offer not yet written. vLLM's
    server force-kills its engine core on SIGTERM: a state saved only at shutdown was lost.
    The offer lock guards only the hand-over; the write lock orders the two writers."""

    def __init__(self, folder: Path, closed: Callable[[], bool]) -> None:
        self.folder = folder
        self._closed = closed  # the tier's: nothing is written once it is closed
        self._offer: dict[str, Any] | None = None
        self._offer_lock = threading.Lock()
        self._write_lock = threading.Lock()

    def offer(self, state: dict[str, Any]) -> None:
        with self._offer_lock:
            self._offer = state

    def _take(self) -> dict[str, Any] | None:
        with self._offer_lock:
            state, self._offer = self._offer, None
        return state

    def write_offer(self) -> None:
        """Committer thread: write the state last offered, if any."""
        with self._write_lock:
            state = self._take()
            if state is not None and not self._closed():
                save_advisor_state(self.folder, state)

    def save(self, state: dict[str, Any]) -> None:
        """At shutdown: ``state``, after an offer being written and instead of one pending."""
        with self._write_lock:
            self._take()
            if not self._closed():
                save_advisor_state(self.folder, state)


def announce(tier: Any) -> None:
    """Say who writes this namespace and how: ``writer.json`` (read by ``tiering inspect``)
    and one log line."""
    from tiering.backends.namespace import write_json

    cfg = tier.cfg
    try:
        write_json(tier.folder / "writer.json", {
            "pid": os.getpid(), "opened": time.time(), "engine": tier.io.describe(),
            "capacity_bytes": tier.capacity, "slots": tier.n_slots, "policy": cfg.policy,
            "store_threshold": cfg.store_threshold, "compression": cfg.compression,
            "verify": cfg.verify, "sparse_slabs": tier.slabs.sparse})
    except OSError as exc:  # a full disk must not stop a restart: it is only for display
        log.warning("%s: cannot write writer.json (%s)", tier.folder, exc)
    log.info("file tier %s: %d slots of %d bytes, %d resident, I/O %s, policy %s, "
             "store_threshold %d", tier.folder, tier.n_slots, tier.row_bytes,
             len(tier), tier.io.describe(), cfg.policy, cfg.store_threshold)
