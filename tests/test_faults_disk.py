"""Fault suite, disk: damaged slab files, a full disk at start and while running.

Asserts: no wrong bytes ever returned; only rows in the damaged slab file are lost; the writer
opens and keeps accepting writes (on a full disk: those that fit in preallocated slabs), and
every tool exits 0/1/2 with at most one line."""

from __future__ import annotations

import contextlib
import os
import random
import shutil

import pytest
from faultutil import assert_tool_ok, cli
from tierutil import ROW, key, open_tier, read, row_for, store

SLAB_KINDS = ["flip", "truncate", "delete", "extend", "zero", "swap_files"]


def _damage_slab(folder, kind: str, rng: random.Random) -> set[int]:
    """Damage slab files; returns the indexes of the files touched."""
    files = sorted(folder.glob("slab-*.dat"))
    f = rng.randrange(len(files))
    path = files[f]
    size = path.stat().st_size
    if kind == "flip":
        with open(path, "r+b") as fh:
            for _ in range(rng.randint(1, 32)):
                off = rng.randrange(size)
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ 0xFF]))
    elif kind == "truncate":
        os.truncate(path, rng.randrange(size))
    elif kind == "delete":
        path.unlink()
    elif kind == "extend":
        with open(path, "ab") as fh:
            fh.write(os.urandom(rng.randint(1, 3 * ROW)))
    elif kind == "zero":
        with open(path, "r+b") as fh:
            fh.write(b"\0" * size)
    elif kind == "swap_files":
        g = (f + 1) % len(files)
        tmp = path.with_suffix(".swap")
        path.rename(tmp)
        files[g].rename(path)
        tmp.rename(files[g])
        return {f, g}
    return {f}


def test_slab_damage_is_a_miss_and_only_that_file_is_lost(tmp_path, trials):
    n = trials(len(SLAB_KINDS))
    rng = random.Random(5)
    lost_total = 0
    for trial in range(n):
        kind = SLAB_KINDS[trial % len(SLAB_KINDS)]
        path = tmp_path / f"s{trial}"
        with open_tier(path, slots=32) as t:  # 8 files of 4 rows
            store(t, [key(f"{trial}-{i}") for i in range(rng.randint(12, 32))])
            folder = t.folder
            slot_of = {k: t.entry(k).slot for k in t.keys()}
        damaged = _damage_slab(folder, kind, rng)
        proc = cli("verify", str(path))
        assert_tool_ok(proc, allowed=(0, 1))
        assert_tool_ok(cli("inspect", str(path)), allowed=(0,))
        with open_tier(path, slots=32) as t:
            for k, slot in slot_of.items():
                data, _ = read(t, k)
                if data is None:
                    assert slot // 4 in damaged, f"{kind}: key in an intact slab file was lost"
                    lost_total += 1
                else:
                    assert data == bytes(row_for(k)), f"{kind}: wrong bytes served"
            fresh = [key(f"fresh{trial}-{i}") for i in range(3)]
            store(t, fresh)
        with open_tier(path, slots=32) as t:
            for k in fresh:
                assert read(t, k)[0] == bytes(row_for(k))
        assert_tool_ok(cli("verify", str(path)), allowed=(0,))  # misses were dropped
        shutil.rmtree(path)
    print(f"slab damage: {n} trials, {lost_total} rows in damaged files became misses, "
          "0 wrong bytes, 0 rows lost from intact files")


def test_slab_that_is_a_directory_is_a_damaged_slab(tmp_path, capsys):
    """``rm NS/slab-0002.dat; mkdir NS/slab-0002.dat``: its rows are misses (counted), verify
    exits 1 naming it, the writer opens and serves the rest, writes never land there, and the
    folder (not ours as it is) and what is in it are never removed."""
    import json

    from tiering.cli import main

    keys = [key(i) for i in range(16)]
    with open_tier(tmp_path, slots=16) as t:  # 4 files of 4 rows
        store(t, keys)
        folder = t.folder
        slot_of = {k: t.entry(k).slot for k in keys}
    victim = folder / "slab-0002.dat"
    victim.unlink()
    victim.mkdir()
    (victim / "user.bin").write_bytes(b"user bytes")
    in_victim = {k for k, s in slot_of.items() if s // 4 == 2}
    assert len(in_victim) == 4
    assert main(["verify", str(tmp_path), "--json"]) == 1
    (ns,) = json.loads(capsys.readouterr().out)["namespaces"]
    assert ns["damaged_slabs"] == [{"file": "slab-0002.dat", "problem": "a folder"}]
    assert {bytes.fromhex(c["key"]) for c in ns["corrupt"]} == in_victim
    assert main(["verify", str(tmp_path)]) == 1
    assert "damaged slab slab-0002.dat" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path)]) == 0
    with open_tier(tmp_path, slots=16) as t:
        assert t.stats["io_errors"] == 4
        for k in keys:
            if k in in_victim:
                assert not t.contains(k) and read(t, k)[0] is None
            else:
                assert read(t, k)[0] == bytes(row_for(k))
        fresh = [key(f"fresh{i}") for i in range(8)]
        t.put(fresh, [row_for(k) for k in fresh])
        done = t.wait_idle()
        landed = [d.key for d in done if d.ok]
        assert len(landed) == 8 and len(t) == 12  # the victim's 4 slots are never used
        assert all(t.entry(k).slot // 4 != 2 for k in t.keys())
        for k in landed:
            assert read(t, k)[0] == bytes(row_for(k))
    for cmd in (["evict", str(tmp_path), "--bytes", "1"], ["clear", str(tmp_path)]):
        assert main(cmd) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert victim.is_dir() and (victim / "user.bin").read_bytes() == b"user bytes"



def _fill(path, leave: int = 0) -> None:
    """Fill the filesystem, then give back ``leave`` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 65536)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)


def _clean(mnt) -> None:
    for p in mnt.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_disk_full_at_start_the_writer_still_opens_serves_and_writes(small_fs, trials):
    n = trials(4)
    rng = random.Random(11)
    row = 64 * 1024
    for trial in range(n):
        keys = [key(f"{trial}-{i}") for i in range(rng.randint(1, 10))]
        with open_tier(small_fs, slots=16, row_bytes=row, slab_file_bytes=8 * row) as t:
            t.put(keys, [row_for(k, row) for k in keys])
            assert all(d.ok for d in t.wait_idle())
        _fill(small_fs / "filler", leave=rng.choice([0, 0, 4096, 20000]))
        for cmd in ("inspect", "verify", "stats", "export"):
            assert_tool_ok(cli(cmd, str(small_fs)), allowed=(0,))
        with open_tier(small_fs, slots=16, row_bytes=row, slab_file_bytes=8 * row) as t:
            for k in keys:
                assert read(t, k)[0] == bytes(row_for(k, row))
            more = [key(f"more{trial}-{i}") for i in range(16 - len(keys))]
            t.put(more, [row_for(k, row) for k in more])  # fits in the preallocated slabs
            assert all(d.ok for d in t.wait_idle())
        with pytest.raises(ValueError, match="bytes free"):  # a new namespace: clear refusal
            open_tier(small_fs, slots=16, row_bytes=row, model="other")
        with open_tier(small_fs, slots=16, row_bytes=row, slab_file_bytes=8 * row) as t:
            assert len(t) == 16  # every acknowledged write survived the restart
        _clean(small_fs)
    print(f"disk full at start: {n} trials, writer opened, served and wrote every time")


def test_disk_full_while_running_rejects_writes_keeps_reads(small_fs, trials):
    n = trials(4)
    rng = random.Random(12)
    row = 64 * 1024
    rejected = 0
    for trial in range(n):
        # sparse slabs (as where fallocate is refused) so that the disk can fill under us
        with open_tier(small_fs, slots=64, row_bytes=row, preallocate=False,
                       slab_file_bytes=row * 64) as t:
            early = [key(f"{trial}-e{i}") for i in range(rng.randint(1, 8))]
            t.put(early, [row_for(k, row) for k in early])
            assert all(d.ok for d in t.wait_idle())
            _fill(small_fs / "filler", leave=rng.choice([0, 4096, 3 * row]))
            later = [key(f"{trial}-l{i}") for i in range(12)]
            t.put(later, [row_for(k, row) for k in later])
            done = t.wait_idle()
            failed = [d for d in done if not d.ok]
            rejected += len(failed)
            assert t.stats["rejections:full"] + t.stats["rejections:error"] == len(failed)
            for d in done:  # a write either landed exactly or is absent
                if d.ok:
                    assert read(t, d.key)[0] == bytes(row_for(d.key, row))
                else:
                    assert not t.contains(d.key)
            for k in early:
                assert read(t, k)[0] == bytes(row_for(k, row))
            t.check(index=True)  # the failed writes left no slot, pin or record behind
            (small_fs / "filler").unlink()
            retry = [key(f"{trial}-r")]
            assert t.put(retry, [row_for(retry[0], row)]).admitted == retry
            assert all(d.ok for d in t.wait_idle()), "writes did not resume after space returned"
        _clean(small_fs)
    assert rejected > 0, "the disk never filled: the test proves nothing"
    print(f"disk full while running: {n} trials, {rejected} writes rejected as errors, "
          "0 wrong bytes, writes resumed every time")
