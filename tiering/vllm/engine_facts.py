"""The facts of a vLLM engine that decide its namespace: what makes stored rows usable by another engine."""

from __future__ import annotations

import os
from typing import Any

from tiering.backends.namespace import NamespaceFacts
from tiering.vllm.compat import prefix_hash_algo

# Block hashes that are the same in every process (with a fixed PYTHONHASHSEED where vLLM seeds
# the first hash from it): a cache keyed by them can serve a restarted server.
RESTART_SAFE_ALGOS = {"sha256", "sha256_cbor"}


def facts_from_config(c: Any, row_bytes: int, blocks_per_chunk: int | None = None
                      ) -> tuple[NamespaceFacts, dict[str, Any]]:
    """Namespace facts from vLLM's ``OffloadingConfig``, plus informational meta fields.

    ``blocks_per_chunk``: the spec's chunk when it chose its own (``spec.default_blocks_per_chunk``),
    else the config's."""
    bpc = c.cache.blocks_per_chunk if blocks_per_chunk is None else blocks_per_chunk
    par = c.parallel
    algo = prefix_hash_algo()
    facts = NamespaceFacts(
        model=c.model.name, dtype=str(c.model.dtype),
        layout=str(getattr(c, "kv_cache_layout", None) or "LBHNC"), row_bytes=row_bytes,
        chunk_tokens=int(c.groups[0].tokens_per_block) * bpc,
        parallel={"world_size": par.world_size, "tp": par.tp_size, "pp": par.pp_size,
                  "pcp": par.pcp_size, "dcp": par.dcp_size,
                  "replicated": bool(getattr(c, "replicated_layout", False))},
        extra={"groups": [[g.tokens_per_block, len(g.layer_names)] for g in c.groups],
               "worker_kv_bytes_per_block": c.worker_kv_bytes_per_block, "hash_algo": algo})
    restart_safe = algo in RESTART_SAFE_ALGOS or (
        algo is not None and "xxhash" not in algo and "PYTHONHASHSEED" in os.environ)
    return facts, {"hash_algo": algo, "restart_safe": restart_safe}
