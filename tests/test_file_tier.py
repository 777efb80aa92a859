"""FileTier behaviour on real files and a real LMDB index."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from tierutil import ROW, facts, key, open_tier, read, row_for, store

from tiering.backends.file_tier import FileTier, NamespaceLocked
from tiering.backends.namespace import FORMAT_VERSION, NamespaceError
from tiering.backends.slab_io import aligned_buffer


def test_bytes_round_trip_exactly(tmp_path):
    with open_tier(tmp_path) as t:
        keys = [key(i) for i in range(10)]
        assert store(t, keys) == keys
        for k in keys:
            data, _ = read(t, k)
            assert data == bytes(row_for(k))


def test_unaligned_source_buffers_round_trip(tmp_path):
    with open_tier(tmp_path) as t:
        k = key("u")
        raw = bytearray(ROW + 1)
        raw[1:] = bytes(row_for(k))
        t.put([k], [memoryview(raw)[1:]])  # deliberately not page-aligned
        assert all(d.ok for d in t.wait_idle())
        assert read(t, k)[0] == bytes(row_for(k))


def test_restart_keeps_hits(tmp_path):
    keys = [key(i) for i in range(12)]
    with open_tier(tmp_path) as t:
        store(t, keys)
    with open_tier(tmp_path) as t:
        assert len(t) == 12
        assert all(t.contains(k) for k in keys)
        for k in keys:
            assert read(t, k)[0] == bytes(row_for(k))


def test_wrong_namespace_never_hits(tmp_path):
    with open_tier(tmp_path) as t:
        store(t, [key(1)])
    other = FileTier({"path": str(tmp_path), "capacity": 16 * ROW, "io": "posix"},
                     facts(model="another-model"))
    with other:
        assert not other.contains(key(1))
        assert other.folder.name != facts().namespace_id
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_evicted_key_is_gone_and_stays_gone(tmp_path):
    with open_tier(tmp_path, slots=4) as t:
        store(t, [key(i) for i in range(4)])
        t.touch([key(0), key(1), key(2)])  # key 3 is now least recently used
        store(t, [key(9)])
        assert not t.contains(key(3))
        assert read(t, key(3))[0] is None
        assert t.stats["evictions"] == 1
    with open_tier(tmp_path, slots=4) as t:
        assert not t.contains(key(3))
        assert t.contains(key(9))
        assert read(t, key(9))[0] == bytes(row_for(key(9)))


def test_full_tier_with_everything_pinned_rejects(tmp_path):
    with open_tier(tmp_path, slots=2) as t:
        store(t, [key(0), key(1)])
        outs = [aligned_buffer(ROW), aligned_buffer(ROW)]
        assert t.get([(key(0), outs[0], None), (key(1), outs[1], None)]) == [True, True]  # both pinned by reads
        assert t.put([key(2)], [row_for(key(2))]).admitted == []
        assert t.stats["rejections:full"] == 1
        t.wait_idle()
        assert t.contains(key(0)) and t.contains(key(1))


def test_keys_of_the_same_put_are_never_evicted_for_each_other(tmp_path):
    with open_tier(tmp_path, slots=3) as t:
        keys = [key(i) for i in range(5)]
        accepted = t.put(keys, [row_for(k) for k in keys]).admitted
        t.wait_idle()
        assert accepted == keys[:3]
        assert all(t.contains(k) for k in keys[:3])


def test_store_threshold_counts_offers(tmp_path):
    with open_tier(tmp_path, store_threshold=2) as t:
        k = key("t")
        assert t.put([k], [row_for(k)]).admitted == []
        assert t.stats["rejections:threshold"] == 1
        assert t.put([k], [row_for(k)]).admitted == [k]
        t.wait_idle()
        assert t.contains(k)


def test_restart_rebuilds_policy_order_from_access_times(tmp_path):
    with open_tier(tmp_path, slots=4) as t:
        store(t, [key(i) for i in range(4)])
        for i in (2, 0, 3):  # key 1 is the least recently used, then 2
            t.touch([key(i)])
    with open_tier(tmp_path, slots=4) as t:
        assert list(t.policy)[:2] == [key(1), key(2)]
        store(t, [key(8)])
        assert not t.contains(key(1)) and t.contains(key(2))


def test_hit_counts_persist(tmp_path):
    with open_tier(tmp_path) as t:
        store(t, [key(0)])
        t.touch([key(0)])
        t.touch([key(0)])
    with open_tier(tmp_path) as t:
        assert t.entry(key(0)).hits == 2


def test_capacity_shrink_drops_entries_beyond_it(tmp_path):
    with open_tier(tmp_path, slots=8) as t:
        store(t, [key(i) for i in range(8)])
    with open_tier(tmp_path, slots=4) as t:
        assert len(t) == 4
        for k in t.keys():
            assert read(t, k)[0] == bytes(row_for(k))


def test_zstd_round_trip_on_kv_like_data(tmp_path):
    rng = np.random.default_rng(0)
    big = 16 * ROW
    with open_tier(tmp_path, row_bytes=big, compression="zstd") as t:
        k = key("z")
        row = aligned_buffer(big)
        vals = rng.normal(0, 1, big // 2).astype(np.float32)
        np.frombuffer(row, np.uint16)[:] = (vals.view(np.uint32) >> 16).astype(np.uint16)  # bf16
        t.put([k], [row])
        assert all(d.ok for d in t.wait_idle())
        e = t.entry(k)
        assert e.codec == 1 and e.length < 0.8 * big
        out = aligned_buffer(big)
        t.get([(k, out, None)])
        assert all(d.ok for d in t.wait_idle())
        assert bytes(out) == bytes(row)


def test_zstd_stores_incompressible_rows_raw(tmp_path):
    with open_tier(tmp_path, compression="zstd") as t:
        store(t, [key(0)])
        assert t.entry(key(0)).codec == 0
        assert read(t, key(0))[0] == bytes(row_for(key(0)))


def test_files_and_folders_are_private(tmp_path):
    with open_tier(tmp_path / "cache") as t:
        folder = t.folder
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for p in folder.glob("slab-*.dat"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder / "meta.json").st_mode) == 0o600


def test_slabs_are_split_and_preallocated(tmp_path):
    with open_tier(tmp_path, slots=10) as t:  # 4 slots per file
        files = sorted(t.folder.glob("slab-*.dat"))
    assert [p.stat().st_size for p in files] == [4 * ROW, 4 * ROW, 2 * ROW]
    assert all(p.stat().st_blocks * 512 >= p.stat().st_size for p in files)


def test_second_writer_gets_clear_error_naming_pid(tmp_path):
    with open_tier(tmp_path):
        with pytest.raises(NamespaceLocked, match=f"by pid {os.getpid()}"):
            open_tier(tmp_path)


def test_older_format_version_is_refused(tmp_path):
    with open_tier(tmp_path) as t:
        store(t, [key(0)])
        meta_path = t.folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = FORMAT_VERSION - 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(NamespaceError, match=f"format version {FORMAT_VERSION - 1}.*refusing"):
        open_tier(tmp_path)


def test_meta_that_does_not_match_folder_is_refused(tmp_path):
    with open_tier(tmp_path) as t:
        meta_path = t.folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["namespace"] = "0123456789abcdef"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(NamespaceError, match="lives in folder"):
        open_tier(tmp_path)


def test_row_size_mismatch_is_a_clear_error(tmp_path):
    with open_tier(tmp_path) as t:
        with pytest.raises(ValueError, match="expected row_bytes=8192"):
            t.put([key(0)], [memoryview(bytearray(100))])
        assert len(t) == 0


def test_removed_listener_sees_every_key_that_leaves(tmp_path):
    keys = [key(i) for i in range(6)]
    seen: list[bytes] = []
    with open_tier(tmp_path, slots=4) as t:
        t.on_removed(seen.extend)
        store(t, keys[:4])
        store(t, keys[4:5])  # full: one evicted by put
        assert len(seen) == 1 and seen[0] in keys[:4] and not t.contains(seen[0])
        assert t.drop([keys[4]]) == 1  # dropped on request
        assert seen[-1] == keys[4]
        victims = t.evict(1)
        assert seen[-1:] == victims
        t.on_removed(None)
        t.clear()
        assert len(seen) == 3
