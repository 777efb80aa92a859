"""vLLM integration (the only package that imports vLLM).

* ``TieredOffloadingSpec`` — ``"spec_name": "TieredOffloadingSpec", "spec_module_path":
  "tiering.vllm"`` in ``kv_connector_extra_config``.
"""

import logging

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

__all__ = ["TieredOffloadingSpec"]
