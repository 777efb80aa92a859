"""Which folders are ours to change, and the only removal of a whole namespace there is.

A tool or the writer removes or rewrites files only in a namespace it has proven is ours:

* **format 2** (this version): ``namespace.read_meta`` (the magic, or the exact field set the
  format-2 writer wrote before the magic existed; the format fields; the id is the folder's
  name and the facts hash to it) and ``namespace.check_folder`` (every entry is one this format
  writes, of the right kind, no link, owned by this user);
* **format 1** (before slot checksums were seeded by the namespace): its own marker,
  ``meta.json`` with ``format_version`` 1 and exactly the fields that version wrote, whose facts
  hash (with format version 1) to the folder's name, in a folder holding only what that version
  wrote.

Anything else is ``NotOurs``: one line naming the path and what was expected. Removing a
whole namespace (a format-1 one by ``tiering clear``, any unused one by ``tiering drop``: the
way to get back the disk of preallocated slabs) unlinks the files its format wrote, by name,
one by one
through a descriptor of the folder that is checked to be the one proven (a folder swapped for
a link, or renamed away and replaced by another, meanwhile is never acted on),
then removes each folder it made only if that left it empty: never a recursive delete. What it
cannot remove it names and leaves in place.

Who calls: the CLI's ``evict``/``clear`` (through ``admin.run``) and ``drop``, on the tool's
own thread; it
blocks on the file system. Nothing here runs in a server.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiering.backends.namespace import (
    FORMAT_VERSION,
    LAYOUT,
    META_FILE,
    NamespaceError,
    NamespaceFacts,
    NotOurs,
    OtherFormatVersion,
    check_folder,
    load_json,
    read_meta,
)

log = logging.getLogger(__name__)

# -- format 1: what it wrote ------------------------------------------------------------------
FORMAT_1 = 1
FORMAT_1_REQUIRED = frozenset({"namespace", "model", "dtype", "layout", "row_bytes",
                               "chunk_tokens", "parallel", "extra", "format_version", "created"})
FORMAT_1_FIELDS = FORMAT_1_REQUIRED | {"element_bytes", "hash_algo", "restart_safe"}
_FORMAT_1_TYPES = {"namespace": str, "model": str, "dtype": str, "layout": str,
                   "row_bytes": int, "chunk_tokens": int, "parallel": dict, "extra": dict}
# write_json's temporary names (a writer or tool killed mid-write leaves one)
_TMP = r"\.(meta|writer)\.json\.\d+\.tmp"
_REQUEST_TMP = r"\.[0-9a-f]{12}\.(json|done)\.\d+\.tmp"
FORMAT_1_LAYOUT: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(meta|writer)\.json$"), "file"),
    (re.compile(r"^writer\.lock$"), "file"),
    (re.compile(rf"^{_TMP}$"), "file"),
    (re.compile(r"^index\.lmdb$"), "folder"),
    (re.compile(r"^slab-\d{4,}\.dat$"), "file"),
    (re.compile(r"^requests$"), "folder"),
)
FORMAT_1_TEXT = "meta.json, writer.json, writer.lock, index.lmdb/, slab-NNNN.dat, requests/"
# Inside the folders it made: only these names were ever its files.
FORMAT_1_INSIDE: dict[str, re.Pattern[str]] = {
    "index.lmdb": re.compile(r"^(data|lock)\.mdb$"),
    "requests": re.compile(rf"^([0-9a-f]{{12}}\.(json|done|taken)|{_REQUEST_TMP})$"),
}


# Inside the folders format 2 makes: its index (and the index's rebuild and damage siblings)
# and the admin requests (backends/admin.py), the same names as format 1's
FORMAT_2_INSIDE: dict[str, re.Pattern[str]] = {
    "index.lmdb": FORMAT_1_INSIDE["index.lmdb"],
    "requests": FORMAT_1_INSIDE["requests"],
}


def _inside_pattern(name: str, inside: dict[str, re.Pattern[str]]) -> re.Pattern[str] | None:
    """What a folder the format made may hold: ``index.lmdb`` and its siblings
    (``index.lmdb.new``, ``.old``, ``.tmp-PID``, ``.damaged-...``) hold an LMDB's files."""
    if name in inside:
        return inside[name]
    return inside.get("index.lmdb") if name.startswith("index.lmdb.") else None


@dataclass
class Owned:
    """A folder proven to be a namespace of ours, and of which format."""

    folder: Path
    format_version: int
    meta: dict[str, Any]
    identity: tuple[int, int] = (-1, -1)  # (st_dev, st_ino) of the folder that was proven


@dataclass
class Removal:
    """What removing a whole namespace did (or, in a dry run, would do)."""

    removed: list[str] = field(default_factory=list)  # names relative to the namespace folder
    kept: list[str] = field(default_factory=list)  # what it did not write, left in place
    folder_removed: bool = False


def identify(folder: Path) -> Owned:
    """Prove ``folder`` is a namespace of ours (format 2 or 1); NotOurs or NamespaceError
    (one line naming the path and what was expected) otherwise. Reads only."""
    folder = Path(folder)
    before = _identity_of(folder)
    owned = _identify(folder)
    if _identity_of(folder) != before:
        raise NotOurs(f"{folder}: replaced while it was being checked; refusing it")
    owned.identity = before
    return owned


def _identity_of(folder: Path) -> tuple[int, int]:
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return (-1, -1)
    return (st.st_dev, st.st_ino)


def _identify(folder: Path) -> Owned:
    try:
        check_folder(folder)
        return Owned(folder, FORMAT_VERSION, read_meta(folder))
    except OtherFormatVersion as exc:
        meta = _format_1_meta(folder)
        if meta is None:
            raise NotOurs(f"{exc}; and it is not a format-1 namespace of vllm-tiering either "
                          "(its fields or name do not match what that version wrote)") from None
    except NotOurs as exc:  # a foreign entry: a format-1 folder has other names; say which
        meta = _format_1_meta(folder)
        if meta is None:
            raise exc from None
    check_folder(folder, FORMAT_1_LAYOUT, FORMAT_1_TEXT)
    return Owned(folder, FORMAT_1, meta)


def _format_1_meta(folder: Path) -> dict[str, Any] | None:
    """meta.json if it is exactly what format 1 wrote for this folder, else None."""
    try:
        fd = os.open(folder / META_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            meta = load_json(fh.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_1 \
            or isinstance(meta.get("format_version"), bool):
        return None
    if not FORMAT_1_REQUIRED <= set(meta) <= FORMAT_1_FIELDS:
        return None
    for name, kind in _FORMAT_1_TYPES.items():
        if not isinstance(meta[name], kind) or isinstance(meta[name], bool):
            return None
    facts = NamespaceFacts(meta["model"], meta["dtype"], meta["layout"], meta["row_bytes"],
                           meta["chunk_tokens"], meta["parallel"], meta["extra"])
    if meta["namespace"] != folder.name or facts.id_for(FORMAT_1) != folder.name:
        return None
    return meta


def remove_format_1(owned: Owned, dry_run: bool = False) -> Removal:
    """Remove what format 1 wrote in a proven format-1 namespace (``identify``), file by file;
    RuntimeError if a writer of that version holds it. ``dry_run``: only say what would go."""
    assert owned.format_version == FORMAT_1, owned
    return remove_namespace(owned, dry_run)


def remove_namespace(owned: Owned, dry_run: bool = False) -> Removal:
    """Remove a whole proven namespace (``identify``, format 1 or 2: ``tiering drop``), file by
    file, only the names its format writes, the marker last; then the folder, if that emptied
    it. RuntimeError if a writer holds it (nothing removed). ``dry_run``: only say what would
    go. Why a format-2 namespace is ever removed whole: an unused one (another engine setup's,
    or this engine's before an upgrade changed its namespace) keeps its preallocated slabs,
    which ``clear`` leaves in place."""
    folder = owned.folder
    layout, inside = ((FORMAT_1_LAYOUT, FORMAT_1_INSIDE) if owned.format_version == FORMAT_1
                      else (LAYOUT, FORMAT_2_INSIDE))
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(dfd)
        if (st.st_dev, st.st_ino) != owned.identity:  # renamed and replaced since the proof
            raise NotOurs(f"{folder}: is not the folder that was proven a namespace of ours "
                          "(replaced since); refusing to remove anything in it")
        _refuse_if_held(dfd, folder)
        out = Removal()
        _remove_in(dfd, "", layout, out, dry_run, inside)
    finally:
        os.close(dfd)
    if not out.kept:
        if dry_run:
            pass
        elif _identity_of(folder) != owned.identity:  # replaced meanwhile: not ours to rmdir
            out.kept.append(". (replaced while it was emptied)")
        else:
            try:
                os.rmdir(folder)
            except OSError as exc:  # something appeared meanwhile: leave it
                out.kept.append(f". ({exc.strerror})")
        out.folder_removed = not out.kept
    if not dry_run:
        log.warning("%s: removed a format-%d namespace (%d files)%s", folder,
                    owned.format_version, len(out.removed),
                    f"; kept {', '.join(out.kept)}" if out.kept else "")
    return out


def _refuse_if_held(dfd: int, folder: Path) -> None:
    """A format-1 writer held an flock on writer.lock; a format-2 one on the folder."""
    held = False
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(dfd, fcntl.LOCK_UN)
    except BlockingIOError:
        held = True
    with contextlib.suppress(FileNotFoundError):
        lfd = os.open("writer.lock", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        finally:
            os.close(lfd)
    if held:
        raise RuntimeError(f"{folder}: a writer holds it; stop it first")


def _remove_in(dfd: int, prefix: str, layout: tuple[tuple[re.Pattern[str], str], ...],
               out: Removal, dry_run: bool, folders: dict[str, re.Pattern[str]],
               inside: re.Pattern[str] | None = None) -> None:
    """Unlink, under the folder open as ``dfd``, the regular files (owned by us) whose names
    the format wrote (``layout``'s files and slabs); recurse into the folders it made (what
    each may hold: ``folders``); rmdir them if that emptied them."""
    uid = os.geteuid()
    # the marker last: a removal cut short anywhere leaves a folder a rerun can still prove
    for name in sorted(os.listdir(dfd), key=lambda n: (prefix == "" and n == META_FILE, n)):
        rel = prefix + name
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            continue
        kind = None
        if inside is not None:
            kind = "file" if inside.match(name) else None
        else:
            for pattern, k in layout:
                if pattern.match(name):
                    kind = k
                    break
        holds = _inside_pattern(name, folders) if kind == "folder" else None
        if kind in ("file", "slab") and stat.S_ISREG(st.st_mode) and st.st_uid == uid \
                and st.st_nlink == 1:
            if not dry_run:
                os.unlink(name, dir_fd=dfd)
            out.removed.append(rel)
        elif kind == "folder" and stat.S_ISDIR(st.st_mode) and st.st_uid == uid \
                and holds is not None:
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            before = len(out.kept)
            try:
                _remove_in(sub, rel + "/", layout, out, dry_run, folders, holds)
            finally:
                os.close(sub)
            if len(out.kept) == before:
                if not dry_run:
                    try:
                        os.rmdir(name, dir_fd=dfd)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                            raise
                        out.kept.append(rel + "/")
                        continue
                out.removed.append(rel + "/")
            else:
                out.kept.append(rel + "/")
        else:
            out.kept.append(rel)


def refuse_unless_ours(folder: Path) -> Owned:
    """``identify`` for a tool about to change ``folder``: the same proof, and its failure is a
    NamespaceError (exit 2) whatever went wrong while reading."""
    try:
        return identify(folder)
    except NamespaceError:
        raise
    except OSError as exc:
        raise NotOurs(f"{folder}: cannot be read ({exc.strerror or exc}); not proven to be a "
                      "vllm-tiering namespace") from None
