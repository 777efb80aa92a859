"""The ``tiering`` command line.

Exit codes: 0 success; 1 the command ran and found a problem (``verify`` found corrupt slots, a
live writer did not answer, a server could not be reached); 2 bad usage or bad input
(argparse's convention), with one message naming what was wrong.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NoReturn

from tiering import cli_args

if TYPE_CHECKING:
    from tiering.workloads import Request

log = logging.getLogger(__name__)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from tiering.simulate import format_table, simulate
    from tiering.workloads import BUILTIN, from_trace

    if args.trace:
        source, capacity = args.trace, args.capacity
        if capacity is None:
            raise ValueError("--capacity: required with --trace (tier capacity in chunks)")

        def requests() -> Iterator[Request]:  # re-read per run: a trace may not fit twice
            return from_trace(args.trace)
    else:
        wl = BUILTIN[args.workload]
        source, capacity = wl.name, args.capacity or wl.default_capacity
        cached = list(wl.make(args.seed))

        def requests() -> Iterator[Request]:
            return iter(cached)

    if args.cpu_capacity is not None:
        return _simulate_demotion(args, requests, source, capacity)
    results = [simulate(requests(), p, capacity, t) for p in args.policies
               for t in args.thresholds]
    if args.json:
        print(json.dumps({"workload": source, "capacity": capacity, "seed": args.seed,
                          "results": [r.as_dict() for r in results]}, indent=2))
    else:
        print(f"workload {source}  capacity {capacity} chunks  seed {args.seed}")
        print(format_table(results))
    return 0


def _simulate_demotion(args: argparse.Namespace, requests: Callable[[], Iterator[Request]],
                       source: str, capacity: int) -> int:
    from tiering.simulate import format_demotion_table, simulate_demotion

    results = [simulate_demotion(requests(), p, args.cpu_capacity, capacity, t, mode)
               for p in args.policies for t in args.thresholds
               for mode in ("on_store", "on_evict")]
    if args.json:
        print(json.dumps({"workload": source, "cpu_capacity": args.cpu_capacity,
                          "disk_capacity": capacity, "seed": args.seed,
                          "results": [r.as_dict() for r in results]}, indent=2))
    else:
        print(f"workload {source}  cpu {args.cpu_capacity} chunks over disk {capacity} chunks  "
              f"seed {args.seed}")
        print(format_demotion_table(results))
    return 0


class UsageError(Exception):
    """A bad command line (argparse's error), reported by ``main`` as one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors as one line naming the command and the argument (exit 2);
    ``--help`` still prints the full usage."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="tiering", description="Inspect, verify, benchmark and tune vllm-tiering caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser("simulate", help="replay a workload against policies x thresholds",
                         description="Trace-driven simulation of a tier: hit ratio, admitted "
                         "writes (SSD wear) and policy speed per policy x store_threshold.")
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=["zipf", "scan", "chat", "rag"], default="zipf",
                     help="built-in synthetic workload (default: zipf)")
    src.add_argument("--trace", type=cli_args.readable_file,
                     help="trace file: one 'key [request_id]' per line")
    sim.add_argument("--capacity", type=cli_args.integer(1, 10**9), help="tier capacity in "
                     "chunks (default: the workload's own)")
    sim.add_argument("--policies", type=cli_args.policy_list, default="lru,arc,s3fifo",
                     help="comma-separated policy names")
    sim.add_argument("--thresholds", type=cli_args.int_list(0, 1000), default="0,2",
                     help="comma-separated store_threshold values")
    sim.add_argument("--cpu-capacity", type=cli_args.integer(1, 10**9), metavar="CHUNKS",
                     help="simulate a CPU tier of this many chunks over the tier (--capacity) "
                     "and compare write-through (demote on_store) with write-back (on_evict)")
    sim.add_argument("--seed", type=cli_args.integer(0, 2**32 - 1), default=0)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(func=_cmd_simulate)

    from tiering import cli_admin, cli_cache

    cli_cache.add_commands(sub)
    cli_admin.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(_one_line(exc), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"tiering {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as exc:  # e.g. a live writer did not answer
        print(f"tiering {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:  # a path the system cannot walk is bad input; others are problems
        print(f"tiering {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2 if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR) else 1
    except Exception as exc:  # a bug: still one line (the traceback with -v)
        log.debug("tiering %s failed", args.command, exc_info=True)
        print(f"tiering {args.command}: unexpected {type(exc).__name__}: {_one_line(exc)} "
              "(run with -v for details)", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
