"""vLLM integration (the only part of the ``tiering`` package that imports vLLM).

* ``TieredOffloadingConnector`` — vLLM's ``OffloadingConnector`` asking for the KV layout our
  worker copies fastest on a GPU: ``"kv_connector": "TieredOffloadingConnector",
  "kv_connector_module_path": "tiering.vllm"``.
* ``TieredOffloadingSpec`` — ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
  "tiering.vllm"`` in ``kv_connector_extra_config``.
* ``FileSecondaryTier`` — our file tier under vLLM's ``TieringOffloadingSpec``, named
  ``FileTier`` in configs (vLLM's factory looks the ``type`` up in this module):
  ``"secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm", "path": …,
  "capacity": …}]``. Not to be confused with ``tiering.backends.file_tier.FileTier``, the file
  tier itself, which it wraps.
* ``MooncakeTier`` — our Mooncake Store tier (shared by several engines) under vLLM's
  ``TieringOffloadingSpec``: ``{"type": "MooncakeTier", "module_path": "tiering.vllm",
  "master": …, "metadata": …}``.
* ``S3FIFOPolicy``, ``TieringARCPolicy``, ``TieringLRUPolicy`` — our policies in vLLM's CPU
  tier: ``"eviction_policy": "S3FIFOPolicy", "cache_policy_module_path": "tiering.vllm"``.
"""

from tiering.vllm.cache_policy import S3FIFOPolicy, TieringARCPolicy, TieringLRUPolicy
from tiering.vllm.connector import TieredOffloadingConnector
from tiering.vllm.secondary import FileSecondaryTier, MooncakeTier
from tiering.vllm.spec import TieredOffloadingSpec

# the name configs give vLLM's factory (``"type": "FileTier"``); kept for every existing config
FileTier = FileSecondaryTier

__all__ = ["FileSecondaryTier", "FileTier", "MooncakeTier", "S3FIFOPolicy",
           "TieredOffloadingConnector", "TieredOffloadingSpec", "TieringARCPolicy",
           "TieringLRUPolicy"]
