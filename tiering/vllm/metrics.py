"""Per-tier metrics, declared to vLLM and reported through ``get_stats``.

vLLM registers every name from ``TieredOffloadingSpec.build_metric_definitions`` with
prometheus_client in the API-server process (counters get ``_total`` appended) and adds its
engine labels; ``get_stats`` ships per-step deltas (counters), snapshots (gauges) and samples
(histograms) from the scheduler. Each metric has a ``tier`` label: ``cpu`` for the staging tier,
``disk`` for the first file tier, ``disk2``, ``disk3`` … for the next ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiering.chain import TierChain, tier_label
from tiering.settings import LATENCY_BUCKETS
from tiering.stats import COUNTER_KEYS, METRICS, fill_gauges, split_key

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

PREFIX = "vllm:kv_tier_"


def definitions() -> dict[str, Any]:
    """vLLM metric metadata for every metric of the registry (``tiering.stats.METRICS``)."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    out: dict[str, Any] = {}
    for m in METRICS:
        labelnames = ("tier", *m.labels) if m.per_tier else m.labels
        if m.kind == "counter":
            out[PREFIX + m.name] = OffloadingCounterMetadata(documentation=m.help,
                                                             labelnames=labelnames)
        elif m.kind == "gauge":
            out[PREFIX + m.name] = OffloadingGaugeMetadata(documentation=m.help,
                                                           labelnames=labelnames)
        else:
            out[PREFIX + m.name] = OffloadingHistogramMetadata(
                documentation=m.help, labelnames=labelnames, buckets=LATENCY_BUCKETS)
    return out


class TierMetrics:
    """Turns each tier's monotonic counters into per-call deltas for vLLM."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def _delta(self, stats: OffloadingConnectorStats, name: str, value: float, labels: tuple[str, ...]) -> None:
        key = (name, labels)
        first = key not in self._last
        d = value - self._last.get(key, 0)
        self._last[key] = value
        if d or first:  # report zeros once, so every series exists from the start
            stats.increase_counter(PREFIX + name, d, labels)

    def collect(self, chain: TierChain) -> OffloadingConnectorStats:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for i, tier in enumerate(chain.tiers):
            label = tier_label(i, tier.medium)
            for flat in COUNTER_KEYS:
                name, value = split_key(flat)
                labels = (label, value) if value else (label,)
                self._delta(stats, name, tier.stats[flat], labels)
            _, cap, entries = tier.usage()
            for gauge, level in fill_gauges(entries, cap, tier.row_bytes).items():
                stats.set_gauge(PREFIX + gauge, level, (label,))
            stats.set_gauge(PREFIX + "info", 1, (label, tier.policy_name,
                                                tier.io_name or "shm"))
        adv = chain.advisor
        if adv is not None:  # the fitted costs and each file tier's rate and queue
            for term, cost in (("step", adv.prefill.c), ("token", adv.prefill.a),
                               ("attention", adv.prefill.b)):
                stats.set_gauge(PREFIX + "advisor_prefill_seconds", cost, (term,))
            stats.set_gauge(PREFIX + "advisor_engine_backlog_seconds", adv.engine_backlog_s, ())
            stats.set_gauge(PREFIX + "advisor_waiting_requests", adv.waiting_requests, ())
            stats.set_gauge(PREFIX + "advisor_first_token_tail_seconds",
                            adv.first_token_tail_s, ())
            for i, backlog in chain.read_backlog_bytes().items():
                label = tier_label(i, chain.tiers[i].medium)
                rate = adv.read_rate(i) or 0.0
                stats.set_gauge(PREFIX + "read_bytes_per_second", rate, (label,))
                stats.set_gauge(PREFIX + "advisor_load_overhead_seconds",
                                adv.measured_load_overhead(i) or 0.0, (label,))
                stats.set_gauge(PREFIX + "read_backlog_bytes", backlog, (label,))
                stats.set_gauge(PREFIX + "advisor_queued_read_seconds",
                                backlog / rate if rate else 0.0, (label,))
        for i, kind, secs in chain.transfer_samples:
            stats.observe_histogram(PREFIX + "transfer_seconds", secs,
                                    (tier_label(i, chain.tiers[i].medium), kind))
        chain.transfer_samples.clear()
        return stats
