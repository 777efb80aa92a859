"""Our threads' names at the OS level, so that ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm``
tell a tier's I/O threads from vLLM's and from each other.

Python 3.12 keeps a ``threading.Thread``'s name to itself (every thread of vLLM's engine core is
``python3`` to the OS), so which thread burns the CPU beside the scheduler could not be seen
from outside the process (an H100's first engine stepped 35% slower than its restart during
the same disk hit, every function alike: another thread held the CPU or the GIL). Each of our
long-lived threads calls ``name_os_thread`` first thing; Linux keeps 15 bytes of the name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

PR_SET_NAME = 15  # prctl(2)
OS_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN less its terminating NUL

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):  # no libc to call: names stay the process's
        _prctl = None


def os_name(name: str) -> bytes:
    """The bytes the kernel keeps of ``name``: UTF-8, at most 15 bytes, never a split character."""
    raw = name.encode("utf-8")[:OS_NAME_BYTES]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def name_os_thread(name: str) -> bool:
    """Name the calling thread ``name`` at the OS level (Linux); True if the kernel took it.
    Never raises: a thread that cannot be named works as before."""
    if _prctl is None:
        return False
    try:
        return bool(_prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0) == 0)
    except Exception:  # noqa: BLE001 - a name is never worth a thread
        log.debug("cannot name thread %r", name, exc_info=True)
        return False
