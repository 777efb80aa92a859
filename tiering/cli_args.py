"""Argument types of the ``tiering`` CLI: every value is parsed and bounded at parse time.

Each function returns an argparse ``type`` callable; a bad value raises
``argparse.ArgumentTypeError`` with what was expected, so argparse reports it as one line naming
the argument (``tiering evict: argument --bytes: expected ...``) and exits 2 before the command
touches anything.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from typing import TypeVar

from tiering.backends.sizes import MAX_SIZE, parse_size

#: the parser class of the command table the modules add their commands to (the CLI's own)
Parser = TypeVar("Parser", bound=argparse.ArgumentParser)
_NAMESPACE = re.compile(r"^[0-9a-f]{16}$")


def size(low: int = 1, high: int = MAX_SIZE, multiple: int = 1) -> Callable[[str], int]:
    """A byte size like 4096, 2MiB or 1GiB within [low, high], a multiple of ``multiple``."""
    def parse(text: str) -> int:
        try:
            n = parse_size(text, "size")
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a byte size like 4096, 2MiB or 1GiB, got {text!r:.40}") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"expected a size from {low} to {high} bytes, "
                                             f"got {text!r:.40}")
        if n % multiple:
            raise argparse.ArgumentTypeError(f"expected a multiple of {multiple} bytes, got "
                                             f"{text!r:.40}")
        return n
    return parse


def integer(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*[+-]?\d{1,19}\s*", text) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got "
                                             f"{text!r:.40}")
        return int(text)
    return parse


def seconds(low: float, high: float) -> Callable[[str], float]:
    """A finite number of seconds with ``low < value <= high``."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and low < v <= high):
            raise argparse.ArgumentTypeError(f"expected seconds greater than {low:g} and at "
                                             f"most {high:g}, got {text!r:.40}")
        return v
    return parse


def duration(text: str) -> float:
    from tiering.backends.admin import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m, 12h or 7d (at "
                                         f"most 100 years), got {text!r:.40}") from None


def namespace(text: str) -> str:
    if not _NAMESPACE.match(text):
        raise argparse.ArgumentTypeError(f"expected a namespace id (16 hex digits, as "
                                         f"`tiering inspect` shows), got {text!r:.40}")
    return text


def int_list(low: int, high: int) -> Callable[[str], list[int]]:
    """Comma-separated integers, at least one."""
    one = integer(low, high)

    def parse(text: str) -> list[int]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers from {low} to "
                                             f"{high}, got {text!r:.40}")
        try:
            return [one(p) for p in parts]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers from {low} "
                                             f"to {high}, got {text!r:.40}") from None
    return parse


def policy_list(text: str) -> list[str]:
    """Comma-separated registered policy names, at least one."""
    from tiering.policies import REGISTRY

    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in REGISTRY]
    if not names or bad:
        what = f"unknown policy {bad[0]!r}; " if bad else ""
        raise argparse.ArgumentTypeError(f"{what}expected comma-separated policy names from "
                                         f"{', '.join(sorted(REGISTRY))}, got {text!r:.40}")
    return names


def readable_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r:.80}")
    return text


def cache_path(text: str) -> str:
    """A cache root or namespace folder the system can walk (no link loop, names that fit)."""
    from tiering.backends.paths import path_problem

    problem = path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def cache_path_or_store(text: str) -> str:
    """``cache_path``, or a shared store's address (``mooncake://HOST:PORT``, checked by the
    command that reads it)."""
    return text if text.startswith("mooncake://") else cache_path(text)


def output_file(text: str) -> str:
    """A file to write: not empty, not a folder, in a folder that exists."""
    from tiering.backends.paths import path_problem

    problem = path_problem(text) if text else None
    if problem:
        raise argparse.ArgumentTypeError(problem)
    parent = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or os.path.isdir(text) or not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"expected a file path in an existing folder, got "
                                         f"{text!r:.80}")
    return text


def metrics_url(text: str) -> str:
    """An http(s) URL that can be requested as written: printable ASCII (HTTP carries nothing
    else; a non-ASCII host must be given in its punycode form), a host, a valid port."""
    from urllib.parse import urlsplit

    ok = bool(re.match(r"^https?://[^/\s]+", text)) and bool(re.fullmatch(r"[!-~]+", text))
    if ok:
        try:
            parts = urlsplit(text)
            ok = bool(parts.hostname) and (parts.port is None or 0 < parts.port < 65536)
        except ValueError:  # a bad port, an unclosed [IPv6
            ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"url: expected http(s)://HOST[:PORT][/metrics] in "
                                         f"printable ASCII, got {text!r:.80}")
    return text
