"""The facts of a vLLM engine that decide its namespace: what makes stored rows usable by another engine."""

from __future__ import annotations

import os
from typing import Any

from tiering.backends.namespace import NamespaceFacts
from tiering.vllm.compat import prefix_hash_algo

# Block hashes that are the same in every process (with a fixed PYTHONHASHSEED where vLLM seeds
# the first hash from it): a cache keyed by them can serve a restarted server.
RESTART_SAFE_ALGOS = {"sha256", "sha256_cbor"}


def facts_from_config(c: Any, row_bytes: int, blocks_per_chunk: int | None = None,
                      block_order: str | None = None, canonical: bool = False
                      ) -> tuple[NamespaceFacts, dict[str, Any]]:
    """Namespace facts from vLLM's ``OffloadingConfig``, plus informational meta fields.

    ``blocks_per_chunk``: the spec's chunk when it chose its own (``spec.default_blocks_per_chunk``),
    else the config's. ``block_order``: how a row orders a chunk's blocks when the rows are laid
    out by our worker (``block_copy.BLOCK_ORDER``); recorded only where a chunk has more than one
    block (one block has one order: the rows of one-block chunks are the same bytes as before
    the order was chosen, and keep their namespace). ``canonical``: the rows are vLLM's own,
    in its canonical page format (``OffloadingConfig.canonical_layout``, the secondary path:
    every KV head of a layer in one page, other bytes than each worker's own pages in a row of
    the same size); recorded with vLLM's id of that format, which names its version."""
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
    if block_order is not None and bpc > 1:
        facts.extra["block_order"] = block_order
    if canonical:
        facts.extra["canonical_format"] = _canonical_format(facts.layout)
    restart_safe = algo in RESTART_SAFE_ALGOS or (
        algo is not None and "xxhash" not in algo and "PYTHONHASHSEED" in os.environ)
    return facts, {"hash_algo": algo, "restart_safe": restart_safe}


def _canonical_format(layout: str) -> str:
    """vLLM's id of its canonical page format for this KV layout (a new format version of
    vLLM's is a new namespace); where this vLLM cannot name it, the layout itself."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        return str(canonical_format_id(layout))
    except (ImportError, KeyError, ValueError):
        return f"canonical-{layout}"
