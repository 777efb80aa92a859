"""The tiered spec's configuration (``kv_connector_extra_config``), parsed and validated.

Validation happens in two steps, both before vLLM allocates anything of ours: ``parse`` checks
every key and value that can be checked alone (names, sizes, policies, paths), ``check_sizes``
checks what needs the engine's row size (the CPU tier must hold a row, a file tier must hold a
row and fit on its disk). Each failure is one ``ValueError`` that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiering.backends.file_config import FileTierConfig, check_types, validate
from tiering.backends.mooncake_config import MooncakeTierConfig, check_row
from tiering.backends.sizes import parse_size
from tiering.policies import resolve
from tiering.settings import (
    HITS_FIRST_DEFAULT,
    IO_SWITCH_INTERVAL_S,
    LOAD_DIRECT,
    LOAD_QUEUE_BYTES,
    LOAD_WAVE_STREAMS,
    LOAD_WAVES,
    MAX_LOAD_STARTS_PER_STEP,
    PROMOTION_RESERVE_DEFAULT,
    SORT_GPU_BLOCKS_DEFAULT,
    STAGING_STEPS_OVER_A_LOWER_TIER,
)
from tiering.switch_interval import parse_switch_interval_ms

# Keys that vLLM itself reads from kv_connector_extra_config: accepted and passed through.
VLLM_KEYS = {
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
    "self_describing_kv_events", "canonical_layout", "sync_load_budget_bytes",
    "enable_kv_cache_events",
}
OUR_KEYS = {"cpu_bytes_to_use", "tiers", "gpu_copy", "max_loading_requests", "switch_interval_ms",
            "hits_first", "max_load_starts_per_step", "load_queue_bytes", "load_direct",
            "load_waves", "load_wave_streams", "sort_gpu_blocks"}
GPU_COPY_MODES = ("auto", "dma", "staged", "direct")  # backends/cuda_copy.py COPY_MODES
CPU_TIER_KEYS = {"medium", "policy", "store_threshold", "tracker_size", "promote",
                 "prefill_tokens_per_s", "promotion_reserve", "step_timing"}
# How the promotion advisor times the engine's steps (tiering.step_clock.StepClock):
# "forward" (default): each step's forward pass, timed on the worker (CUDA events) and carried
# back by our connector TieredOffloadingConnector, the step cost fitted from those spans; under
# vLLM's own connector, until the worker's first report, or while its reports stop, as
# "outputs": from a step's schedule end (or the output of a prefill step before it) to its own
# output, the step cost from the step ends; "schedule_ends": by the scheduler's step ends alone
# (before 2026-12-06e; at 32B on an H100 they saw half of an 8k prefill).
STEP_TIMINGS = ("forward", "outputs", "schedule_ends")
# "auto": load a disk hit only when reading it is faster than recomputing it (measured rates);
# "always": load every disk hit.
PROMOTE_MODES = ("auto", "always")


@dataclass
class CpuTierConfig:
    policy: str = "lru"
    store_threshold: int = 0
    tracker_size: int = 64_000
    promote: str = "auto"
    prefill_tokens_per_s: float | None = None  # None: measured while serving
    # share of the rows stores leave for promotions once one found every row pinned; 0: none
    # (tiering.settings.PROMOTION_RESERVE_FRACTION says why; off by default:
    # PROMOTION_RESERVE_DEFAULT)
    promotion_reserve: float = PROMOTION_RESERVE_DEFAULT
    step_timing: str = "forward"


@dataclass
class TieredConfig:
    cpu_bytes_to_use: int
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    files: list[FileTierConfig] = field(default_factory=list)
    # the shared Mooncake Store tier, at most one, below every file tier
    mooncake: list[MooncakeTierConfig] = field(default_factory=list)
    gpu_copy: str = "auto"  # how GPU workers move KV pages (backends/cuda_copy.py)
    # requests with a load to the GPU in flight at once (tiering.vllm.load_gate); 0: no cap;
    # None: the default (MAX_LOADING_REQUESTS, no cap under our TieringScheduler)
    max_loading_requests: int | None = None
    # the engine process's switch interval while tiers run I/O threads; 0: Python's own
    # (tiering.settings.IO_SWITCH_INTERVAL_S says why)
    switch_interval_ms: float = IO_SWITCH_INTERVAL_S * 1000
    # under tiering.vllm.scheduler.TieringScheduler: waiting requests whose prefix is in the
    # CPU tier are admitted (their loads started) before those that compute
    # (tiering/vllm/hits_first.py); no effect under vLLM's own scheduler
    hits_first: bool = HITS_FIRST_DEFAULT
    # under TieringScheduler: each allocation's GPU blocks sorted in the order our rows hold
    # them, so that copies join adjacent blocks (tiering/vllm/block_order.py); no effect under
    # vLLM's own scheduler
    sort_gpu_blocks: bool = SORT_GPU_BLOCKS_DEFAULT
    # loads started in one scheduler step while nothing computes (tiering.vllm.load_gate); 0:
    # no limit
    max_load_starts_per_step: int = MAX_LOAD_STARTS_PER_STEP
    # loads enqueued on the GPU's copy engine at once, the rest fed as room frees
    # (backends/copy_feeder.py); 0: all at once
    load_queue_bytes: int = LOAD_QUEUE_BYTES
    # a load with room in that queue and none waiting before it is enqueued by vLLM's worker
    # thread, without the hop to the feeder thread (tiering.settings LOAD_DIRECT)
    load_direct: bool = LOAD_DIRECT
    # room in that queue only once it is empty, a wave at most load_queue_bytes (so that vLLM's
    # own input copies get the copy engine between waves; tiering.settings LOAD_WAVES)
    load_waves: bool = LOAD_WAVES
    # load streams those waves take in turn: 2, the next wave waits queued on the other stream
    # while one copies (no idle copy engine between waves; tiering.settings LOAD_WAVE_STREAMS)
    load_wave_streams: int = LOAD_WAVE_STREAMS


def _int(value: Any, where: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value


def parse(extra: dict[str, Any]) -> TieredConfig:
    unknown = sorted(set(extra) - VLLM_KEYS - OUR_KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) "
                         f"{', '.join(map(repr, unknown))}; the tiered spec reads "
                         f"{', '.join(sorted(OUR_KEYS))} (plus vLLM's own "
                         f"{', '.join(sorted(VLLM_KEYS))})")
    if extra.get("cpu_bytes_to_use") in (None, 0, ""):
        raise ValueError("cpu_bytes_to_use: required (bytes of CPU staging memory, e.g. "
                         "'16GiB'), or pass --kv-offloading-size <GiB> to vllm serve")
    cpu_bytes = parse_size(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
    tiers = extra.get("tiers", [{"medium": "cpu"}])
    if not isinstance(tiers, list) or not tiers:
        raise ValueError(f"tiers: expected a non-empty list of tier objects, got {tiers!r}")
    gpu_copy = extra.get("gpu_copy", "auto")
    if gpu_copy not in GPU_COPY_MODES:
        raise ValueError(f"gpu_copy: expected one of {', '.join(GPU_COPY_MODES)}, got "
                         f"{gpu_copy!r}")
    cfg = TieredConfig(cpu_bytes_to_use=cpu_bytes, gpu_copy=gpu_copy,
                       max_loading_requests=None if "max_loading_requests" not in extra
                       else _int(extra["max_loading_requests"], "max_loading_requests", 0))
    cfg.switch_interval_ms = parse_switch_interval_ms(extra.get("switch_interval_ms"))
    hits_first = extra.get("hits_first", HITS_FIRST_DEFAULT)
    if not isinstance(hits_first, bool):
        raise ValueError(f"hits_first: expected true or false, got {hits_first!r}")
    cfg.hits_first = hits_first
    sort_blocks = extra.get("sort_gpu_blocks", SORT_GPU_BLOCKS_DEFAULT)
    if not isinstance(sort_blocks, bool):
        raise ValueError(f"sort_gpu_blocks: expected true or false, got {sort_blocks!r}")
    cfg.sort_gpu_blocks = sort_blocks
    cfg.max_load_starts_per_step = _int(extra.get("max_load_starts_per_step",
                                                  MAX_LOAD_STARTS_PER_STEP),
                                        "max_load_starts_per_step", 0)
    queue = extra.get("load_queue_bytes", LOAD_QUEUE_BYTES)
    cfg.load_queue_bytes = 0 if queue in (0, "0") else parse_size(queue, "load_queue_bytes")
    direct = extra.get("load_direct", LOAD_DIRECT)
    if not isinstance(direct, bool):
        raise ValueError(f"load_direct: expected true or false, got {direct!r}")
    cfg.load_direct = direct
    waves = extra.get("load_waves", LOAD_WAVES)
    if not isinstance(waves, bool):
        raise ValueError(f"load_waves: expected true or false, got {waves!r}")
    cfg.load_waves = waves
    # without waves the default is one stream: only a load_wave_streams given is refused
    lanes = extra.get("load_wave_streams", LOAD_WAVE_STREAMS if waves else 1)
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes not in (1, 2):
        raise ValueError(f"load_wave_streams: expected 1 or 2, got {lanes!r}")
    if lanes == 2 and not waves:
        raise ValueError("load_wave_streams: 2 (streams taking turns by waves) needs load_waves "
                         "true, got load_waves false")
    cfg.load_wave_streams = lanes
    for i, tier in enumerate(tiers):
        where = f"tiers[{i}]"
        if not isinstance(tier, dict):
            raise ValueError(f"{where}: expected an object, got {tier!r}")
        medium = tier.get("medium")
        if i == 0:
            if medium != "cpu":
                raise ValueError(f"{where}.medium: tier 0 is the CPU staging tier and must be "
                                 f"'cpu', got {medium!r}")
            bad = sorted(set(tier) - CPU_TIER_KEYS)
            if bad:
                raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, bad))}; "
                                 f"known: {', '.join(sorted(CPU_TIER_KEYS))}")
            policy = tier.get("policy", "lru")
            try:
                resolve(policy)
            except ValueError as exc:
                raise ValueError(f"{where}.policy: {exc}") from None
            promote = tier.get("promote", "auto")
            if promote not in PROMOTE_MODES:
                raise ValueError(f"{where}.promote: expected one of {', '.join(PROMOTE_MODES)}, "
                                 f"got {promote!r}")
            rate = tier.get("prefill_tokens_per_s")
            if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                                     or not 0 < rate < float("inf")):
                raise ValueError(f"{where}.prefill_tokens_per_s: expected a positive number of "
                                 f"tokens per second, got {rate!r}")
            reserve = tier.get("promotion_reserve", PROMOTION_RESERVE_DEFAULT)
            if (isinstance(reserve, bool) or not isinstance(reserve, int | float)
                    or not 0 <= reserve < 0.5):
                raise ValueError(f"{where}.promotion_reserve: expected a share of the CPU rows "
                                 f">= 0 and < 0.5 (0: no reserve), got {reserve!r}")
            timing = tier.get("step_timing", "forward")
            if timing not in STEP_TIMINGS:
                raise ValueError(f"{where}.step_timing: expected one of "
                                 f"{', '.join(STEP_TIMINGS)}, got {timing!r}")
            cfg.cpu = CpuTierConfig(
                policy, _int(tier.get("store_threshold", 0), f"{where}.store_threshold", 0),
                _int(tier.get("tracker_size", 64_000), f"{where}.tracker_size", 1),
                promote, rate, float(reserve), timing)
            continue
        if medium == "mooncake":
            if cfg.mooncake:
                raise ValueError(f"{where}: a second mooncake tier; one shared store is the last "
                                 "tier")
            cfg.mooncake.append(MooncakeTierConfig.from_dict(
                {k: v for k, v in tier.items() if k != "medium"}, where))
            continue
        if medium != "file":
            raise ValueError(f"{where}.medium: expected 'file' or 'mooncake' (tiers after the "
                             f"first are file tiers, then at most one mooncake tier), got "
                             f"{medium!r}")
        if cfg.mooncake:
            raise ValueError(f"{where}: a file tier after the mooncake tier; the shared store "
                             "is the last tier (put file tiers between cpu and mooncake)")
        body = {k: v for k, v in tier.items() if k != "medium"}
        if not body.get("path"):
            raise ValueError(f"{where}.path: required (a folder on the NVMe/filesystem tier)")
        try:
            fcfg = FileTierConfig.from_dict(body, where)
            check_types(fcfg)
            parse_size(fcfg.capacity, "capacity")
            resolve(fcfg.policy)
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        cfg.files.append(fcfg)
    paths = [f.path for f in cfg.files]
    if len(set(paths)) != len(paths):
        raise ValueError("tiers: two file tiers share one path; give each its own folder")
    return cfg


def check_sizes(cfg: TieredConfig, row_bytes: int, namespace_id: str | None = None) -> int:
    """Check sizes against the engine's row; returns the number of CPU rows. ``namespace_id``:
    the engine's namespace, whose slabs already on disk count as space the tier owns (None: the
    slabs of every namespace under each tier's path count)."""
    rows = cfg.cpu_bytes_to_use // row_bytes
    if rows < 1:
        raise ValueError(f"cpu_bytes_to_use: {cfg.cpu_bytes_to_use} bytes holds no row; one "
                         f"row of this engine is {row_bytes} bytes")
    for i, f in enumerate(cfg.files, start=1):
        try:
            validate(f, row_bytes, namespace_id)
        except ValueError as exc:
            raise ValueError(f"tiers[{i}].{exc}") from None
    for i, m in enumerate(cfg.mooncake, start=1 + len(cfg.files)):
        try:
            check_row(m, row_bytes)
        except ValueError as exc:
            raise ValueError(f"tiers[{i}].{exc}") from None
    return rows


def staging_steps_warning(num_rows: int, chunk_tokens: int, step_tokens: int | None,
                          row_bytes: int, lower_tiers: int) -> str | None:
    """The start-up warning for a CPU tier that holds fewer than
    ``STAGING_STEPS_OVER_A_LOWER_TIER`` engine steps of stores while ``lower_tiers`` file or
    Mooncake tiers sit under it, or None (enough rows, no tier below, or the engine's
    ``max_num_batched_tokens`` unknown)."""
    if not lower_tiers or not step_tokens or chunk_tokens <= 0:
        return None
    rows_per_step = -(-step_tokens // chunk_tokens)
    need_rows = STAGING_STEPS_OVER_A_LOWER_TIER * rows_per_step
    if num_rows >= need_rows:
        return None
    return (f"vllm-tiering: the CPU tier's {num_rows} rows hold {num_rows / rows_per_step:.1f} "
            f"steps of stores (max_num_batched_tokens {step_tokens}, {chunk_tokens} tokens a "
            f"row). When steps are full of new prompts, a step's stores pin their rows until "
            f"the step after ends while the {lower_tiers} tier(s) under it need rows for their "
            "writes and promotions: most stores and promotions then find every row taken, and "
            f"the tiers below get little. Give cpu_bytes_to_use at least {need_rows * row_bytes} "
            f"bytes ({STAGING_STEPS_OVER_A_LOWER_TIER} steps).")


# The ``--kv-transfer-config`` fields that select our connector (tiering.vllm.connector: vLLM's
# OffloadingConnector asking for the KV layout our worker copies fastest on a GPU, and reporting
# a load that could not be copied as vLLM's load error, which "recompute" turns into a miss)
CONNECTOR_FIELDS: dict[str, str] = {"kv_connector": "TieredOffloadingConnector",
                                    "kv_connector_module_path": "tiering.vllm",
                                    "kv_role": "kv_both",
                                    "kv_load_failure_policy": "recompute"}


def build_transfer_config(args: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` for ``tiering config`` flags, validated like at engine
    start (the same ``parse``), plus the checks that need no engine: each disk path is
    writable and its capacity fits the free space."""
    tiers: list[dict[str, Any]] = [{"medium": "cpu", "policy": args.cpu_policy,
                                    "store_threshold": args.cpu_threshold}]
    for spec in args.disk:
        path, sep, cap = spec.rpartition(":")
        if not sep or not path:
            raise ValueError(f"--disk: expected PATH:CAPACITY like /mnt/nvme/kv:1TiB, got {spec!r}")
        tiers.append({"medium": "file", "path": path, "capacity": cap, "policy": args.policy,
                      "store_threshold": args.threshold, "io": args.io,
                      "io_threads": args.io_threads, "compression": args.compression,
                      "verify": True})
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "cpu_bytes_to_use": parse_size(args.cpu, "--cpu"), "tiers": tiers}
    cfg = parse(extra)
    for i, f in enumerate(cfg.files, start=1):
        try:
            validate(f, row_bytes=4096)  # the real row size is known only at engine start
        except ValueError as exc:
            raise ValueError(f"tiers[{i}].{exc}") from None
    return {**CONNECTOR_FIELDS, "kv_connector_extra_config": extra}
