"""Per-tier metrics, declared to vLLM and reported through ``get_stats``.

vLLM registers every name from ``TieredOffloadingSpec.build_metric_definitions`` with
prometheus_client in the API-server process (counters get ``_total`` appended) and adds its
engine labels; ``get_stats`` ships per-step deltas (counters), snapshots (gauges) and samples
(histograms) from the scheduler. Each metric has a ``tier`` label: ``cpu`` for the staging tier,
``disk`` for the first file tier, ``disk2``, ``disk3`` … for the next ones.
"""

from __future__ import annotations

from typing import Any

PREFIX = "vllm:kv_tier_"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# name -> (kind, documentation, extra label names)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "lookups": ("counter", "Chunk lookups that reached this tier.", ()),
    "hits": ("counter", "Chunk lookups this tier answered with a hit.", ()),
    "hit_bytes": ("counter", "Bytes of the chunks this tier hit.", ()),
    "stores": ("counter", "Chunks written into this tier.", ()),
    "store_bytes": ("counter", "Bytes written into this tier.", ()),
    "evictions": ("counter", "Chunks evicted from this tier by its policy.", ()),
    "rejections": ("counter", "Chunks offered to this tier and not written, by reason "
                   "(threshold: store_threshold not reached; full: nothing evictable; "
                   "error: write failed).", ("reason",)),
    "demotions": ("counter", "Chunks written down into this tier from the CPU tier.", ()),
    "demotion_bytes": ("counter", "Bytes written down into this tier.", ()),
    "promotions": ("counter", "Chunks read up from this tier into the CPU tier.", ()),
    "promotion_bytes": ("counter", "Bytes read up from this tier.", ()),
    "promotion_failures": ("counter", "Promotions that ended as a miss (read error, "
                           "checksum mismatch, chunk gone).", ()),
    "io_errors": ("counter", "Failed reads and writes of this tier.", ()),
    "checksum_failures": ("counter", "Reads whose checksum did not match (served as misses).",
                          ()),
    "usage_bytes": ("gauge", "Bytes held by this tier.", ()),
    "usage_perc": ("gauge", "Fraction of this tier's capacity in use (0..1).", ()),
    "capacity_bytes": ("gauge", "Capacity of this tier in bytes.", ()),
    "entries": ("gauge", "Chunks held by this tier.", ()),
    "info": ("gauge", "Always 1; labels describe the tier.", ("policy", "io_engine")),
    "transfer_seconds": ("histogram", "Latency of demotions and promotions, submit to "
                         "completion.", ("kind",)),
}


def tier_label(i: int) -> str:
    return "cpu" if i == 0 else ("disk" if i == 1 else f"disk{i}")


def definitions() -> dict[str, Any]:
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    out: dict[str, Any] = {}
    for name, (kind, doc, labels) in METRICS.items():
        labelnames = ("tier", *labels)
        if kind == "counter":
            out[PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=labelnames)
        elif kind == "gauge":
            out[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=labelnames)
        else:
            out[PREFIX + name] = OffloadingHistogramMetadata(
                documentation=doc, labelnames=labelnames, buckets=LATENCY_BUCKETS)
    return out


class TierMetrics:
    """Turns the chain's monotonic counters into per-call deltas for vLLM."""

    def __init__(self, policies: list[str]) -> None:
        self.policies = policies
        self._last: dict[tuple, float] = {}

    def _delta(self, stats, name: str, value: float, labels: tuple[str, ...]) -> None:
        key = (name, labels)
        first = key not in self._last
        d = value - self._last.get(key, 0)
        self._last[key] = value
        if d or first:  # report zeros once, so every series exists from the start
            stats.increase_counter(PREFIX + name, d, labels)

    def collect(self, chain) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        usage = chain.usage()
        for i, c in enumerate(chain.counters):
            tier = tier_label(i)
            if i > 0:  # the file tier evicts on its own; its count is the truth
                c.evictions = chain.file_tiers[i - 1].stats()["evictions"]
            for name in ("lookups", "hits", "hit_bytes", "stores", "store_bytes", "evictions",
                         "demotions", "demotion_bytes", "promotions", "promotion_bytes",
                         "promotion_failures"):
                self._delta(stats, name, getattr(c, name), (tier,))
            for reason, v in c.rejected.items():
                self._delta(stats, "rejections", v, (tier, reason))
            for kind, secs in c.latencies:
                stats.observe_histogram(PREFIX + "transfer_seconds", secs, (tier, kind))
            c.latencies.clear()
            if i == 0:
                used = usage["entries"] * chain.row_bytes
                cap = chain.num_rows * chain.row_bytes
                entries, engine = usage["entries"], "shm"
            else:
                ft = chain.file_tiers[i - 1]
                fs = ft.stats()
                self._delta(stats, "io_errors", fs["io_errors"], (tier,))
                self._delta(stats, "checksum_failures", fs["checksum_failures"], (tier,))
                used, cap, entries, engine = (fs["used_bytes"], fs["capacity_bytes"],
                                              fs["entries"], fs["engine"])
            stats.set_gauge(PREFIX + "usage_bytes", used, (tier,))
            stats.set_gauge(PREFIX + "usage_perc", used / cap if cap else 0.0, (tier,))
            stats.set_gauge(PREFIX + "capacity_bytes", cap, (tier,))
            stats.set_gauge(PREFIX + "entries", entries, (tier,))
            stats.set_gauge(PREFIX + "info", 1, (tier, self.policies[i], engine))
        return stats
