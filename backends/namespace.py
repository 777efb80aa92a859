"""Namespaces: one folder per set of facts that make stored bytes compatible.

Two engines may share bytes only if the model, dtype, KV layout, tokens per chunk, parallel
layout and row size all agree, and the on-disk format is the one this code writes. Those facts
are hashed into the namespace id, which names the folder; ``meta.json`` keeps them readable.
Opening with different facts lands in a different folder, so bytes of one namespace are never
served to another. A folder whose ``meta.json`` disagrees with its own name, or that was
written by another format version, is refused, never misread.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# 2: slot checksums are seeded by key and namespace; meta.json records the slab layout.
FORMAT_VERSION = 2
META_FILE = "meta.json"


class NamespaceError(ValueError):
    """A namespace folder cannot be used as asked (wrong format, mismatched facts)."""


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
    """Write a JSON file atomically (tmp file + fsync + rename), mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_meta(folder: Path, facts: NamespaceFacts, info: dict[str, Any]) -> None:
    meta = {"namespace": facts.namespace_id, **facts.identity(), "created": time.time(), **info}
    write_json(folder / META_FILE, meta)


def read_meta(folder: Path) -> dict[str, Any]:
    """Read and check a namespace's ``meta.json``; NamespaceError if it is not ours to read."""
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise NamespaceError(f"{path}: missing; {folder} is not a vllm-tiering namespace") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise NamespaceError(f"{path}: unreadable ({exc})") from exc
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise NamespaceError(
            f"{path}: format version {version!r}, this vllm-tiering reads version "
            f"{FORMAT_VERSION}; refusing to read it (clear it with `tiering clear`, or open it "
            "with the version that wrote it)")
    if meta.get("namespace") != folder.name:
        raise NamespaceError(f"{path}: describes namespace {meta.get('namespace')!r} but lives "
                             f"in folder {folder.name!r}; refusing to read it")
    return meta


def list_namespaces(root: Path) -> list[Path]:
    """Folders under ``root`` that look like namespaces (have a meta.json)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / META_FILE).exists())
