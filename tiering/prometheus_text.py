"""Samples of a Prometheus text-format page (vLLM's /metrics): ``tiering watch``, the demo and
the tests read the tiers' counters with it."""

from __future__ import annotations

import re

#: parsed samples: (name, its label items) -> value
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)$')


def parse_metrics(text: str) -> Samples:
    """Prometheus text format -> {(name, frozenset(label items)): value}."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def metric(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return float(sum(v for (n, ls), v in samples.items() if n == name and want <= ls))
