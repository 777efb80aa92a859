"""Samples of a Prometheus text-format page (vLLM's /metrics): ``tiering watch``, the demo and
the tests read the tiers' counters with it."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)$')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(name, frozenset(label items)): value}."""
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
