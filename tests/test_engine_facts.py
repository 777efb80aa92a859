"""The namespace facts of an engine (tiering/vllm/engine_facts.py): what makes two engines'
rows the same bytes. Rows stored in another cell order are other bytes, so they must never be
served: a different order is a different namespace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tiering.backends.block_copy import BLOCK_ORDER  # noqa: E402
from tiering.vllm.engine_facts import facts_from_config  # noqa: E402


def config(blocks_per_chunk: int) -> SimpleNamespace:
    """The parts of vLLM's OffloadingConfig that the facts read."""
    return SimpleNamespace(
        model=SimpleNamespace(name="m", dtype="bfloat16"), kv_cache_layout=None,
        cache=SimpleNamespace(blocks_per_chunk=blocks_per_chunk),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=["l0", "l1"])],
        worker_kv_bytes_per_block=4096)


def test_chunks_of_several_blocks_stored_last_first_are_another_namespace():
    """A 4-block chunk's rows written before the cell order was recorded (block_order None)
    and rows written last position first have different namespaces: an upgraded engine never
    reads the old rows as if they were in the new order."""
    old, _ = facts_from_config(config(4), 16 * 4096)
    new, _ = facts_from_config(config(4), 16 * 4096, None, BLOCK_ORDER)
    assert new.extra["block_order"] == "last_first" and "block_order" not in old.extra
    assert new.namespace_id != old.namespace_id


def test_one_block_chunks_keep_their_namespace():
    """One block has one order: the rows of one-block chunks are the same bytes in either
    order, so their namespace (and a restarted server's hits) stay as they were."""
    old, _ = facts_from_config(config(1), 4096)
    new, _ = facts_from_config(config(1), 4096, None, BLOCK_ORDER)
    assert new == old and new.namespace_id == old.namespace_id
    spec_chunk, _ = facts_from_config(config(1), 4 * 4096, 4, BLOCK_ORDER)  # the spec's 64
    assert spec_chunk.extra["block_order"] == "last_first" and spec_chunk.chunk_tokens == 64
