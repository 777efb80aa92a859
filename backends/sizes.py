"""Byte sizes as users write them: ``4096``, ``"512MiB"``, ``"1TiB"``, ``"2GB"``."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Parse a byte size; ValueError naming ``what`` on anything else.

    A float is taken when it is a whole number (JSON has no integers of its own: ``4e10``, and
    vLLM's ``--kv-offloading-size`` writes GiB × 2**30 as a float)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a byte size like 1073741824 or '1GiB', got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{what}: expected a whole number of bytes (or a size like "
                             f"'1.5GiB'), got {value!r}")
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{what}: expected a byte size like 1073741824 or '1GiB', got {value!r}")


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
