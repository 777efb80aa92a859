"""Prometheus text format for caches that are not attached to a server (``tiering export``).

Uses prometheus_client's own renderer over a custom collector, so names, escaping and TYPE/HELP
lines follow the exposition format exactly. Metric names mirror the server's
``vllm:kv_tier_*`` family without the ``vllm:`` prefix (a textfile is not a vLLM process):
``tiering_cache_*`` with labels ``path`` and ``namespace``, every one from the registry
(``tiering.stats``): the fill-level gauges and the counters the writer persisted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiering.backends.reader import NamespaceReader
from tiering.stats import COUNTER_KEYS, COUNTERS, FILL_GAUGES, GAUGES, fill_gauges, split_key


class CacheCollector:
    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders

    def collect(self) -> Iterator[Metric]:
        labels = ["path", "namespace"]
        gauges = {m.name: GaugeMetricFamily(f"tiering_cache_{m.name}", m.help, labels=labels)
                  for m in GAUGES if m.name in FILL_GAUGES}
        counters = {m.name: CounterMetricFamily(f"tiering_cache_{m.name}", m.help,
                                                labels=[*labels, *m.labels])
                    for m in COUNTERS}
        for folder in self.folders:
            with NamespaceReader(folder) as r:
                s = r.summary()
            lv = [str(folder.parent), folder.name]
            for gauge, level in fill_gauges(s["entries"], s["capacity_bytes"],
                                            s["row_bytes"]).items():
                gauges[gauge].add_metric(lv, level)
            for flat in COUNTER_KEYS:  # persisted by the writer under the registry's names
                name, value = split_key(flat)
                counters[name].add_metric([*lv, value] if value else lv, s["stats"][flat])
        yield from gauges.values()
        yield from counters.values()


def render(folders: list[Path]) -> str:
    reg = CollectorRegistry()
    reg.register(CacheCollector(folders))
    return generate_latest(reg).decode()
