"""TieredOffloadingSpec: the entry point vLLM loads through ``spec_name``/``spec_module_path``.

vLLM builds the spec in every process of an engine (the scheduler and each worker) with the
same config. The constructor only parses and validates (one clear error naming the key, before
anything is allocated); the scheduler's ``get_manager`` opens the staging region and the file
tiers, each worker's ``get_worker`` maps the same staging region.

Row size follows vLLM's CPU tier: every worker's KV bytes of one chunk, side by side, rounded up
to 4096 (``worker_kv_bytes_per_block × copies × blocks_per_chunk``). ``copies`` is the world
size, or 1 when vLLM reports a replicated layout (``OffloadingConfig.replicated_layout``: e.g. an
MLA model under tensor parallelism, where every rank holds the same KV). Then, as for vLLM's own
CPU tier, the spec says so (``self.replicated_layout``), vLLM's worker connector submits stores
on rank 0 only, and every rank's worker reads and writes the one cell of the shared row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tiering.advisor import PromotionAdvisor
from tiering.backends.block_copy import BLOCK_ORDER, BlockCopier, MemcpyCopier
from tiering.backends.file_tier import FileTier
from tiering.backends.mooncake_tier import MooncakeTier
from tiering.backends.staging import StagingRegion, remove_stale
from tiering.chain import TierChain
from tiering.config import check_sizes, parse, staging_steps_warning
from tiering.cpu_tier import CpuTier
from tiering.settings import CUDA_CHUNK_TOKENS
from tiering.switch_interval import shorten_switch_interval
from tiering.vllm.compat import (
    CanonicalKVCaches,
    OffloadingSpec,
    async_scheduling,
    is_cuda_platform,
    max_batched_tokens,
    schedule_end_before_stores,
    share_vllm_logging,
)
from tiering.vllm.engine_facts import facts_from_config
from tiering.vllm.manager import TieredManager
from tiering.vllm.metrics import TierMetrics, definitions
from tiering.vllm.worker import TieredWorker, make_layout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

log = logging.getLogger(__name__)
PAGE = 4096


def default_blocks_per_chunk(config: OffloadingConfig, extra_config: Mapping[str, Any],
                             on_cuda: bool) -> int:
    """GPU blocks per offloaded chunk: ``CUDA_CHUNK_TOKENS`` worth on a CUDA GPU when the config
    sets no chunk size, else what vLLM's connector made of the config.

    Only where vLLM's config would be the same with the longer chunk: one block size for every
    offloaded group, and none with a window (a sliding-window or Mamba group's window was
    counted in the config's chunks) nor a block already that long. vLLM 0.32's groups have no
    window: its scheduler counts windows in the spec's chunks itself, so any chunk agrees."""
    bpc = int(config.cache.blocks_per_chunk)
    named = (extra_config.get(k) is not None for k in ("block_size", "blocks_per_chunk"))
    if not on_cuda or any(named):  # (vLLM reads a null value as unset too)
        return bpc
    groups = config.groups
    sizes = {int(g.tokens_per_block) for g in groups}
    if bpc != 1 or len(sizes) != 1 or any(
            getattr(g, "sliding_window_size_in_chunks", None) is not None for g in groups):
        return bpc
    tokens_per_block = sizes.pop()
    if tokens_per_block >= CUDA_CHUNK_TOKENS or CUDA_CHUNK_TOKENS % tokens_per_block:
        return bpc
    return CUDA_CHUNK_TOKENS // tokens_per_block


class TieredOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        share_vllm_logging()
        self.cfg = parse(dict(self.extra_config))
        # vLLM's connector reads the chunk from the spec (scheduler and worker alike)
        chosen = default_blocks_per_chunk(config, self.extra_config, is_cuda_platform())
        if chosen != int(config.cache.blocks_per_chunk):
            log.info("vllm-tiering: offloaded chunks of %d GPU blocks (%d tokens), our default "
                     "on CUDA; \"block_size\" in kv_connector_extra_config chooses another",
                     chosen, chosen * config.groups[0].tokens_per_block)
            self.blocks_per_chunk = chosen
        par = config.parallel
        self.world_size = max(1, par.world_size)
        # our staging region is one shared memory file for every rank, so one copy can serve all
        self.replicated_layout = bool(getattr(config, "replicated_layout", False))
        copies = 1 if self.replicated_layout else self.world_size
        self.cell_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        raw_row = self.cell_bytes * copies
        self.row_bytes = -(-raw_row // PAGE) * PAGE
        # Every process of the engine builds the spec; the namespace is only certain where the
        # tiers open (get_manager), so here the slabs of every namespace under a tier's path
        # count as its own; the tier's open checks its own namespace exactly.
        self.num_rows = check_sizes(self.cfg, self.row_bytes) if raw_row else 0
        self._manager: TieredManager | None = None
        self._worker: TieredWorker | None = None
        # set by TieredOffloadingConnector, which reports a failed load's blocks to vLLM
        self.load_errors_reported = False

    # -- scheduler side ----------------------------------------------------------------------------
    def get_manager(self) -> TieredManager:
        if self._manager is not None:
            return self._manager
        # populated: the file tiers' O_DIRECT reads land in these rows (restart hits as fast as
        # the first ones)
        region = StagingRegion(self.config.engine_id, self.num_rows, self.row_bytes,
                               populate=bool(self.cfg.files))
        remove_stale(keep=region.path)
        facts, info = facts_from_config(self.config, self.row_bytes, self.blocks_per_chunk,
                                        BLOCK_ORDER)
        tiers: list[FileTier | MooncakeTier] = []
        try:
            for fcfg in self.cfg.files:
                tiers.append(FileTier(fcfg, facts, info))
            for mcfg in self.cfg.mooncake:  # the shared store, below the file tiers
                tiers.append(MooncakeTier(mcfg, facts, info))
        except BaseException:
            for t in tiers:
                t.close()
            region.close(unlink=True)
            raise
        if self.cfg.files:
            if info["hash_algo"] is None:
                survive = ("may or may not survive a restart (the engine's config was not "
                           "reachable; sha256 and sha256_cbor keep them)")
            elif info["restart_safe"]:
                survive = "survive a restart"
            else:
                survive = ("do NOT survive a restart (use --prefix-caching-hash-algo sha256 to "
                           "keep them)")
            log.info("vllm-tiering: namespace %s (%s); prefix hash %s: cached chunks %s",
                     facts.namespace_id, facts.model, info["hash_algo"] or "unknown", survive)
        if tiers:
            shorten_switch_interval(self.cfg.switch_interval_ms)
        cpu = CpuTier(region, self.cfg.cpu.policy, self.cfg.cpu.store_threshold,
                      self.cfg.cpu.tracker_size)
        advisor = None
        if tiers and self.cfg.cpu.promote == "auto":
            # asynchronous scheduling: a step's time is the interval one step end later; a
            # connector that ends the step before offering its chunks: one step end earlier
            asynchronous = async_scheduling()
            after_end = schedule_end_before_stores()
            lag = int(asynchronous) - int(after_end)
            advisor = PromotionAdvisor(len(tiers), self.row_bytes, facts.chunk_tokens,
                                       self.cfg.cpu.prefill_tokens_per_s, step_lag=lag,
                                       step_outputs=self.cfg.cpu.step_timing != "schedule_ends",
                                       tokens_after_end=after_end,
                                       step_forward=self.cfg.cpu.step_timing == "forward")
            log.info("vllm-tiering: promotion advisor on (%s scheduling, step lag %d, steps "
                     "timed by %s)", "asynchronous" if asynchronous else "synchronous", lag,
                     self.cfg.cpu.step_timing)
        chain = TierChain(cpu, tiers, events=self.kv_events_config.enable_kv_cache_events,
                          advisor=advisor, promotion_reserve=self.cfg.cpu.promotion_reserve)
        self._manager = TieredManager(chain, TierMetrics(),
                                      on_shutdown=lambda: region.close(unlink=True),
                                      max_loading_requests=self.cfg.max_loading_requests,
                                      hits_first=self.cfg.hits_first,
                                      max_load_starts_per_step=self.cfg.max_load_starts_per_step,
                                      sort_gpu_blocks=self.cfg.sort_gpu_blocks)
        warning = staging_steps_warning(self.num_rows, facts.chunk_tokens, max_batched_tokens(),
                                        self.row_bytes, len(tiers))
        if warning:
            log.warning(warning)
        log.info("vllm-tiering: CPU tier %d rows x %d bytes (%s, store_threshold %d), "
                 "%d file tier(s), %d mooncake tier(s)", self.num_rows, self.row_bytes,
                 self.cfg.cpu.policy, self.cfg.cpu.store_threshold, len(self.cfg.files),
                 len(self.cfg.mooncake))
        return self._manager

    # -- worker side ---------------------------------------------------------------------------------
    def get_worker(self, kv_caches: CanonicalKVCaches) -> TieredWorker:
        if self._worker is not None:
            return self._worker
        region = StagingRegion(self.config.engine_id, self.num_rows, self.row_bytes)
        rank = self.config.parallel.rank
        cell = 0 if self.replicated_layout else rank
        layout = make_layout(kv_caches, region, cell, self.cell_bytes, self.blocks_per_chunk)
        on_device = kv_caches.tensors and kv_caches.tensors[0].tensor.device.type == "cuda"
        if on_device:
            from tiering.backends.cuda_copy import CudaCopier

            copier: BlockCopier = CudaCopier(region.base_address, region.num_rows * region.row_bytes,
                                    device=kv_caches.tensors[0].tensor.device,
                                    copy=self.cfg.gpu_copy,
                                    load_queue_bytes=self.cfg.load_queue_bytes,
                                    load_direct=self.cfg.load_direct,
                                    load_waves=self.cfg.load_waves,
                                    load_wave_streams=self.cfg.load_wave_streams)
            if self.cfg.load_queue_bytes:
                # the feeder waits for the GIL after each wait for room: Python's 5 ms lets
                # the few milliseconds of loads it keeps enqueued run dry while vLLM's
                # scheduler runs Python (tiering.settings, LOAD_QUEUE_BYTES)
                shorten_switch_interval(self.cfg.switch_interval_ms,
                                        "the loads' feeder thread gets the GIL back before "
                                        "the copy engine runs out of enqueued loads")
        else:
            copier = MemcpyCopier()
        log.info("vllm-tiering worker rank %d: %s copies (%s), %d KV tensors", rank,
                 copier.name, getattr(copier, "copy", "host"), len(kv_caches.tensors))
        if on_device and len(kv_caches.tensors) > 1:
            # measured on an H100 (docs/benchmarks.md, 2026-12-05b): 8B 100%-hit batches
            # 0.99-1.25x as fast as in vLLM's layout, 1B 1.28x, the compute unchanged
            log.info("vllm-tiering: this engine's KV layout keeps the blocks of each of %d KV "
                     "tensors apart, so a chunk copies in that many pieces each way. Under "
                     "\"kv_connector\": \"TieredOffloadingConnector\" (or with "
                     "VLLM_KV_CACHE_LAYOUT=BLHNC) vLLM keeps a block's layers together where "
                     "the attention backend reads that layout, and a chunk copies in one "
                     "(docs/vllm.md, \"The KV layout\")", len(kv_caches.tensors))
        self._worker = TieredWorker(layout, copier, region, self.load_errors_reported)
        return self._worker
