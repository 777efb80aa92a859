"""``tiering`` commands that work on a cache folder: inspect, verify, bench.

All of them except ``bench`` are read-only: they open the index as an LMDB reader and never
take the writer lock, so they are safe on a cache a live server is using.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tiering import cli_args
from tiering.backends.sizes import format_size


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tiering.backends.reader import NamespaceReader, find_namespaces

    if str(args.path).startswith("mooncake://"):  # a shared store: the master's view
        return mooncake_view(args)
    out = []
    for folder in find_namespaces(args.path):
        with NamespaceReader(folder) as r:
            out.append(r.summary())
    if args.json:
        print(json.dumps({"path": str(args.path), "namespaces": out}, indent=2))
        return 0
    for s in out:
        print(f"namespace {s['namespace']}  ({s['path']})")
        print(f"  model {s['model']}  dtype {s['dtype']}  layout {s['layout']}  "
              f"chunk_tokens {s['chunk_tokens']}  parallel {s['parallel']}"
              + (f"  block order {s['block_order']}" if s["block_order"] else ""))
        print(f"  row {format_size(s['row_bytes'])}  capacity {format_size(s['capacity_bytes'])}"
              f" ({s['slots']} slots)  used {format_size(s['usage_bytes'])} "
              f"({100 * s['usage_perc']:.2f}%)  entries {s['entries']}")
        print(f"  stored {format_size(s['stored_bytes'])}  compressed entries "
              f"{s['compressed_entries']}  reserved slots {s['reserved_slots']}  "
              f"io engine {s['io_engine']}")
        print("  hits:  " + "  ".join(f"{k}: {v}" for k, v in s["hit_histogram"].items()))
        print("  ages:  " + "  ".join(f"{k}: {v}" for k, v in s["age_histogram"].items()))
    return 0


def mooncake_view(args: argparse.Namespace) -> int:
    """``inspect``/``stats`` of a Mooncake master: our namespaces' chunks and bytes there."""
    from tiering.backends.mooncake_admin import format_view, master_view, parse_address

    view = master_view(parse_address(str(args.path)))
    wanted = getattr(args, "namespace", None)  # a list (--namespace repeats) or one id
    if wanted:
        wanted = {wanted} if isinstance(wanted, str) else set(wanted)
        view["namespaces"] = [n for n in view["namespaces"] if n["namespace"] in wanted]
    if args.json:
        print(json.dumps({"path": str(args.path), **view}, indent=2))
    else:
        print("\n".join(format_view(view)))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from tiering.backends.reader import NamespaceReader, find_namespaces

    show = sys.stderr.isatty() and not args.json

    def progress(done: int, total: int) -> None:
        if show and (done == total or done % 256 == 0):
            width = 30
            filled = width * done // max(1, total)
            print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end="",
                  file=sys.stderr, flush=True)

    report: list[dict[str, Any]] = []
    corrupt_total = 0
    for folder in find_namespaces(args.path):
        with NamespaceReader(folder) as r:
            n = r.index.count()
            bad = r.verify(progress)
            damaged = r.damaged_slabs()
            if show:
                print(file=sys.stderr)
        corrupt_total += len(bad) + len(damaged)
        report.append({"namespace": folder.name, "checked": n,
                       "corrupt": [{"key": b.key.hex(), "slot": b.slot, "reason": b.reason}
                                   for b in bad],
                       "damaged_slabs": [{"file": f, "problem": p} for f, p in damaged.items()]})
    if args.json:
        print(json.dumps({"path": str(args.path), "ok": corrupt_total == 0,
                          "namespaces": report}, indent=2))
    else:
        for ns in report:
            problems = len(ns["corrupt"]) + len(ns["damaged_slabs"])
            status = "ok" if not problems else (
                f"{len(ns['corrupt'])} CORRUPT, {len(ns['damaged_slabs'])} DAMAGED SLAB FILES")
            print(f"namespace {ns['namespace']}: {ns['checked']} slots checked, {status}")
            for d in ns["damaged_slabs"]:
                print(f"  damaged slab {d['file']}: {d['problem']}, not a slab file (its rows "
                      "are misses)")
            for b in ns["corrupt"]:
                print(f"  corrupt key {b['key']} slot {b['slot']}: {b['reason']}")
    return 1 if corrupt_total else 0


def add_commands(sub: argparse._SubParsersAction[cli_args.Parser]) -> None:
    p = sub.add_parser("inspect", help="namespaces, capacity, usage, entries, histograms",
                       description="Summarise every namespace under PATH (read-only). PATH "
                       "mooncake://HOST:PORT (a Mooncake master's HTTP admin port): its view "
                       "of our namespaces (chunks, bytes, replicas) and its totals.")
    p.add_argument("path", type=cli_args.cache_path_or_store)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="checksum every slot; exit 1 on corruption",
                       description="Read every published slot and check its xxh3 checksum "
                       "(read-only). Exit 0: all good; 1: corrupt slots found (listed).")
    p.add_argument("path", type=cli_args.cache_path)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_verify)

    from tiering.bench import add_bench_command

    add_bench_command(sub)
