"""vLLM integration (the only package that imports vLLM).

* ``TieredOffloadingSpec`` — ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
  "tiering.vllm"`` in ``kv_connector_extra_config``.
* ``FileTier`` — our file tier under vLLM's ``TieringOffloadingSpec``: ``"secondary_tiers":
  [{"type": "FileTier", "module_path": "tiering.vllm", "path": …, "capacity": …}]``.
* ``S3FIFOPolicy``, ``TieringARCPolicy``, ``TieringLRUPolicy`` — our policies in vLLM's CPU
  tier: ``"eviction_policy": "S3FIFOPolicy", "cache_policy_module_path": "tiering.vllm"``.
"""

import logging

from tiering.vllm.cache_policy import S3FIFOPolicy, TieringARCPolicy, TieringLRUPolicy
from tiering.vllm.secondary import FileTier
from tiering.vllm.spec import TieredOffloadingSpec


def _share_vllm_logging() -> None:
    """Let our log lines appear where vLLM's do (same handlers, INFO and up)."""
    ours, theirs = logging.getLogger("tiering"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_share_vllm_logging()

__all__ = ["FileTier", "S3FIFOPolicy", "TieredOffloadingSpec", "TieringARCPolicy",
           "TieringLRUPolicy"]
