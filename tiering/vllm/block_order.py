"""GPU blocks handed out in the order our staging rows hold them, so that copies are few and large.

Why: our worker joins a transfer's pages into one copy only where the GPU side and the row side
both continue (``backends/block_copy.merge_runs``). Rows hold a chunk's blocks last position
first (``block_copy.BLOCK_ORDER``) and the CPU tier gives a job's chunks descending rows
(``CpuTier._allocate``), which fits what vLLM hands out once blocks are recycled: it frees a
finished request's blocks in reverse (under prefix caching its tail is evicted first) and
allocates from the free queue's head, so a request gets descending blocks. But only in runs:
an allocation mixes the tail of one freed request with the head of the next, and a fresh
cache's blocks ascend. Counted through vLLM 0.33's own scheduler and block pool with the
worker's own descriptor code (``tests/test_block_order.py``; docs/benchmarks.md, "GPU blocks
sorted for our copies"): 1.8 pages a copy in vLLM's order, 9.5-13 when each allocation is
sorted descending, with chunks of one block or four.

What changes: each ``get_new_blocks`` call of the scheduler's block pool returns the same
blocks, sorted by id, highest first. Which blocks are taken, and so which cached blocks are
evicted, is vLLM's choice as before; only which position of the request a new block holds
changes, which no KV cache reader depends on (the block table maps each position to its
block). The cost is one sort of each allocation on the scheduler thread (32 blocks a
512-token prompt).

Contract: set up once in the scheduler's ``__init__`` (vLLM's scheduler thread, before any
request); the wrapper runs inside vLLM's allocation, does no I/O and raises only what vLLM's
own ``get_new_blocks`` raised (blocks it cannot sort are returned as they came, with one
warning). Where this vLLM's scheduler has no block pool with ``get_new_blocks``, or the spec's
``sort_gpu_blocks`` is false, or the connector is not ours, vLLM's order is kept and one INFO
line says why.

The upstream change that makes this unnecessary: let the offloading connector say in which
order it wants a request's new blocks (or hand them out sorted), as it already says which KV
cache layout it wants.
"""

from __future__ import annotations

import logging
import weakref
from operator import attrgetter
from typing import Any

from tiering.backends.block_copy import BLOCK_ORDER

log = logging.getLogger(__name__)

_BLOCK_ID = attrgetter("block_id")
_SORTED_POOLS: weakref.WeakSet[Any] = weakref.WeakSet()  # pools whose get_new_blocks we wrapped


# Where rows hold a chunk's blocks last position first (``block_copy.BLOCK_ORDER``) and the CPU
# tier gives a job's chunks descending rows (``CpuTier._allocate``), a job whose GPU blocks
# descend is one run on both sides, whatever the chunk's block count
DESCENDING = BLOCK_ORDER == "last_first"


def is_sorted(pool: Any) -> bool:
    """Whether ``sort_new_blocks`` wrapped this pool's ``get_new_blocks``."""
    try:
        return pool in _SORTED_POOLS
    except TypeError:  # not weakly referable: never wrapped
        return False


def sort_new_blocks(pool: Any, descending: bool) -> bool:
    """Make ``pool.get_new_blocks`` return its blocks sorted by id, ``descending`` or not (an
    instance attribute over the class's method; a second call changes nothing). False,
    changing nothing, where the pool has no such method."""
    get = getattr(pool, "get_new_blocks", None)
    if get is None or not callable(get):
        return False
    if is_sorted(pool):
        return True
    failed: list[bool] = []

    def get_new_blocks(*args: Any, **kwargs: Any) -> list[Any]:
        blocks: list[Any] = list(get(*args, **kwargs))  # vLLM's errors (too few blocks) are its
        try:
            return sorted(blocks, key=_BLOCK_ID, reverse=descending)
        except (AttributeError, TypeError) as exc:  # not vLLM's blocks: its order, never a raise
            if not failed:
                failed.append(True)
                log.warning("GPU blocks in vLLM's order from now on: could not sort %s (%s)",
                            type(blocks).__name__, exc)
            return blocks

    pool.get_new_blocks = get_new_blocks
    _SORTED_POOLS.add(pool)
    return True


class SortedBlocks:
    """Scheduler mixin: after vLLM's ``__init__``, the scheduler's GPU block pool hands out
    each allocation's blocks in the order our rows hold them, when our spec's
    ``sort_gpu_blocks`` is on (the default). Owns no state of the scheduler's; replaces one
    method of its block pool instance."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from tiering.vllm.manager import TieredManager

        manager = TieredManager.of_scheduler(self)
        if manager is None:
            log.info("GPU blocks in vLLM's order (no connector over our spec behind this "
                     "scheduler)")
            return
        if not manager.sort_gpu_blocks:
            log.info("GPU blocks in vLLM's order (\"sort_gpu_blocks\": false in the spec's "
                     "config)")
            return
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        if not sort_new_blocks(pool, DESCENDING):
            log.info("GPU blocks in vLLM's order (this vLLM's scheduler has no block pool "
                     "with get_new_blocks)")
            return
        log.info("GPU blocks of each allocation handed out in %s order (copies join adjacent "
                 "blocks; \"sort_gpu_blocks\": false keeps vLLM's order)",
                 "descending" if DESCENDING else "ascending")
