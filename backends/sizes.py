"""Byte sizes as users write them: ``4096``, ``"512MiB"``, ``"1TiB"``, ``"2GB"``."""

from __future__ import annotations

import math
import re
from decimal import Decimal

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d{1,30}(?:\.\d{1,30})?)\s*([a-zA-Z]{0,3})\s*$")
MAX_SIZE = 1 << 60  # 1 EiB: far beyond any cache, small enough for every offset type


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Parse a byte size (0 to 1 EiB); ValueError naming ``what`` on anything else.

    A float is taken when it is a whole number (JSON has no integers of its own: ``4e10``, and
    vLLM's ``--kv-offloading-size`` writes GiB x 2**30 as a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{what}: expected a byte size like 1073741824 or '1GiB', got "
                         f"{value!r:.40}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{what}: expected a whole number of bytes (or a size like "
                             f"'1.5GiB'), got {value!r:.40}")
        value = int(value)
    if isinstance(value, int):
        n = value
    else:
        m = _PATTERN.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}: expected a byte size like 1073741824 or '1GiB', got "
                             f"{value!r:.40}")
        n = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()])  # exact, never a float
    if n < 0:
        raise ValueError(f"{what}: must not be negative, got {value!r:.40}")
    if n > MAX_SIZE:
        raise ValueError(f"{what}: {value!r:.40} is larger than 1 EiB")
    return n


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
