"""``tiering stats | evict | clear | export | watch | config``.

``stats`` and ``export`` are read-only (LMDB readers, no lock). ``evict`` and ``clear`` change a
cache safely while a server uses it (``backends/admin.py``). ``watch`` reads a server's
/metrics. ``config`` writes a validated ``--kv-transfer-config``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tiering import cli_args
from tiering.backends.sizes import format_size
from tiering.stats import COUNTER_KEYS


def _namespaces(args: argparse.Namespace) -> list[Path]:
    """The namespaces a read-only command looks at: all of PATH's, or those named."""
    from tiering.backends.reader import find_namespaces

    found: list[Path] = find_namespaces(Path(args.path))
    wanted: list[str] = list(dict.fromkeys(args.namespace or []))
    if wanted:
        by_name = {p.name: p for p in found}
        missing = [n for n in wanted if n not in by_name]
        if missing:
            raise ValueError(f"{args.path}: no namespace {missing[0]!r}")
        found = [by_name[n] for n in wanted]
    return found


def _targets(args: argparse.Namespace) -> tuple[list[Path], list[dict[str, str]]]:
    """The namespaces ``evict``/``clear`` act on, each proven ours, and the folders left alone
    (not proven ours: never touched). Acting on more than one needs them named or ``--all``;
    otherwise PATH's namespaces are listed and the command refuses (exit 2)."""
    from tiering.backends.namespace import NamespaceError, is_candidate, list_namespaces
    from tiering.backends.ownership import identify

    path = Path(args.path)
    single = is_candidate(path)
    candidates = [path] if single else list_namespaces(path)
    if not candidates:
        raise FileNotFoundError(f"{path}: no vllm-tiering namespace found (expected "
                                "<path>/<namespace id: 16 hex digits>/meta.json)")
    ours: dict[str, tuple[Path, dict[str, Any]]] = {}
    refused: dict[str, NamespaceError] = {}
    for c in candidates:
        try:
            owned = identify(c)
            ours[c.name] = (c, {"namespace": c.name, "format_version": owned.format_version,
                                "model": owned.meta.get("model"),
                                "row_bytes": owned.meta.get("row_bytes"),
                                "slots": owned.meta.get("slots")})
        except NamespaceError as exc:
            refused[c.name] = exc
    if single and refused:
        raise refused[path.name]
    if args.namespace:
        chosen = []
        for name in dict.fromkeys(args.namespace):
            if name in refused:
                raise refused[name]
            if name not in ours:
                raise ValueError(f"{path}: no namespace {name!r}")
            chosen.append(ours[name][0])
    elif not ours:  # nothing here is ours: say why the first candidate is not
        raise next(iter(refused.values()))
    elif args.all or len(ours) == 1:
        chosen = [p for p, _ in ours.values()]
    else:
        listing = [info for _, info in ours.values()]
        if args.json:
            print(json.dumps({"path": str(path), "namespaces": listing}, indent=2))
        else:
            print(f"{path} holds {len(listing)} namespaces:")
            for ns in listing:
                print(f"  {ns['namespace']}  model {ns['model']}  format {ns['format_version']}"
                      f"  row {ns['row_bytes']} B  slots {ns['slots']}")
        raise ValueError(f"{path} holds {len(listing)} namespaces ({', '.join(ours)}); name "
                         f"the ones to {args.command} with --namespace ID (repeatable) or pass "
                         "--all")
    skipped = [{"path": str(path / name), "reason": " ".join(str(exc).split())}
               for name, exc in refused.items()]
    return chosen, skipped


def _cmd_stats(args: argparse.Namespace) -> int:
    from tiering.backends.reader import NamespaceReader

    if str(args.path).startswith("mooncake://"):  # counters live in each engine's /metrics
        from tiering.cli_cache import mooncake_view

        return mooncake_view(args)
    out: list[dict[str, Any]] = []
    for folder in _namespaces(args):
        with NamespaceReader(folder) as r:
            s = r.index.read_stats()
            out.append({"namespace": folder.name, "entries": r.index.count(), **s})
    if args.json:
        print(json.dumps({"path": str(args.path), "namespaces": out}, indent=2))
        return 0
    for ns in out:
        lookups = ns["lookups"] or 1
        print(f"namespace {ns['namespace']}: {ns['entries']} entries; hits {ns['hits']}/"
              f"{ns['lookups']} lookups ({100 * ns['hits'] / lookups:.1f}%)")
        for k in COUNTER_KEYS:
            if k in ("lookups", "hits"):
                continue
            v = ns[k]
            print(f"  {k:<22} {format_size(v) if k.endswith('_bytes') else v}")
    return 0


def _admin(args: argparse.Namespace, op: dict[str, Any]) -> int:
    from tiering.backends import admin

    targets, skipped = _targets(args)
    replies = [{"namespace": folder.name, **admin.run(folder, op, args.timeout, args.dry_run)}
               for folder in targets]
    if args.json:
        print(json.dumps({"path": str(args.path), "dry_run": args.dry_run, "results": replies,
                          "skipped": skipped}, indent=2))
    else:
        for r in replies:
            print(_describe(r))
        for s in skipped:
            print(f"left alone {s['path']}: {s['reason']}")
    return 1 if any("error" in r for r in replies) else 0


def _describe(r: dict[str, Any]) -> str:
    """One reply of ``admin.run`` as the line ``evict``/``clear`` print."""
    ns = f"namespace {r['namespace']}"
    if "error" in r:
        return f"{ns}: {r['error']}"
    if "removed_files" in r:  # a format-1 namespace
        verb = "would remove" if r["dry_run"] else "removed"
        text = (f"{ns} (format version 1): {verb} {len(r['removed_files'])} files "
                f"({', '.join(r['removed_files']) or 'none'})")
        if r["kept"]:
            return text + f"; kept what vllm-tiering did not write: {', '.join(r['kept'])}"
        return text + (", then its folder" if r["dry_run"] else ", and its folder")
    if r.get("dry_run"):
        return (f"{ns}: would remove {r['removed_entries']} entries "
                f"({format_size(r['removed_bytes'])}), {r['entries']} left (dry run: nothing "
                "removed; a live server skips chunks in use)")
    return (f"{ns}: removed {r['removed_entries']} entries "
            f"({format_size(r['removed_bytes'])}), {r['entries']} left ({r['via']})")


def _cmd_evict(args: argparse.Namespace) -> int:
    if (args.bytes is None) == (args.older_than is None):
        raise ValueError("evict: give exactly one of --bytes N or --older-than DURATION")
    op = ({"op": "evict", "bytes": args.bytes} if args.bytes is not None else
          {"op": "evict", "older_than": args.older_than})
    return _admin(args, op)


def _cmd_clear(args: argparse.Namespace) -> int:
    return _admin(args, {"op": "clear"})


def _cmd_drop(args: argparse.Namespace) -> int:
    """Remove whole namespaces, each proven ours and held by no writer, file by file."""
    from tiering.backends.ownership import identify, remove_namespace

    targets, skipped = _targets(args)
    out: list[dict[str, Any]] = []
    for folder in targets:
        try:
            done = remove_namespace(identify(folder), args.dry_run)
        except RuntimeError as exc:  # a writer holds it: nothing was removed
            out.append({"namespace": folder.name, "error": str(exc)})
            continue
        out.append({"namespace": folder.name, "removed_files": done.removed,
                    "kept": done.kept, "folder_removed": done.folder_removed})
    if args.json:
        print(json.dumps({"path": str(args.path), "dry_run": args.dry_run, "results": out,
                          "skipped": skipped}, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for r in out:
            if "error" in r:
                print(f"{r['namespace']}: not removed: {r['error']}")
                continue
            kept = f"; kept (not written by us) {', '.join(r['kept'])}" if r["kept"] else ""
            print(f"{r['namespace']}: {verb} {len(r['removed_files'])} files"
                  f"{' and the folder' if r['folder_removed'] else ''}{kept}")
        for sk in skipped:
            print(f"left alone {sk['path']}: {sk['reason']}")
    return 1 if any("error" in r for r in out) else 0


EXPORT_HEAD = b"# HELP tiering_cache_"  # how every export begins (exporter.render)


def _check_output(path: Path) -> None:
    """``export -o`` replaces only what it wrote itself (a file beginning like an export) or an
    empty file (made to set its mode); never a file of someone else's, a link, or a file inside
    a namespace folder (which the tier never writes). ValueError (exit 2) naming it."""
    import os
    import stat

    from tiering.backends.namespace import NAMESPACE_NAME

    parent = Path(os.path.abspath(path)).parent
    if NAMESPACE_NAME.match(parent.name) and os.path.lexists(parent / "meta.json"):
        raise ValueError(f"-o {path}: inside the namespace folder {parent}; write the export "
                         "outside the cache")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"-o {path}: exists and is not a regular file (a link, a folder, a "
                         "device); refusing to replace it")
    if st.st_size:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            head = os.read(fd, len(EXPORT_HEAD))
        finally:
            os.close(fd)
        if head != EXPORT_HEAD:
            raise ValueError(f"-o {path}: exists and is not a tiering export (it does not begin "
                             f"with {EXPORT_HEAD.decode()!r}); refusing to replace it (remove it "
                             "or name another file)")


def _cmd_export(args: argparse.Namespace) -> int:
    from tiering.exporter import render

    if args.output is not None:
        _check_output(Path(args.output))
    text = render(_namespaces(args))
    if args.output is not None:
        _check_output(Path(args.output))  # again: it may have changed while the cache was read
        _write_private(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically (node-exporter reads whole files only). A new file is 0600
    whatever the umask; a file being replaced keeps its mode (an operator who let
    node-exporter's user read it keeps that), never anything wider than it had."""
    import os
    import stat

    from tiering.backends.namespace import write_atomic

    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o600
    write_atomic(path, text, mode)


def _cmd_watch(args: argparse.Namespace) -> int:
    from tiering.watch import watch

    return watch(args.url, args.interval, args.count, sys.stdout, args.json)


# vLLM's scheduler with its per-admission reservation sum made linear (docs/vllm.md, "The
# scheduler option"): it admits exactly as vLLM's does (hits_first is off by default), only
# faster when many loads are admitted at once, and hands a request's new GPU blocks out sorted
# so that our copies are fewer (sort_gpu_blocks), so the printed command names it
SCHEDULER_CLS = "tiering.vllm.scheduler.TieringScheduler"


def _cmd_config(args: argparse.Namespace) -> int:
    from tiering.config import build_transfer_config

    cfg = build_transfer_config(args)
    if args.json:
        print(json.dumps(cfg, indent=2))
        return 0
    text = json.dumps(cfg, separators=(",", ":"))
    print(text)
    print(f"\nvllm serve {args.model} --prefix-caching-hash-algo sha256 "
          f"--scheduler-cls {SCHEDULER_CLS} --kv-transfer-config '{text}'", file=sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction[cli_args.Parser]) -> None:
    def with_path(name: str, help_: str, desc: str, store_ok: bool = False
                  ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=desc)
        p.add_argument("path", type=cli_args.cache_path_or_store if store_ok else cli_args.cache_path,
                       help="cache root (the tier's path) or one namespace folder")
        p.add_argument("--namespace", type=cli_args.namespace, action="append",
                       help="only this namespace id (repeatable)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    p = with_path("stats", "persisted hit/miss/eviction/admission counters",
                  "Counters the tier persists with every group commit (read-only). PATH "
                  "mooncake://HOST:PORT (a Mooncake master's HTTP admin port): the master's "
                  "view of our namespaces and its totals (each engine's own counters of its "
                  "mooncake tier are on its /metrics, tier=\"mooncake\").", store_ok=True)
    p.set_defaults(func=_cmd_stats)

    for name, func, desc in (
            ("evict", _cmd_evict, "Evict entries by policy order (--bytes) or by last access "
             "(--older-than). Safe on a live cache: a running server applies it at its next "
             "scheduler step; otherwise the tool opens the namespace itself. Only a namespace "
             "proven to be vllm-tiering's (meta.json marker and layout) is ever changed."),
            ("clear", _cmd_clear, "Remove every entry (the namespace stays; a format-1 "
             "namespace of vllm-tiering is removed file by file). Safe on a live cache, like "
             "evict. Only a namespace proven to be vllm-tiering's is ever changed.")):
        p = with_path(name, desc.split(".")[0].lower(), desc)
        p.add_argument("--timeout", type=cli_args.seconds(0, 86400), default=30.0,
                       help="seconds to wait for a live server's reply (default 30)")
        p.add_argument("--dry-run", action="store_true",
                       help="print what would be removed and remove nothing")
        p.add_argument("--all", action="store_true",
                       help="act on every namespace under PATH (needed when it holds several "
                       "and none is named with --namespace)")
        if name == "evict":
            p.add_argument("--bytes", type=cli_args.size(low=1),
                           help="free at least this much, e.g. 100GiB")
            p.add_argument("--older-than", type=cli_args.duration,
                           help="drop entries not used for e.g. 7d, 12h, 30m")
        p.set_defaults(func=func)

    p = with_path("drop", "remove whole unused namespaces and their disk",
                  "Remove whole namespaces, slabs included, file by file: only the files "
                  "vllm-tiering writes, in a namespace proven to be its own (meta.json marker "
                  "and layout); anything else in it is kept and named. The way to get back "
                  "the disk of a namespace no engine uses any more (another setup's, or one "
                  "an upgrade replaced): 'clear' empties a namespace but keeps its "
                  "preallocated slabs. Refused while a server writes to it.")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be removed and remove nothing")
    p.add_argument("--all", action="store_true",
                   help="act on every namespace under PATH (needed when it holds several and "
                   "none is named with --namespace)")
    p.set_defaults(func=_cmd_drop)

    p = sub.add_parser("export", help="Prometheus textfile (node-exporter) for a cache",
                       description="Write the cache's gauges and counters in Prometheus text "
                       "format, for node-exporter's textfile collector (read-only).")
    p.add_argument("path", type=cli_args.cache_path)
    p.add_argument("--namespace", type=cli_args.namespace, action="append",
                   help="only this namespace id (repeatable)")
    p.add_argument("--prometheus", action="store_true", default=True,
                   help="Prometheus text format (the only format; accepted for clarity)")
    p.add_argument("-o", "--output", type=cli_args.output_file,
                   help="write atomically to this file instead of stdout")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("watch", help="live per-tier hit rates from a vLLM /metrics URL",
                       description="Refreshing table of per-tier hit rates, usage and "
                       "throughput, read from a vLLM server's /metrics endpoint.")
    p.add_argument("url", type=cli_args.metrics_url, help="e.g. http://127.0.0.1:8000/metrics")
    p.add_argument("--interval", type=cli_args.seconds(0.049, 86400), default=2.0,
                   help="seconds between refreshes (0.05 to 86400, default 2)")
    p.add_argument("--count", type=cli_args.integer(0, 10**9), default=0,
                   help="stop after N refreshes (0: never)")
    p.add_argument("--json", action="store_true", help="one JSON object per refresh")
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser("config", help="print a validated --kv-transfer-config",
                       description="Build the TieredOffloadingSpec config from flags, validated "
                       "the way the engine validates it at start.")
    p.add_argument("--cpu", required=True, type=cli_args.size(low=4096),
                   help="CPU staging memory, e.g. 16GiB")
    p.add_argument("--disk", action="append", default=[], metavar="PATH:CAPACITY",
                   help="a file tier, e.g. /mnt/nvme/kv:1TiB (repeatable)")
    p.add_argument("--policy", default="arc", help="file-tier eviction policy (default arc)")
    p.add_argument("--cpu-policy", default="lru", help="CPU-tier eviction policy (default lru)")
    p.add_argument("--threshold", type=cli_args.integer(0, 1000), default=2,
                   help="file-tier store_threshold (default 2)")
    p.add_argument("--cpu-threshold", type=cli_args.integer(0, 1000), default=0)
    p.add_argument("--io", default="auto")
    p.add_argument("--io-threads", type=cli_args.integer(1, 1024), default=16)
    p.add_argument("--compression", default="none")
    p.add_argument("--model", default="MODEL", help="model name for the printed vllm serve line")
    p.add_argument("--json", action="store_true", help="print the JSON only, indented")
    p.set_defaults(func=_cmd_config)
