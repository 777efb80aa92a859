"""vLLM integration (the only part of the ``tiering`` package that imports vLLM).

* ``TieredOffloadingSpec`` — ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
  "tiering.vllm"`` in ``kv_connector_extra_config``.
* ``FileTier`` — our file tier under vLLM's ``TieringOffloadingSpec``: ``"secondary_tiers":
  [{"type": "FileTier", "module_path": "tiering.vllm", "path": …, "capacity": …}]``.
* ``MooncakeTier`` — our Mooncake Store tier (shared by several engines) under vLLM's
  ``TieringOffloadingSpec``: ``{"type": "MooncakeTier", "module_path": "tiering.vllm",
  "master": …, "metadata": …}``.
* ``S3FIFOPolicy``, ``TieringARCPolicy``, ``TieringLRUPolicy`` — our policies in vLLM's CPU
  tier: ``"eviction_policy": "S3FIFOPolicy", "cache_policy_module_path": "tiering.vllm"``.
"""

from tiering.vllm.cache_policy import S3FIFOPolicy, TieringARCPolicy, TieringLRUPolicy
from tiering.vllm.secondary import FileTier, MooncakeTier
from tiering.vllm.spec import TieredOffloadingSpec

__all__ = ["FileTier", "MooncakeTier", "S3FIFOPolicy", "TieredOffloadingSpec", "TieringARCPolicy",
           "TieringLRUPolicy"]
