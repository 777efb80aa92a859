"""Namespaces: one folder per set of facts that make stored bytes compatible.

Two engines may share bytes only if the model, dtype, KV layout, tokens per chunk, parallel
layout and row size all agree, and the on-disk format is the one this code writes. Those facts
are hashed into the namespace id, which names the folder; ``meta.json`` keeps them readable.
Opening with different facts lands in a different folder, so bytes of one namespace are never
served to another. A folder whose ``meta.json`` disagrees with its own name (or whose facts no
longer hash to it: an edited file), or that was written by another format version, is refused,
never misread.

``meta.json`` also records the slab layout (``slab_file_bytes``, fixed when the namespace is
created, and ``slots``, the writer's current capacity), so that tools reopen a namespace exactly
as it was made and never resize it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# 2: slot checksums are seeded by key and namespace; meta.json records the slab layout.
FORMAT_VERSION = 2
META_FILE = "meta.json"
log = logging.getLogger(__name__)


class NamespaceError(ValueError):
    """A namespace folder cannot be used as asked (wrong format, mismatched facts)."""


class OtherFormatVersion(NamespaceError):
    """The namespace was written by another on-disk format version (``tiering clear`` removes
    it when no writer holds it)."""


@dataclass(frozen=True)
class NamespaceFacts:
    """Everything that decides whether stored bytes can be served to an engine."""

    model: str
    dtype: str
    layout: str
    row_bytes: int
    chunk_tokens: int
    parallel: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        return d

    @property
    def namespace_id(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write a JSON file atomically (tmp file + fsync + rename), mode 0600. The tmp file is
    created fresh (never through a planted link); the rename replaces a link, never follows it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# What each known entry of a namespace folder must be (a link is never acceptable).
_ENTRY_KINDS = {"meta.json": stat.S_ISREG, "writer.json": stat.S_ISREG,
                "writer.lock": stat.S_ISREG, "index.lmdb": stat.S_ISDIR,
                "requests": stat.S_ISDIR}


def check_folder(folder: Path) -> None:
    """Refuse a namespace folder whose files are not what they should be.

    The folder must be a real directory owned by this user; no entry in it (or in
    ``index.lmdb/``) may be a symbolic link, and the known entries must be regular files or
    directories as expected. A planted link would otherwise make the writer truncate, overwrite
    or create files outside the cache. NamespaceError names the first offending entry.
    """
    uid = os.geteuid()
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NamespaceError(f"{folder}: not a directory (a link or a file); refusing it")
    if st.st_uid != uid:
        raise NamespaceError(f"{folder}: owned by uid {st.st_uid}, not by this user ({uid}); "
                             "refusing it")
    entries = [(folder / e.name, e.name) for e in os.scandir(folder)]
    index = folder / "index.lmdb"
    if os.path.isdir(index) and not os.path.islink(index):
        entries += [(index / e.name, "index.lmdb/" + e.name) for e in os.scandir(index)]
    for path, name in entries:
        try:
            est = os.lstat(path)
        except FileNotFoundError:
            continue  # removed meanwhile
        if stat.S_ISLNK(est.st_mode):
            raise NamespaceError(f"{path}: {name} is a symbolic link; refusing a cache folder "
                                 "with links in it")
        want = _ENTRY_KINDS.get(name) or (stat.S_ISREG if name.startswith("slab-") else None)
        if want is not None and not want(est.st_mode):
            raise NamespaceError(f"{path}: {name} is not a "
                                 f"{'folder' if want is stat.S_ISDIR else 'regular file'}")
        if est.st_uid != uid and want is not None:
            raise NamespaceError(f"{path}: {name} is owned by uid {est.st_uid}, not by this "
                                 f"user ({uid}); refusing it")


def write_meta(folder: Path, facts: NamespaceFacts, info: dict[str, Any]) -> None:
    meta = {"namespace": facts.namespace_id, **facts.identity(), "created": time.time(), **info}
    write_json(folder / META_FILE, meta)


def open_meta(folder: Path, facts: NamespaceFacts, info: dict[str, Any],
              slab_file_bytes: int, slots: int) -> dict[str, Any]:
    """The writer's ``meta.json``: written on first open; later opens keep the recorded slab
    layout (moving slots between files would orphan every stored row) and record a changed
    capacity. Only the lock holder calls this."""
    path = folder / META_FILE
    if not os.path.lexists(path):
        write_meta(folder, facts, {**info, "slab_file_bytes": slab_file_bytes, "slots": slots})
        return read_meta(folder)
    meta = read_meta(folder)
    if meta["slab_file_bytes"] != slab_file_bytes:
        log.info("%s: keeping the slab files of %d bytes this namespace was created with "
                 "(slab_file_bytes %d asked)", folder, meta["slab_file_bytes"], slab_file_bytes)
    if meta["slots"] != slots:
        meta["slots"] = slots
        try:
            write_json(path, meta)
        except OSError as exc:  # a full disk must not stop a restart; tools see the mismatch
            log.warning("%s: cannot record the new capacity (%s); tools will refuse to change "
                        "this namespace until a writer records it", path, exc)
    return meta


def read_writer_info(folder: Path) -> dict[str, Any]:
    """``writer.json`` (who writes the namespace, for display); {} if missing or unreadable.
    Nothing in it is trusted: tools only show it, or use a registered policy name from it."""
    try:
        fd = os.open(folder / "writer.json", os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            info = json.loads(fh.read(1 << 20).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def facts_from_meta(meta: dict[str, Any]) -> NamespaceFacts:
    return NamespaceFacts(meta["model"], meta["dtype"], meta["layout"], meta["row_bytes"],
                          meta["chunk_tokens"], meta.get("parallel") or {},
                          meta.get("extra") or {})


_META_TYPES = {"namespace": str, "model": str, "dtype": str, "layout": str, "row_bytes": int,
               "chunk_tokens": int, "slab_file_bytes": int, "slots": int}


def read_meta(folder: Path) -> dict[str, Any]:
    """Read and check a namespace's ``meta.json``; NamespaceError if it is not ours to read."""
    path = folder / META_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            meta = json.loads(fh.read(1 << 20).decode("utf-8"))
    except FileNotFoundError:
        raise NamespaceError(f"{path}: missing; {folder} is not a vllm-tiering namespace") from None
    except OSError as exc:
        raise NamespaceError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except ValueError as exc:  # not UTF-8, not JSON
        raise NamespaceError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(meta, dict):
        raise NamespaceError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise OtherFormatVersion(
            f"{path}: format version {version!r}, this vllm-tiering reads version "
            f"{FORMAT_VERSION}; refusing to read it (clear it with `tiering clear`, or open it "
            "with the version that wrote it)")
    for name, kind in _META_TYPES.items():
        value = meta.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise NamespaceError(f"{path}: {name!r} must be a {kind.__name__}, got {value!r}")
    if meta.get("namespace") != folder.name:
        raise NamespaceError(f"{path}: describes namespace {meta.get('namespace')!r} but lives "
                             f"in folder {folder.name!r}; refusing to read it")
    if meta["row_bytes"] <= 0 or meta["row_bytes"] % 4096 or meta["slots"] < 0 \
            or meta["slab_file_bytes"] < meta["row_bytes"]:
        raise NamespaceError(f"{path}: row_bytes {meta['row_bytes']}, slab_file_bytes "
                             f"{meta['slab_file_bytes']}, slots {meta['slots']} are not a "
                             "slab layout")
    if not isinstance(meta.get("parallel", {}), dict) or not isinstance(meta.get("extra", {}),
                                                                        dict):
        raise NamespaceError(f"{path}: 'parallel' and 'extra' must be objects")
    if facts_from_meta(meta).namespace_id != folder.name:
        raise NamespaceError(f"{path}: its facts do not hash to namespace {folder.name!r} "
                             "(edited?); refusing to read it")
    return meta


def list_namespaces(root: Path) -> list[Path]:
    """Folders under ``root`` that look like namespaces (have a meta.json)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and os.path.lexists(p / META_FILE))
