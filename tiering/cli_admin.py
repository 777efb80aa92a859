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

from tiering import cli_args
from tiering.backends.sizes import format_size
from tiering.stats import COUNTER_KEYS


def _namespaces(args: argparse.Namespace) -> list[Path]:
    from tiering.backends.reader import find_namespaces

    found = find_namespaces(Path(args.path))
    if getattr(args, "namespace", None):
        found = [p for p in found if p.name == args.namespace]
        if not found:
            raise ValueError(f"{args.path}: no namespace {args.namespace!r}")
    return found


def _cmd_stats(args: argparse.Namespace) -> int:
    from tiering.backends.reader import NamespaceReader

    if str(args.path).startswith("mooncake://"):  # counters live in each engine's /metrics
        from tiering.cli_cache import mooncake_view

        return mooncake_view(args)
    out = []
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


def _admin(args: argparse.Namespace, op: dict) -> int:
    from tiering.backends import admin

    replies = []
    for folder in _namespaces(args):
        replies.append({"namespace": folder.name, **admin.run(folder, op, args.timeout)})
    if args.json:
        print(json.dumps({"path": str(args.path), "results": replies}, indent=2))
    else:
        for r in replies:
            if "error" in r:
                print(f"namespace {r['namespace']}: {r['error']}")
                continue
            print(f"namespace {r['namespace']}: removed {r['removed_entries']} entries "
                  f"({format_size(r['removed_bytes'])}), {r['entries']} left ({r['via']})")
    return 1 if any("error" in r for r in replies) else 0


def _cmd_evict(args: argparse.Namespace) -> int:
    if (args.bytes is None) == (args.older_than is None):
        raise ValueError("evict: give exactly one of --bytes N or --older-than DURATION")
    op = ({"op": "evict", "bytes": args.bytes} if args.bytes is not None else
          {"op": "evict", "older_than": args.older_than})
    return _admin(args, op)


def _cmd_clear(args: argparse.Namespace) -> int:
    return _admin(args, {"op": "clear"})


def _cmd_export(args: argparse.Namespace) -> int:
    from tiering.exporter import render

    text = render(_namespaces(args))
    if args.output is not None:
        tmp = Path(args.output + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.output)  # node-exporter reads whole files only
    else:
        sys.stdout.write(text)
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from tiering.watch import watch

    return watch(args.url, args.interval, args.count, sys.stdout, args.json)


def _cmd_config(args: argparse.Namespace) -> int:
    from tiering.config import build_transfer_config

    cfg = build_transfer_config(args)
    if args.json:
        print(json.dumps(cfg, indent=2))
        return 0
    text = json.dumps(cfg, separators=(",", ":"))
    print(text)
    print(f"\nvllm serve {args.model} --prefix-caching-hash-algo sha256 "
          f"--kv-transfer-config '{text}'", file=sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    def with_path(name: str, help_: str, desc: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=desc)
        p.add_argument("path", help="cache root (the tier's path) or one namespace folder")
        p.add_argument("--namespace", type=cli_args.namespace, help="only this namespace id")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    p = with_path("stats", "persisted hit/miss/eviction/admission counters",
                  "Counters the tier persists with every group commit (read-only). PATH "
                  "mooncake://HOST:PORT (a Mooncake master's HTTP admin port): the master's "
                  "view of our namespaces and its totals (each engine's own counters of its "
                  "mooncake tier are on its /metrics, tier=\"mooncake\").")
    p.set_defaults(func=_cmd_stats)

    for name, func, desc in (
            ("evict", _cmd_evict, "Evict entries by policy order (--bytes) or by last access "
             "(--older-than). Safe on a live cache: a running server applies it at its next "
             "scheduler step; otherwise the tool opens the namespace itself."),
            ("clear", _cmd_clear, "Remove every entry (the namespace stays). Safe on a live "
             "cache, like evict.")):
        p = with_path(name, desc.split(".")[0].lower(), desc)
        p.add_argument("--timeout", type=cli_args.seconds(0, 86400), default=30.0,
                       help="seconds to wait for a live server's reply (default 30)")
        if name == "evict":
            p.add_argument("--bytes", type=cli_args.size(low=1),
                           help="free at least this much, e.g. 100GiB")
            p.add_argument("--older-than", type=cli_args.duration,
                           help="drop entries not used for e.g. 7d, 12h, 30m")
        p.set_defaults(func=func)

    p = sub.add_parser("export", help="Prometheus textfile (node-exporter) for a cache",
                       description="Write the cache's gauges and counters in Prometheus text "
                       "format, for node-exporter's textfile collector (read-only).")
    p.add_argument("path")
    p.add_argument("--namespace", type=cli_args.namespace)
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
