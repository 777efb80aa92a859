"""The one registry of tier metrics: every counter, gauge and histogram is defined here, once.

A tier (``tiering.tier.Tier``) owns a :class:`TierStats` and counts into it; everything else
reads it: the chain (rejections it decides), the vLLM metrics (``tiering.vllm.metrics``:
counters as deltas per step, gauges as snapshots), the Prometheus exporter of offline caches
(``tiering.exporter``), ``tiering stats``, and the file tier's persisted counters (LMDB
``stats`` database, written under the same flat names). The fill-level gauges are computed in
one place too (:func:`fill_gauges`). Adding a counter is one line in :data:`METRICS`.

A labelled counter (``rejections``) is stored as one flat value per label value:
``rejections:full``. The label values are fixed here, so every series exists from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()  # extra labels besides ``tier``
    values: tuple[str, ...] = ()  # a labelled counter's fixed values of its one extra label
    per_tier: bool = True  # False: one series per engine, no ``tier`` label


# Why the promotion advisor loaded or recomputed a request's run of disk hits (``disk_runs_loaded``
# and ``disk_runs_recomputed`` label ``reason``; ``tiering.advisor.Decision``).
LOAD_REASONS = ("faster", "engine_busy", "unmeasured")
RECOMPUTE_REASONS = ("faster", "disk_busy", "unmeasured", "no_cpu_row", "load_unmeasured")

# Why a chunk offered to a tier was not stored there (``rejections`` label ``reason``).
REJECT_REASONS = ("threshold", "full", "error", "pinned", "reserved")
# Why a remote (Mooncake) tier's operation on a chunk failed (``remote_errors`` label ``reason``).
REMOTE_ERROR_REASONS = ("unavailable", "timeout", "transfer", "full", "gone", "checksum", "header",
                        "short")

METRICS: tuple[Metric, ...] = (
    Metric("lookups", "counter", "Chunk lookups that reached this tier (one per request and "
           "chunk; vLLM's repeated asks about a pending chunk are not counted again)."),
    Metric("hits", "counter", "Chunk lookups this tier answered with a hit."),
    Metric("hit_bytes", "counter", "Bytes of the chunks this tier hit."),
    Metric("stores", "counter", "Chunks written into this tier."),
    Metric("store_bytes", "counter", "Bytes written into this tier."),
    # a promotion: a chunk of a tier below read into a CPU row; a load: a CPU row copied to
    # the GPU (vLLM's prepare_load/complete_load)
    Metric("promotions", "counter", "Chunks read out of this file tier into the CPU tier "
           "(calibration reads included)."),
    Metric("promotion_bytes", "counter", "Bytes read out of this file tier into the CPU tier."),
    Metric("loads", "counter", "Chunks of this CPU tier vLLM loaded to the GPU."),
    Metric("load_bytes", "counter", "Bytes of this CPU tier vLLM loaded to the GPU."),
    Metric("promotion_failures", "counter", "Reads that ended as a miss (I/O error, checksum "
           "mismatch, chunk gone, no CPU row free)."),
    Metric("promotions_declined", "counter", "Hits of this file tier not loaded because "
           "recomputing the chunk is faster than reading it (measured rates)."),
    Metric("disk_runs_loaded", "counter", "Requests' runs of disk hits on this file tier (the "
           "run's first tier) that the promotion advisor loaded, by reason (faster: reading "
           "beats recomputing; engine_busy: only because the engine had more compute queued in "
           "the step than the disk has reads queued; unmeasured: the engine's prefill cost was "
           "not measured yet).", ("reason",), LOAD_REASONS),
    Metric("disk_runs_recomputed", "counter", "Requests' runs of disk hits on this file tier "
           "that the promotion advisor recomputed instead, by reason (faster: recomputing beats "
           "reading; disk_busy: reading alone would pay, but not behind the reads queued on the "
           "tier; unmeasured: the tier's read rate was not measured yet, a calibration read "
           "measures it; no_cpu_row: decided to load, but every CPU row was pinned when its "
           "first chunk was to be read, so vLLM computed it).", ("reason",), RECOMPUTE_REASONS),
    Metric("calibration_reads", "counter", "Chunks read into scratch memory to measure this "
           "file tier's read rate (no request waits for them; also counted in promotions)."),
    Metric("evictions", "counter", "Chunks evicted from this tier by its policy."),
    Metric("rejections", "counter", "Chunks offered to this tier and not stored, by reason "
           "(threshold: store_threshold not reached; full: no room, disk full included; "
           "error: the write failed, a disk write or the GPU's copy into a CPU row; pinned: "
           "every candidate victim is in use; reserved: the CPU tier's last unpinned rows are "
           "kept for promotions from the tiers below, while promotions find every row pinned).",
           ("reason",), REJECT_REASONS),
    Metric("writeback_misses", "counter", "Chunks a file tier never got although they were "
           "owed to it (write-back, or write-through deferred by a disk that was behind): the CPU "
           "tier evicted them before they were written down."),
    Metric("demotions_deferred", "counter", "Write-through chunks whose write waited because the "
           "rows already being written to file tiers had reached the demotion budget (the disk "
           "was behind the stores); they are written oldest first as writes complete."),
    Metric("loads_deferred", "counter", "CPU tier: request scans told to wait a step because "
           "the most requests with a load to the GPU in flight were loading (vLLM's scheduler "
           "pays per in-flight load for every admission; max_loading_requests)."),
    Metric("io_errors", "counter", "Failed reads and writes of this tier."),
    Metric("index_resets", "counter", "Times a file tier found its index damaged at open and "
           "rebuilt it from what it could verify (or set it aside and started empty)."),
    Metric("checksum_failures", "counter", "Reads whose checksum did not match (served as "
           "misses)."),
    Metric("remote_errors", "counter", "Chunks whose operation on a remote (Mooncake) tier "
           "failed or was skipped, by reason (unavailable: the master did not answer or the "
           "client is not set up; timeout: a call overran the tier's timeout; transfer: moving "
           "the bytes failed, e.g. a peer left with its segment; full: no segment had room; gone: "
           "the chunk left the store before it was read; checksum, header, short: the value read "
           "was not the chunk stored). Each is a miss or a rejection, never wrong KV.",
           ("reason",), REMOTE_ERROR_REASONS),
    # the fill level (``fill_gauges``); ``usage_perc`` is a fraction, as vLLM's own
    # ``vllm:kv_cache_usage_perc`` of the GPU cache is
    Metric("usage_bytes", "gauge", "Bytes held by this tier (entries x row size)."),
    Metric("usage_perc", "gauge", "Fraction of this tier's capacity in use (0..1)."),
    Metric("capacity_bytes", "gauge", "Capacity of this tier in bytes."),
    Metric("entries", "gauge", "Chunks held by this tier."),
    Metric("row_bytes", "gauge", "Size of one chunk's row in this tier."),
    Metric("info", "gauge", "Always 1; labels describe the tier.", ("policy", "io_engine")),
    Metric("advisor_prefill_seconds", "gauge", "The promotion advisor's fitted prefill costs "
           "of the engine (no tier label): term=step (c, seconds a step costs whatever it "
           "computes), term=token (a, seconds per prompt token), term=attention (b, seconds per "
           "token per earlier token in its prompt).", ("term",), per_tier=False),
    Metric("advisor_engine_backlog_seconds", "gauge", "The promotion advisor's estimate of the "
           "compute waiting in the engine's queue (no tier label): the requests announced and "
           "not yet scheduled, priced as the recent ones. A disk run loads while its reads "
           "take less than this (disk_runs_loaded{reason=engine_busy}).", per_tier=False),
    Metric("advisor_waiting_requests", "gauge", "Requests announced to the connector and not "
           "yet reached by the scheduler (no tier label).", per_tier=False),
    Metric("advisor_first_token_tail_seconds", "gauge", "What a request whose hits were "
           "loaded waited from the load's landing on the GPU to its first token, the engine "
           "otherwise idle (no tier label; 0 until measured or restored): a load on an idle "
           "engine is priced with it, a recompute at no less.", per_tier=False),
    Metric("advisor_load_overhead_seconds", "gauge", "What a load from a file tier costs beyond "
           "its reads, as this engine measured it (decision to KV on the GPU, less the reads; 0 "
           "until a load was measured or restored from the tier's advisor.json)."),
    Metric("advisor_queued_read_seconds", "gauge", "The reads queued or in flight on a file "
           "tier, in seconds at its measured read rate (what a new promotion waits behind)."),
    Metric("read_bytes_per_second", "gauge", "A file tier's read rate as the promotion "
           "advisor measured it (0 until measured)."),
    Metric("read_backlog_bytes", "gauge", "Bytes of reads queued or in flight on a file tier "
           "(what a new promotion waits behind)."),
    Metric("transfer_seconds", "histogram", "Latency of stores into and promotions out of a "
           "file tier, submit to completion.", ("kind",)),
)

COUNTERS: tuple[Metric, ...] = tuple(m for m in METRICS if m.kind == "counter")
GAUGES: tuple[Metric, ...] = tuple(m for m in METRICS if m.kind == "gauge")
#: the gauges of a tier's fill level, the ones :func:`fill_gauges` computes
FILL_GAUGES: tuple[str, ...] = ("usage_bytes", "usage_perc", "capacity_bytes", "entries",
                                "row_bytes")
assert set(FILL_GAUGES) <= {m.name for m in GAUGES}, "a fill gauge missing from the registry"


def fill_gauges(entries: int, capacity_bytes: int, row_bytes: int) -> dict[str, float]:
    """A tier's fill-level gauges by registry name, from its entries and sizes: the one
    computation the vLLM metrics and the exporter of offline caches both report."""
    usage = entries * row_bytes
    return {"usage_bytes": usage, "usage_perc": usage / capacity_bytes if capacity_bytes else 0.0,
            "capacity_bytes": capacity_bytes, "entries": entries, "row_bytes": row_bytes}


def counter_keys() -> list[str]:
    """Every flat counter name, labelled ones expanded (``rejections:full``)."""
    out: list[str] = []
    for m in COUNTERS:
        out.extend(f"{m.name}:{v}" for v in m.values) if m.values else out.append(m.name)
    return out


COUNTER_KEYS: tuple[str, ...] = tuple(counter_keys())
_KNOWN = frozenset(COUNTER_KEYS)


def split_key(flat: str) -> tuple[str, str]:
    """``rejections:full`` -> (``rejections``, ``full``); ``hits`` -> (``hits``, ``"``)."""
    name, _, value = flat.partition(":")
    return name, value


class TierStats:
    """One tier's counters. Written by the tier's owner thread only; read by anyone.

    ``on_add`` (optional) sees every increment: the file tier forwards them to its committer,
    which persists them with the next index transaction.
    """

    def __init__(self, on_add: Callable[[str, int], None] | None = None) -> None:
        self.values: dict[str, int] = dict.fromkeys(COUNTER_KEYS, 0)
        self.on_add = on_add

    def add(self, key: str, n: int = 1) -> None:
        if key not in _KNOWN:
            raise KeyError(f"unknown counter {key!r}; defined ones: {', '.join(COUNTER_KEYS)}")
        if n:
            self.values[key] += n
            if self.on_add is not None:
                self.on_add(key, n)

    def lookup(self, hit: bool, nbytes: int = 0) -> None:
        """One counted lookup (the scheduler's hottest counter path: one call, no checks)."""
        v = self.values
        v["lookups"] += 1
        if hit:
            v["hits"] += 1
            v["hit_bytes"] += nbytes
        if self.on_add is not None:
            self.on_add("lookups", 1)
            if hit:
                self.on_add("hits", 1)
                self.on_add("hit_bytes", nbytes)

    def reject(self, reason: str, n: int = 1) -> None:
        self.add(f"rejections:{reason}", n)

    def __getitem__(self, key: str) -> int:
        return self.values[key]

    def items(self) -> Iterator[tuple[str, int]]:
        return iter(self.values.items())

    def snapshot(self) -> dict[str, int]:
        return dict(self.values)


def from_persisted(raw: dict[str, int]) -> dict[str, int]:
    """Persisted counters (LMDB ``stats``) as a full registry dict; unknown names dropped."""
    out = dict.fromkeys(COUNTER_KEYS, 0)
    for k, v in raw.items():
        if k in _KNOWN:
            out[k] = v
    return out
