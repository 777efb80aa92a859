"""A real vLLM ``Scheduler`` with our spec loaded through ``spec_name``/``spec_module_path``,
stepped by hand. The worker is simulated: a job completes ``delay`` steps after it was issued
(at once when the scheduler asks to flush it), and loads report their request as received, as
vLLM's worker connector does. No model runs: this exercises the scheduler-side contract."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tiering.config import CONNECTOR_FIELDS  # noqa: E402

EOS = 2


class Harness:
    def __init__(self, model: str, extra: dict | None, gpu_tokens: int = 5120, delay: int = 0,
                 max_len: int = 2048, hash_algo: str = "sha256",
                 config_context: bool = True, batched_tokens: int | None = None,
                 max_num_seqs: int = 4, prefix_caching: bool = True,
                 scheduler_cls: type | None = None) -> None:
        """``config_context=False`` builds the scheduler as vLLM's EngineCore does, outside
        ``set_current_vllm_config``; ``extra=None``: no connector (vLLM without offloading);
        ``scheduler_cls``: a subclass of vLLM's ``Scheduler`` to build instead of it."""
        from vllm.platforms import current_platform

        if not current_platform.device_type:  # CUDA vLLM on a machine without a GPU: the
            current_platform.device_type = "cpu"  # scheduler side needs no device at all
        # our spec under our connector (what `tiering config` prints), vLLM's under its own
        fields = (CONNECTOR_FIELDS if extra and extra.get("spec_module_path") == "tiering.vllm"
                  else {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
        kvt = None if extra is None else KVTransferConfig(**fields,
                                                          kv_connector_extra_config=extra)
        args = EngineArgs(model=model, dtype="float32", max_model_len=max_len,
                          enable_prefix_caching=prefix_caching, kv_transfer_config=kvt,
                          max_num_batched_tokens=batched_tokens or max_len,
                          max_num_seqs=max_num_seqs,
                          enforce_eager=True,
                          prefix_caching_hash_algo=hash_algo)
        self.config = args.create_engine_config()
        self.block_size = bs = self.config.cache_config.block_size
        num_blocks = gpu_tokens // bs  # the GPU KV budget, whatever the platform's block size
        hf = self.config.model_config.hf_config
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=hf.num_key_value_heads,
                                 head_size=hf.hidden_size // hf.num_attention_heads,
                                 dtype=torch.float32)
        page = spec.page_size_bytes
        kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(
            size=page * num_blocks * len(layers), layers=layers,
            layer_stride=page * num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        self.config.cache_config.num_gpu_blocks = num_blocks
        cls = scheduler_cls or Scheduler
        if config_context:
            with set_current_vllm_config(self.config):
                self.scheduler = cls(self.config, kv, StructuredOutputManager(self.config),
                                     bs, log_stats=True)
        else:
            self.scheduler = cls(self.config, kv, StructuredOutputManager(self.config), bs,
                                 log_stats=True)
        connector = self.scheduler.connector
        self.manager = connector.connector_scheduler.manager if connector is not None else None
        init_none_hash(sha256)
        # vLLM's EngineCore hashes blocks when prefix caching is on or a connector is there
        self._hasher = (get_request_block_hasher(bs, sha256)
                        if prefix_caching or connector is not None else None)
        self.delay = delay
        self._pending: dict[int, tuple[int, str | None]] = {}  # job -> (due step, load req)
        self.step_no = 0
        self.loads = self.stores = self.flushed = 0
        self.cached: dict[str, int] = {}

    def add(self, rid: str, tokens: list[int], max_tokens: int = 2) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(request_id=rid, prompt_token_ids=tokens,
                                           sampling_params=sp, pooling_params=None,
                                           block_hasher=self._hasher))

    def step(self) -> None:
        self.step_no += 1
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if meta is None:  # no connector: only the model runner's part
            self._no_connector_step(out)
            return
        for j, job in meta.load_jobs.items():
            self._pending[j] = (self.step_no + self.delay, job.req_id)
            self.loads += 1
        for j in meta.store_jobs:
            self._pending[j] = (self.step_no + self.delay, None)
            self.stores += 1
        flush = set(meta.jobs_to_flush or ())
        self.flushed += len(flush & set(self._pending))
        done = {j for j, (due, _) in self._pending.items() if due <= self.step_no or j in flush}
        recv = {self._pending[j][1] for j in done if self._pending[j][1] is not None}
        for j in done:
            del self._pending[j]
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and rid not in self.cached:  # first schedule: what was found
                self.cached[rid] = req.num_computed_tokens - n
        running = [r for r in self.scheduler.running if out.num_scheduled_tokens.get(r.request_id)]
        reqs = [r.request_id for r in running]
        # a partial prefill (chunked) samples nothing, as the model runner reports it
        sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in running]
        mro = ModelRunnerOutput(
            req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=recv or None,
                kv_connector_worker_meta=OffloadingWorkerMetadata(
                    completed_jobs=dict.fromkeys(done, 1))))
        self.scheduler.update_from_output(out, mro)

    def _no_connector_step(self, out) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and rid not in self.cached:
                self.cached[rid] = req.num_computed_tokens - n
        running = [r for r in self.scheduler.running if out.num_scheduled_tokens.get(r.request_id)]
        reqs = [r.request_id for r in running]
        sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in running]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled))

    def run(self, max_steps: int = 500) -> None:
        """Step until every request finished and every transfer completed."""
        for _ in range(max_steps):
            if not self.scheduler.requests and not self._pending:
                break
            self.step()
        else:
            raise AssertionError(f"not finished after {max_steps} steps")
        self.step()  # let the connector see the last completions
        if self.manager is not None and hasattr(self.manager, "chain"):  # our spec's manager
            self.manager.chain.wait_idle()

    def reset_gpu_prefix_cache(self, connector: bool = False) -> None:
        assert self.scheduler.reset_prefix_cache(reset_connector=connector)
