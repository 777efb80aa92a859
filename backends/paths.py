"""Paths an operator or a config gives us, checked before anything uses them.

A path the system cannot walk (a symbolic link loop, a name or a whole path longer than the
file system allows, a file where a folder must be) would otherwise surface deep inside
``Path.resolve`` or ``mkdir`` as ``RuntimeError: Symlink loop`` or ``[Errno 36]``. ``check_path``
turns each into one ``ValueError`` naming the setting (``key``) and what was expected; it reads
only (``lstat``/``stat``), creates nothing, and is called by ``file_config.validate`` and by the
CLI's argument types.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

NAME_MAX = 255  # bytes in one file name (Linux file systems)
PATH_MAX = 4096  # bytes in a path the kernel accepts, with its terminating NUL
# What the tier adds below its path: /<namespace>/index.lmdb.damaged-<time>-<pid>/lock.mdb
BELOW_ROOT = 80


def _short(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:60]) + f"… ({len(text)} characters)"


def check_path(value: str | os.PathLike[str], key: str, below: int = BELOW_ROOT) -> Path:
    """``value`` as a Path, if the system can walk it; ValueError naming ``key`` otherwise.

    A path that does not exist yet is fine (the tier creates it) as long as its names fit and
    the part that exists leads somewhere real. ``below``: bytes the tier's own names add under
    it, which must fit too.
    """
    problem = path_problem(value, below)
    if problem:
        raise ValueError(f"{key}: {problem}")
    return Path(os.fspath(value))


def path_problem(value: str | os.PathLike[str], below: int = BELOW_ROOT) -> str | None:
    """Why the system cannot walk ``value`` (one sentence: what it is, what was expected), or
    None. Reads only."""
    try:
        text = os.fspath(value)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        return f"expected a path, got {value!r:.80}"
    if "\0" in text:
        return f"expected a path without NUL characters, got {_short(text)}"
    raw = os.fsencode(text)
    if len(os.fsencode(os.path.abspath(text))) + below >= PATH_MAX:
        return (f"path {_short(text)} is {len(raw)} bytes long; expected a path shorter than "
                f"{PATH_MAX - below} bytes, with the folder it is in (the files below it must "
                "fit too)")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return (f"path {_short(text)} has a name of {len(os.fsencode(part))} bytes; "
                    f"expected names of at most {NAME_MAX} bytes")
    p = Path(text)
    for candidate in [p, *p.parents]:  # the whole path, else the longest part that exists
        try:
            os.stat(candidate)
            break
        except FileNotFoundError:
            continue
        except OSError as exc:
            return _problem(exc, text)
    try:
        p.resolve()
    except RuntimeError:  # Python's own loop detection (3.11: "Symlink loop from ...")
        return _problem(OSError(errno.ELOOP, "loop"), text)
    except OSError as exc:
        return _problem(exc, text)
    return None


def _problem(exc: OSError, text: str) -> str:
    if exc.errno == errno.ELOOP:
        return (f"path {_short(text)} goes through a symbolic link loop; expected a path that "
                "leads to a folder")
    if exc.errno == errno.ENAMETOOLONG:
        return (f"path {_short(text)} is longer than the file system allows (names of at most "
                f"{NAME_MAX} bytes, paths under {PATH_MAX})")
    if exc.errno == errno.ENOTDIR:
        return f"path {_short(text)} goes through a file, not a folder"
    return f"path {_short(text)} cannot be used ({exc.strerror or exc})"
