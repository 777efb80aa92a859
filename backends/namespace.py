"""Namespaces: one folder per set of facts that make stored bytes compatible.

Two engines may share bytes only if the model, dtype, KV layout, tokens per chunk, parallel
layout and row size all agree, and the on-disk format is the one this code writes. Those facts
are hashed into the namespace id, which names the folder; ``meta.json`` keeps them readable.
Opening with different facts lands in a different folder, so bytes of one namespace are never
served to another. A folder whose ``meta.json`` disagrees with its own name (or whose facts no
longer hash to it: an edited file), or that was written by another format version, is refused,
never misread.

``meta.json`` is also the namespace's marker: it carries ``"magic": MAGIC``, and a folder is a
namespace only when its marker proves it (``read_meta``) and it holds nothing but what this
format writes (``check_folder``). A ``meta.json`` written by this format before the magic existed
is recognised by its exact field set instead (``LEGACY_FIELDS``), so those caches keep opening;
the writer adds the magic when it next opens them. What may be removed, and how an older format
of ours is recognised, is ``ownership.py``.

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
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# 2: slot checksums are seeded by key and namespace; meta.json records the slab layout.
FORMAT_VERSION = 2
META_FILE = "meta.json"
# The marker every meta.json of ours carries (not part of the namespace id: adding it to a
# namespace written before it existed keeps the folder's name, and so its hits).
MAGIC = "vllm-tiering namespace"
# What a format-2 writer put in meta.json before the magic existed: exactly these (the first
# set always, ``hash_algo``/``restart_safe`` when an engine passed them).
LEGACY_REQUIRED = frozenset({"namespace", "model", "dtype", "layout", "row_bytes",
                             "chunk_tokens", "parallel", "extra", "format_version", "created",
                             "element_bytes", "slab_file_bytes", "slots"})
LEGACY_FIELDS = LEGACY_REQUIRED | {"hash_algo", "restart_safe"}
NAMESPACE_NAME = re.compile(r"^[0-9a-f]{16}$")
log = logging.getLogger(__name__)


class NamespaceError(ValueError):
    """A namespace folder cannot be used as asked (wrong format, mismatched facts)."""


class OtherFormatVersion(NamespaceError):
    """The namespace was written by another on-disk format version (``tiering clear`` removes
    a format-1 namespace of ours when no writer holds it: ``ownership.py``)."""


class NotOurs(NamespaceError):
    """The folder is not a namespace this project wrote (no marker, or not our layout)."""


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

    def identity(self, version: int = FORMAT_VERSION) -> dict[str, Any]:
        d = asdict(self)
        d["format_version"] = version
        return d

    @property
    def namespace_id(self) -> str:
        return self.id_for(FORMAT_VERSION)

    def id_for(self, version: int) -> str:
        """The folder name these facts have in format ``version`` (1 and 2 hash alike)."""
        blob = json.dumps(self.identity(version), sort_keys=True, separators=(",", ":"),
                          default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_dirs(path: Path) -> None:
    """``mkdir -p`` with every folder it creates 0700 whatever the umask (Path.mkdir's
    ``parents`` creates the parents with the umask's mode)."""
    missing: list[Path] = []
    p = Path(path)
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # made meanwhile (another engine on the same root)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # the umask may have taken the owner's bits; never more
        finally:
            os.close(fd)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r:.40} (parsers disagree on which one counts)")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON the tier writes")


def load_json(data: bytes) -> Any:
    """Parse a JSON file of ours that anyone may have written: ValueError (never RecursionError
    or a silent pick) for what the tier never writes: not UTF-8, not JSON, nested deeper than
    the parser can go, a key twice, NaN/Infinity."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write a JSON file atomically (``write_atomic``), mode 0600."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text`` atomically (tmp file + fsync + rename), mode ``mode``
    whatever the umask. The tmp file is created fresh (never through a planted link); the
    rename replaces a link, never follows it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            if mode != 0o600:
                os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# The layout format 2 writes: every entry of a namespace folder matches one of these, of that
# kind (a link is never acceptable). A slab that is not a regular file is a damaged slab: its
# rows are misses, the writer never opens or removes it (``slab.py``).
SLAB_FILE = re.compile(r"^slab-\d{4,}\.dat$")
LAYOUT: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(meta|writer|advisor)\.json$"), "file"),
    (re.compile(r"^writer\.lock$"), "file"),
    (re.compile(r"^\.(meta|writer|advisor)\.json\.\d+\.tmp$"), "file"),  # write_json's, mid-write
    (re.compile(r"^index\.lmdb(\.new|\.old|\.tmp-\d+|\.damaged-\d{8}T\d{6}-\d+)?$"), "folder"),
    (SLAB_FILE, "slab"),
    (re.compile(r"^requests$"), "folder"),
)
LAYOUT_TEXT = ("meta.json, writer.json, advisor.json, writer.lock, index.lmdb/ (and its "
               ".new/.old/.tmp-PID/.damaged-TIME-PID siblings), slab-NNNN.dat, requests/")


def entry_kind(name: str, layout: tuple[tuple[re.Pattern[str], str], ...] = LAYOUT
               ) -> str | None:
    """What ``name`` must be in a namespace folder of that layout, or None: not ours."""
    for pattern, kind in layout:
        if pattern.match(name):
            return kind
    return None


def check_folder(folder: Path, layout: tuple[tuple[re.Pattern[str], str], ...] = LAYOUT,
                 layout_text: str = LAYOUT_TEXT, allow_foreign: bool = False) -> list[str]:
    """Refuse a namespace folder whose files are not what they should be.

    The folder must be a real directory owned by this user; no entry in it (or in
    ``index.lmdb/``) may be a symbolic link; every entry must be one this format writes
    (``layout``), a regular file or a directory as expected and owned by this user, and a
    file must have one name (a hard link would let the writer rewrite someone's file). A planted
    link would otherwise make the writer truncate, overwrite or create files outside the cache;
    a foreign entry says the folder is not (only) ours. NamespaceError names the first
    offending entry.

    ``allow_foreign`` (the writer and the read-only tools, once ``meta.json`` proved the folder
    is a namespace): entries whose names this format never writes (an NFS ``.nfsXXXX`` file,
    ``lost+found``, a core dump, an editor's backup) are returned instead of refused; nothing
    ever opens, follows or removes a name outside the layout, so they are left as they are.
    Entries with our names are checked all the same. Tools that change a namespace
    (``evict``/``clear``, ``ownership.identify``) refuse them.
    """
    foreign: list[str] = []
    uid = os.geteuid()
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return foreign
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
        want = (("file" if name.endswith(".mdb") else None) if "/" in name  # LMDB's files
                else entry_kind(name, layout))
        if want is None and "/" not in name and allow_foreign:
            foreign.append(name)  # never opened, followed or removed
            continue
        if stat.S_ISLNK(est.st_mode):
            raise NamespaceError(f"{path}: {name} is a symbolic link; refusing a cache folder "
                                 "with links in it")
        if "/" not in name:
            if want is None:
                raise NotOurs(f"{path}: {name!r} is not something vllm-tiering writes in a "
                              f"namespace folder; refusing {folder} (expected only "
                              f"{layout_text})")
        if want in ("file", "folder") and not (stat.S_ISDIR(est.st_mode) if want == "folder"
                                              else stat.S_ISREG(est.st_mode)):
            raise NamespaceError(f"{path}: {name} is not a "
                                 f"{'folder' if want == 'folder' else 'regular file'}")
        if est.st_uid != uid and want is not None:
            raise NamespaceError(f"{path}: {name} is owned by uid {est.st_uid}, not by this "
                                 f"user ({uid}); refusing it")
        if stat.S_ISREG(est.st_mode) and est.st_nlink != 1 and want is not None:
            raise NamespaceError(hard_link_problem(path, name, est.st_nlink))
    return foreign


def hard_link_problem(path: Path | str, name: str, links: int) -> str:
    """Why a file with several names is refused: the tier never makes hard links, so a second
    name means the file (or its bytes) is someone else's, and writing it would change them."""
    return (f"{path}: {name} has {links} hard links (vllm-tiering never makes one, so it may be "
            "a file of yours linked in); refusing a cache folder with hard-linked files in it")


def write_meta(folder: Path, facts: NamespaceFacts, info: dict[str, Any]) -> None:
    meta = {"namespace": facts.namespace_id, **facts.identity(), "created": time.time(), **info,
            "magic": MAGIC}
    write_json(folder / META_FILE, meta)


# What a first open leaves before meta.json exists (a writer killed there): nothing else.
_UNSTARTED = re.compile(r"^(writer\.lock|\.meta\.json\.\d+\.tmp)$")


def check_unstarted(folder: Path) -> None:
    """A namespace folder without meta.json may be started only if it holds nothing but what
    a first open leaves before writing meta.json; NotOurs otherwise (never write into a folder
    we cannot prove is ours)."""
    for e in os.scandir(folder):
        if not _UNSTARTED.match(e.name) or not e.is_file(follow_symlinks=False):
            raise NotOurs(f"{folder}: has no {META_FILE} but holds {e.name!r}; not a "
                          "vllm-tiering namespace (a new namespace folder is empty); refusing "
                          "to write there")


def check_for_writer(folder: Path) -> None:
    """Before a writer writes anything in an existing ``folder``: it must be a namespace of
    this format proven ours, or a folder a first open left before meta.json (NotOurs,
    OtherFormatVersion or NamespaceError otherwise, naming the path). Entries the tier never
    writes are allowed beside a proven ``meta.json`` (``check_folder``'s ``allow_foreign``),
    never in a folder without one. Reads only."""
    if os.path.lexists(folder / META_FILE):
        check_folder(folder, allow_foreign=True)
        read_meta(folder)
    else:
        check_folder(folder)
        check_unstarted(folder)


def open_meta(folder: Path, facts: NamespaceFacts, info: dict[str, Any],
              slab_file_bytes: int, slots: int) -> dict[str, Any]:
    """The writer's ``meta.json``: written on first open; later opens keep the recorded slab
    layout (moving slots between files would orphan every stored row) and record a changed
    capacity. Only the lock holder calls this."""
    path = folder / META_FILE
    if not os.path.lexists(path):
        check_unstarted(folder)
        write_meta(folder, facts, {**info, "slab_file_bytes": slab_file_bytes, "slots": slots})
        return read_meta(folder)
    meta = read_meta(folder)
    if meta["slab_file_bytes"] != slab_file_bytes:
        log.info("%s: keeping the slab files of %d bytes this namespace was created with "
                 "(slab_file_bytes %d asked)", folder, meta["slab_file_bytes"], slab_file_bytes)
    if meta["slots"] != slots or meta.get("magic") != MAGIC:  # proven ours: mark it as such
        meta["slots"], meta["magic"] = slots, MAGIC
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
            info = load_json(fh.read(1 << 20))
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
            meta = load_json(fh.read(1 << 20))
    except FileNotFoundError:
        raise NamespaceError(f"{path}: missing; {folder} is not a vllm-tiering namespace") from None
    except OSError as exc:
        raise NamespaceError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except ValueError as exc:  # not UTF-8, not JSON, too deep, a key twice
        raise NamespaceError(f"{path}: not a JSON file the tier writes ({exc})") from None
    if not isinstance(meta, dict):
        raise NotOurs(f"{path}: expected a JSON object, got {type(meta).__name__}; not a "
                      "vllm-tiering namespace")
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise NotOurs(f"{path}: no format_version (got {version!r:.40}); not a vllm-tiering "
                      f"namespace (expected a meta.json with \"magic\": {MAGIC!r} and "
                      f"\"format_version\": {FORMAT_VERSION})")
    if version != FORMAT_VERSION:
        raise OtherFormatVersion(
            f"{path}: format version {version!r}, this vllm-tiering reads version "
            f"{FORMAT_VERSION}; refusing to read it (`tiering clear` removes a format-1 "
            "namespace of vllm-tiering; or open it with the version that wrote it)")
    magic = meta.get("magic")
    if magic is None:
        fields = set(meta)
        if not LEGACY_REQUIRED <= fields <= LEGACY_FIELDS:
            odd = sorted(fields - LEGACY_FIELDS) or sorted(LEGACY_REQUIRED - fields)
            raise NotOurs(f"{path}: no \"magic\": {MAGIC!r}, and its fields are not those a "
                          f"vllm-tiering format-{FORMAT_VERSION} writer writes (unexpected or "
                          f"missing: {', '.join(odd)[:120]}); not a vllm-tiering namespace")
    elif magic != MAGIC:
        raise NotOurs(f"{path}: magic {magic!r:.40}, expected {MAGIC!r}; not a vllm-tiering "
                      "namespace")
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


def is_candidate(folder: Path) -> bool:
    """Named like a namespace (16 hex digits: its id) and holding a meta.json: worth asking
    ``read_meta`` whether it is one. A folder of any other name never is."""
    return (bool(NAMESPACE_NAME.match(Path(os.path.abspath(folder)).name))
            and os.path.isdir(folder) and not os.path.islink(folder)
            and os.path.lexists(Path(folder) / META_FILE))


def list_namespaces(root: Path) -> list[Path]:
    """Folders under ``root`` that may be namespaces (``is_candidate``); each still has to be
    proven by ``read_meta``/``check_folder`` before anything reads or changes it."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(root / n for n in names if is_candidate(root / n))
