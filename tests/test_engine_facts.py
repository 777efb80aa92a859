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


def _tier(path, facts):
    from tiering.backends.file_tier import FileTier

    return FileTier({"path": str(path), "capacity": 16 * facts.row_bytes, "policy": "lru",
                     "io": "posix", "io_threads": 2, "slab_file_bytes": 4 * facts.row_bytes},
                    facts)


def test_a_disk_cache_of_the_old_order_is_never_served_and_inspect_tells_the_two_apart(
        tmp_path, capsys):
    """An engine upgraded past the cell order change opens a real file tier (real files, real
    LMDB) beside the rows its old version wrote: the old rows miss, stay intact for the old
    order, and ``tiering inspect`` (text and JSON) says which namespace holds which order, so
    the operator knows which one ``tiering clear --namespace`` may reclaim
    (docs/operations.md)."""
    import json

    from tierutil import key, store

    from tiering.cli import main
    from tiering.tier import Lookup

    row = 16 * 4096
    old, _ = facts_from_config(config(4), row)
    new, _ = facts_from_config(config(4), row, None, BLOCK_ORDER)
    with _tier(tmp_path, old) as t:
        store(t, [key(i) for i in range(4)])
    with _tier(tmp_path, new) as t:
        assert all(t.lookup(key(i)) is Lookup.MISS for i in range(4))
        store(t, [key(9)])
    with _tier(tmp_path, old) as t:
        assert all(t.lookup(key(i)) is Lookup.HIT for i in range(4))
        assert t.lookup(key(9)) is Lookup.MISS
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    by_id = {n["namespace"]: n for n in json.loads(capsys.readouterr().out)["namespaces"]}
    assert set(by_id) == {old.namespace_id, new.namespace_id}
    assert by_id[new.namespace_id]["block_order"] == "last_first"
    assert by_id[old.namespace_id]["block_order"] is None
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    parts = {ns: text[text.index(f"namespace {ns}"):] for ns in by_id}
    new_text = parts[new.namespace_id].split("\nnamespace ")[0]
    old_text = parts[old.namespace_id].split("\nnamespace ")[0]
    assert "block order last_first" in new_text and "block order" not in old_text


def test_an_upgrade_that_finds_no_room_beside_the_old_order_names_the_namespace_to_clear(
        small_fs):
    """A file tier sized to most of its drive, written before the cell order change: the
    upgraded engine's namespace is new and the old one's slabs still hold the drive, so its
    preallocating open is refused. The refusal must say where the space went (the old
    namespace, by id, and how to reclaim it), not only 'bytes free (plus 0 already allocated
    by this cache)'; the old rows are left as they were."""
    from tierutil import key, store

    from tiering.cli import main
    from tiering.tier import Lookup

    row = 64 * 1024
    old, _ = facts_from_config(config(4), row)
    new, _ = facts_from_config(config(4), row, None, BLOCK_ORDER)
    with _tier(small_fs, old) as t:
        store(t, [key(i) for i in range(3)])
    with pytest.raises(ValueError, match="bytes free") as exc:
        _tier(small_fs, new)
    msg = str(exc.value)
    assert old.namespace_id in msg and "tiering drop" in msg, msg
    with _tier(small_fs, old) as t:
        assert all(t.lookup(key(i)) is Lookup.HIT for i in range(3))
    # what the message says works (and what it warns of: an emptied namespace keeps its disk)
    assert main(["clear", str(small_fs), "--namespace", old.namespace_id]) == 0
    with pytest.raises(ValueError, match=old.namespace_id):
        _tier(small_fs, new)
    assert main(["drop", str(small_fs), "--namespace", old.namespace_id]) == 0
    with _tier(small_fs, new) as t:
        store(t, [key(7)])
        assert t.lookup(key(7)) is Lookup.HIT
