"""Faults: bad config, crashes mid-write, disk full, corrupt slabs. Each ends as a miss or a
clear error, never as wrong bytes or a crash of the owner."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tierutil import ROW, facts, key, open_tier, read, row_for, store

from tiering.backends.file_tier import FileTier
from tiering.cli import main as cli_main

TESTS = Path(__file__).parent


@pytest.mark.parametrize("override, message", [
    ({"capacity": "lots"}, "capacity: expected a byte size"),
    ({"capacity": 100}, "capacity: 100 bytes holds no row"),
    ({"capacity": "1PiB"}, "capacity: expected a byte size"),
    ({"capacity": 10**18}, "has only .* bytes free"),
    ({"io": "spdk"}, "io: unknown I/O kind 'spdk'"),
    ({"compression": "lz4"}, "compression: unknown codec 'lz4'"),
    ({"policy": "mru"}, "unknown policy 'mru'"),
    ({"store_threshold": -1}, "store_threshold: expected an integer from 0"),
    ({"io_threads": 0}, "io_threads: expected an integer from 1"),
    ({"colour": "red"}, "unknown key.*'colour'"),
])
def test_bad_config_is_one_clear_error_and_creates_nothing(tmp_path, override, message):
    path = tmp_path / "cache"
    cfg = {"path": str(path), "capacity": 16 * ROW, "io": "posix", **override}
    with pytest.raises(ValueError, match=message):
        FileTier(cfg, facts())
    assert not path.exists()


def test_row_bytes_must_be_page_multiple(tmp_path):
    with pytest.raises(ValueError, match="row_bytes: must be a positive multiple of 4096"):
        FileTier({"path": str(tmp_path / "c"), "capacity": "1MiB"}, facts(row_bytes=5000))
    assert not (tmp_path / "c").exists()


def test_unwritable_path_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.access(ro, os.W_OK):  # root ignores mode bits: use a path under a regular file
        ro = tmp_path / "file"
        ro.write_text("x")
        target, message = ro / "cache", "not writable|not a folder|exists and is not a folder"
    else:
        target, message = ro / "cache", "not writable"
    with pytest.raises(ValueError, match=message):
        FileTier({"path": str(target), "capacity": 16 * ROW, "io": "posix"}, facts())


def test_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        FileTier({"path": str(f), "capacity": 16 * ROW, "io": "posix"}, facts())


def test_flipped_byte_is_a_miss_and_verify_reports_it(tmp_path, capsys):
    keys = [key(i) for i in range(6)]
    with open_tier(tmp_path) as t:
        store(t, keys)
        victim = keys[3]
        slot = t.entry(victim).slot
        slab = t.folder / f"slab-{slot // 4:04d}.dat"
        folder = t.folder
    with open(slab, "r+b") as fh:  # flip one byte in the middle of the slot
        off = (slot % 4) * ROW + 1234
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert cli_main(["verify", str(tmp_path), "--json"]) == 1
    out = capsys.readouterr().out
    assert victim.hex() in out and '"reason": "checksum"' in out
    with open_tier(tmp_path) as t:
        data, done = read(t, victim)
        assert data is None and done[0].reason == "checksum"
        assert not t.contains(victim)
        assert t.stats["checksum_failures"] == 1
        for k in keys:
            if k != victim:
                assert read(t, k)[0] == bytes(row_for(k))
    assert cli_main(["verify", str(tmp_path)]) == 0  # the corrupt key was dropped
    assert f"namespace {folder.name}: 5 slots checked, ok" in capsys.readouterr().out


def test_truncated_slab_is_a_short_read_miss(tmp_path):
    with open_tier(tmp_path, slots=4) as t:
        store(t, [key(i) for i in range(4)])
        last = max(t.keys(), key=lambda k: t.entry(k).slot)
        slab = t.folder / "slab-0000.dat"
    os.truncate(slab, 3 * ROW + 100)
    # reopening re-extends the file (zeros), so the slot's checksum fails instead
    with open_tier(tmp_path, slots=4) as t:
        data, done = read(t, last)
        assert data is None and done[0].reason in ("checksum", "short_read")
        assert not t.contains(last)


WRITER = textwrap.dedent("""
    import sys, itertools
    sys.path.insert(0, {tests!r})
    from tierutil import open_tier, key, row_for
    t = open_tier({path!r}, slots=24, io_threads=2)
    print("ready", flush=True)
    for i in itertools.count():
        ks = [key(f"{{i}}-{{j}}") for j in range(3)]
        t.put(ks, [row_for(k) for k in ks])
        if i % 2:
            t.wait_idle()  # like a server between steps: some batches finish, some are cut
        else:
            t.poll()
        if i % 5 == 0:
            t.touch(t.keys()[:2])
""")


def test_kill_9_mid_write_leaves_only_exact_rows(tmp_path):
    rng = random.Random(1234)
    script = WRITER.format(tests=str(TESTS), path=str(tmp_path))
    trials, survived = 20, 0
    for _trial in range(trials):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(rng.uniform(0.01, 0.25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with open_tier(tmp_path, slots=24) as t:
            t.check(index=True)  # no slot twice, free list disjoint from the keys', index agrees
            for k in t.keys():
                data, done = read(t, k)
                assert data == bytes(row_for(k)), f"wrong bytes for {k.hex()}: {done}"
            survived += len(t)
    assert survived > 0, "no published row ever survived a kill: the test proves nothing"



def test_disk_full_rejects_writes_keeps_reads(small_fs):
    row = 64 * 1024
    # sparse slabs (as on a filesystem that refuses fallocate) so the disk can fill under us
    with open_tier(small_fs, slots=64, row_bytes=row, preallocate=False,
                   slab_file_bytes=row * 64) as t:
        early = [key(i) for i in range(4)]
        accepted = t.put(early, [row_for(k, row) for k in early]).admitted
        assert accepted == early and all(d.ok for d in t.wait_idle())
        filler = small_fs / "filler"
        with open(filler, "wb") as fh:  # eat the rest of the disk
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        later = [key(f"late{i}") for i in range(8)]
        t.put(later, [row_for(k, row) for k in later])
        done = t.wait_idle()
        failed = [d for d in done if not d.ok]
        assert failed, "expected ENOSPC on a full filesystem"
        assert t.stats["rejections:full"] == len(failed)  # ENOSPC is "full", not "error"
        for d in failed:
            assert not t.contains(d.key)
        for k in early:  # nothing already stored is lost
            out = bytearray(row)
            assert t.get([(k, memoryview(out), None)]) == [True]
            assert all(r.ok for r in t.wait_idle())
            assert bytes(out) == bytes(row_for(k, row))
        filler.unlink()
        retry = t.put([failed[0].key], [row_for(failed[0].key, row)]).admitted
        assert retry and all(d.ok for d in t.wait_idle())
