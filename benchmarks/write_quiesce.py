"""Wait until a process tree has stopped writing files: how a benchmark knows that the
asynchronous stores of a KV tier (a write-down to disk running in vLLM's engine-core process,
whoever's tier it is) are done, instead of guessing from an assumed disk speed.

The measure is the kernel's per-process I/O accounting (``/proc/<pid>/io``): ``wchar`` counts
the bytes every ``write``/``pwrite``/``writev`` call passed, on any file system (a RAM disk
included) and whatever library issued it (our file tier's posix engine, kvikio's compat mode,
vLLM's fs tier). A writer blocked in ``fdatasync`` adds nothing to ``wchar`` while the disk is
still busy, so a quiet window is followed by ``os.sync()`` (which returns once the dirty pages of
every file system are on disk, those of an ``fdatasync`` in progress included) and one more
quiet window: a committer that resumes after its sync shows up there.

Linux only (``/proc``). Called from the benchmark's main thread; it blocks for at most
``max_s`` seconds (plus the last window) and never raises for a process that exits meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class WriteQuiet:
    """What a wait saw: ``quiet`` False means ``max_s`` ran out while the tree still wrote."""

    waited_s: float
    written_bytes: int  # wchar growth of the process tree during the wait
    quiet: bool
    syncs: int  # os.sync() calls made
    unreadable: int = 0  # processes of the tree whose counters this process may not read


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now (by the parent pid in ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def written_bytes(pids: list[int], denied: list[int] | None = None) -> dict[int, int]:
    """``wchar`` of each pid still alive and readable; the pids whose counters the kernel
    refused to show (another user's process, a ptrace restriction) go to ``denied``."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as f:
                for line in f:
                    if line.startswith("wchar:"):
                        out[pid] = int(line.split()[1])
                        break
        except PermissionError:
            if denied is not None:
                denied.append(pid)
        except (OSError, ValueError):  # exited meanwhile
            continue
    return out


def _growth(before: dict[int, int], after: dict[int, int]) -> int:
    """Bytes written between two samples: a pid new in ``after`` counts whole (it started
    meanwhile), a pid gone from ``after`` counts nothing (its last writes are lost to us)."""
    return sum(max(0, n - before.get(pid, 0)) for pid, n in after.items())


def _sync(timeout_s: float) -> bool:
    """``os.sync()`` bounded by ``timeout_s`` (it runs on in a daemon thread past that)."""
    th = threading.Thread(target=os.sync, name="write-quiesce-sync", daemon=True)
    th.start()
    th.join(max(0.0, timeout_s))
    return not th.is_alive()


def wait_for_quiet_writes(root: int | None = None, quiet_bytes: int = 8 << 20,
                          window_s: float = 0.5, max_s: float = 120.0, min_s: float = 0.0,
                          sync: bool = True) -> WriteQuiet:
    """Block until the tree under ``root`` (default: this process) wrote less than
    ``quiet_bytes`` in a window of ``window_s`` seconds (and, with ``sync``, once more in the
    window after an ``os.sync()``), and at least ``min_s`` seconds passed; or until ``max_s``
    seconds passed, which is logged and reported as ``quiet=False``."""
    root = os.getpid() if root is None else root
    t0 = time.monotonic()
    total = syncs = 0
    warned = False
    synced = not sync  # no sync wanted: one quiet window is enough
    last = written_bytes(process_tree(root))
    while True:
        time.sleep(window_s)
        denied: list[int] = []
        now = written_bytes(process_tree(root), denied)
        if denied and not warned:
            warned = True
            logger.warning("cannot read the write counters of processes %s (/proc/<pid>/io): "
                           "their writes are not waited for", denied)
        grew = _growth(last, now)
        total += grew
        last = now
        elapsed = time.monotonic() - t0
        if grew >= quiet_bytes:
            synced = not sync
        elif synced:
            if elapsed >= min_s:
                return WriteQuiet(elapsed, total, True, syncs, len(denied))
        else:  # quiet, but a writer may sit in fdatasync: sync, then watch one more window
            syncs += 1
            synced = _sync(max_s - elapsed)
            elapsed = time.monotonic() - t0
        if elapsed >= max_s:
            logger.warning("writes of process %d and its children did not settle within %.0f s "
                           "(%d bytes written meanwhile): going on", root, max_s, total)
            return WriteQuiet(elapsed, total, False, syncs, len(denied))
