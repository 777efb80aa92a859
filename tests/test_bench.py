"""`tiering bench` moves and checks real bytes: every system's rows come back exact, and the
comparison would see a wrong one. (Speeds are not asserted: that is what the bench is for.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tiering.bench import Pool, bench
from tiering.bench_common import drop_caches
from tiering.cli import main

KIB = 1024


def test_pool_comparison_catches_one_wrong_byte():
    pool = Pool(8 * KIB, 4)
    rows = np.tile(pool.arr, (3, 1))[:10].copy()  # 10 run rows over a pool of 4
    assert pool.bad_rows(rows) == 0
    rows[6, 100] ^= 1
    assert pool.bad_rows(rows) == 1


def test_tier_part_round_trips_every_row(tmp_path):
    r = bench(str(tmp_path / "scratch"), 256 * KIB, 8 << 20, 2, 1, parts=["tier"])
    assert r["tier_bad_rows"] == 0
    assert r["tier_write_GBps"] > 0 and r["tier_read_GBps"] > 0
    assert r["cold_reads"] and set(r["cold_reads"]) <= {"drop_caches", "fadvise"}
    assert not list((tmp_path / "scratch").iterdir())  # scratch data removed


@pytest.mark.parametrize("part", ["py_io", "py_io_xxh3"])
def test_python_ceiling_parts_round_trip_and_would_see_a_wrong_row(tmp_path, monkeypatch, part):
    r = bench(str(tmp_path / "scratch"), 64 * KIB, 4 << 20, 2, 1, parts=[part])
    assert r[f"{part}_bad_rows"] == 0
    assert r[f"{part}_write_GBps"] > 0 and r[f"{part}_read_GBps"] > 0
    assert not list((tmp_path / "scratch").iterdir())

    import os

    real_preadv, calls = os.preadv, []

    def damage_one_byte(fd, bufs, offset):  # the first run read comes back with a flipped bit
        n = real_preadv(fd, bufs, offset)
        if not calls:
            bufs[0][7] ^= 1
        calls.append(offset)
        return n

    monkeypatch.setattr(os, "preadv", damage_one_byte)
    r = bench(str(tmp_path / "scratch"), 64 * KIB, 4 << 20, 2, 1, parts=[part])
    assert calls and r[f"{part}_bad_rows"] == 1


def test_python_ceiling_part_raises_an_io_error_instead_of_timing_it(tmp_path, monkeypatch):
    import errno
    import os

    def fail(fd, bufs, offset):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "pwritev", fail)
    with pytest.raises(OSError, match="injected"):
        bench(str(tmp_path / "scratch"), 64 * KIB, 1 << 20, 2, 1, parts=["py_io"])


def test_cold_reads_fall_back_to_fadvise_without_permission(tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(b"x" * 8192)
    real_open = open

    def refuse(path, *a, **k):
        if str(path) == "/proc/sys/vm/drop_caches":
            raise PermissionError(13, "denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", refuse)
    assert drop_caches(tmp_path) == "fadvise"


def test_cli_rejects_an_unknown_part(tmp_path, capsys):
    assert main(["bench", str(tmp_path), "--parts", "tier,tape"]) == 2
    err = capsys.readouterr().err  # one line on stderr, like every usage error of the CLI
    assert "unknown part 'tape'" in err and len(err.strip().splitlines()) == 1


def test_cli_json_reports_rows_and_no_bad_rows(tmp_path, capsys):
    rc = main(["bench", str(tmp_path), "--row-bytes", "64KiB", "--total", "2MiB", "--threads",
               "2", "--repeat", "1", "--parts", "tier", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["tier_bad_rows"] == 0 and out["total_bytes"] == 2 << 20


@pytest.mark.parametrize("kind", ["vllm_tier", "vllm_fs"])
def test_both_tiers_through_vllms_interface_round_trip(tmp_path, kind):
    pytest.importorskip("vllm")
    from tiering.vllm.bench_tiers import run_interface

    pool = Pool(64 * KIB, 8)
    r = run_interface(kind, tmp_path, pool.arr, 40, 2, job_rows=6)  # a short last job too
    assert r["bad_rows"] == 0 and r["failed_jobs"] == 0
    assert r["write_GBps"] > 0 and r["read_GBps"] > 0


def test_index_part_reopens_and_finds_every_entry(tmp_path):
    from tiering.bench import run_index

    r = run_index(tmp_path, 2000)
    assert r["index_entries"] == 2000 and r["lookup_hits"] == 2000
    assert r["reopen_s"] > 0 and r["lookups_per_s"] > 0
