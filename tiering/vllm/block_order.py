"""GPU blocks handed out in ascending order, so that offloading copies are few and large.

Why: vLLM frees a finished request's blocks in reverse (``free_blocks(reversed(...))``: under
prefix caching its tail is evicted first), and hands new blocks out from the free queue's
head. Once the first blocks have been recycled, a request therefore gets its blocks in
descending order: 1024, 1023, ..., 993. Our worker joins the pages of a transfer into one copy
only where both sides continue upwards (``backends/block_copy.merge_runs``), so every such
block became a copy of its own: 0.5 MiB at the 1B shape. Counted through vLLM 0.33's own
scheduler and block pool (``tests/test_block_order.py``; docs/benchmarks.md, "GPU blocks in
order"): 1.4-2.5 blocks a load copy and 1.8-1.9 a store copy in vLLM's order, against 5-12 and
up to 32 (a whole 512-token prompt) when each allocation is sorted.

What changes: each ``get_new_blocks`` call of the scheduler's block pool returns the same
blocks, sorted by id. Which blocks are taken, and so which cached blocks are evicted, is
vLLM's choice as before; only which of them holds which position of the request changes,
which no KV cache reader depends on (the block table maps each position to its block). The
cost is one sort of each allocation on the scheduler thread (32 blocks a 512-token prompt).

Contract: set up once in the scheduler's ``__init__`` (vLLM's scheduler thread, before any
request); the wrapper runs inside vLLM's allocation, does no I/O and raises only what vLLM's
own ``get_new_blocks`` raised (blocks it cannot sort are returned as they came, with one
warning). Where this vLLM's
scheduler has no block pool with ``get_new_blocks``, or the spec's ``gpu_blocks_ascending``
is false, or the connector is not ours, vLLM's order is kept and one INFO line says why.

The upstream change that makes this unnecessary: free a request's blocks so that a later
allocation gets them in ascending order (append them reversed, or sort ``popleft_n``'s result),
where prefix caching's eviction order allows it.
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Any

log = logging.getLogger(__name__)

_BLOCK_ID = attrgetter("block_id")


def sort_new_blocks(pool: Any) -> bool:
    """Make ``pool.get_new_blocks`` return its blocks sorted by id (an instance attribute over
    the class's method; idempotent). False, changing nothing, where the pool has no such
    method."""
    get = getattr(pool, "get_new_blocks", None)
    if get is None or not callable(get):
        return False
    if getattr(get, "_tiering_sorted", False):
        return True

    failed: list[bool] = []

    def get_new_blocks(num_blocks: int) -> list[Any]:
        blocks: list[Any] = get(num_blocks)  # vLLM's errors (too few blocks) are vLLM's
        try:
            return sorted(blocks, key=_BLOCK_ID)
        except (AttributeError, TypeError) as exc:  # not vLLM's blocks: its order, never a raise
            if not failed:
                failed.append(True)
                log.warning("GPU blocks in vLLM's order from now on: could not sort %s (%s)",
                            type(blocks).__name__, exc)
            return blocks

    get_new_blocks._tiering_sorted = True  # type: ignore[attr-defined]
    pool.get_new_blocks = get_new_blocks
    return True


class AscendingBlocks:
    """Scheduler mixin: after vLLM's ``__init__``, the scheduler's GPU block pool hands out
    blocks in ascending order when our spec's ``gpu_blocks_ascending`` is on (the default).
    Owns no state of the scheduler's; replaces one method of its block pool instance."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from tiering.vllm.manager import TieredManager

        manager = TieredManager.of_scheduler(self)
        if manager is None:
            return  # no connector, or not our spec: vLLM's order, as under its own scheduler
        if not manager.gpu_blocks_ascending:
            log.info("GPU blocks in vLLM's order (\"gpu_blocks_ascending\": false in the "
                     "spec's config)")
            return
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        if not sort_new_blocks(pool):
            log.info("GPU blocks in vLLM's order (this vLLM's scheduler has no block pool "
                     "with get_new_blocks)")
            return
        log.info("GPU blocks handed out in ascending order (offloading copies join adjacent "
                 "blocks; \"gpu_blocks_ascending\": false keeps vLLM's order)")
