"""Fault suite, bad input: every bad CLI argument or config value is exit 2 (or one
``ValueError``) with one line naming the argument and what was expected, and nothing in the cache
changes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from tierutil import ROW, facts, key, open_tier, store

from tiering.backends.file_tier import FileTier
from tiering.cli import main

HUGE = "9" * 400


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "cache"
    with open_tier(path, slots=16) as t:
        store(t, [key(i) for i in range(6)])
    return path


def snapshot(path: Path) -> dict[str, str]:
    """Every file's bytes (LMDB's lock file changes with every reader: not content)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


CLI_CASES = [
    # (argv, words the one line must contain)
    (["evict", "{c}", "--bytes", HUGE], "--bytes"),
    (["evict", "{c}", "--bytes", "0"], "--bytes"),
    (["evict", "{c}", "--bytes", "-5"], "--bytes"),
    (["evict", "{c}", "--bytes", "1.5.5GiB"], "--bytes"),
    (["evict", "{c}", "--bytes", "nan"], "--bytes"),
    (["evict", "{c}", "--bytes", "inf"], "--bytes"),
    (["evict", "{c}", "--older-than", HUGE + "d"], "--older-than"),
    (["evict", "{c}", "--older-than", "-1d"], "--older-than"),
    (["evict", "{c}", "--older-than", "7y"], "--older-than"),
    (["evict", "{c}", "--bytes", "1", "--timeout", "-1"], "--timeout"),
    (["evict", "{c}", "--bytes", "1", "--timeout", "nan"], "--timeout"),
    (["evict", "{c}", "--bytes", "1", "--timeout", "inf"], "--timeout"),
    (["evict", "{c}", "--bytes", "1", "--timeout", HUGE], "--timeout"),
    (["clear", "{c}", "--timeout", "0"], "--timeout"),
    (["clear", "{c}", "--timeout", "abc"], "--timeout"),
    (["clear", "{c}", "--namespace", "../etc"], "--namespace"),
    (["evict", "{c}", "--bytes", "1", "--namespace", "0000000000000000"], "namespace"),
    (["evict", "{c}/nope", "--bytes", "1"], "no vllm-tiering namespace"),
    (["stats", "{c}", "--namespace", ""], "--namespace"),
    (["inspect", "{c}/nope"], "no vllm-tiering namespace"),
    (["verify", "{c}/nope"], "no vllm-tiering namespace"),
    (["export", "{c}", "-o", ""], "--output"),
    (["export", "{c}", "-o", "{c}"], "--output"),
    (["bench", "{t}/bench", "--row-bytes", "0"], "--row-bytes"),
    (["bench", "{t}/bench", "--row-bytes", "5000"], "--row-bytes"),
    (["bench", "{t}/bench", "--row-bytes", HUGE], "--row-bytes"),
    (["bench", "{t}/bench", "--total", "0"], "--total"),
    (["bench", "{t}/bench", "--total", HUGE], "--total"),
    (["bench", "{t}/bench", "--threads", "0"], "--threads"),
    (["bench", "{t}/bench", "--threads", HUGE], "--threads"),
    (["bench", "{t}/bench", "--repeat", "0"], "--repeat"),
    (["bench", "{t}/bench", "--index-entries", "-1"], "--index-entries"),
    (["bench", "{t}/bench", "--io", "spdk"], "--io"),
    (["watch", "http://127.0.0.1:1/metrics", "--interval", "0"], "--interval"),
    (["watch", "http://127.0.0.1:1/metrics", "--interval", "nan"], "--interval"),
    (["watch", "http://127.0.0.1:1/metrics", "--count", "-1"], "--count"),
    (["watch", "ftp://x/metrics", "--count", "1"], "url"),
    (["simulate", "--capacity", "0"], "--capacity"),
    (["simulate", "--capacity", HUGE], "--capacity"),
    (["simulate", "--thresholds", "a,b"], "--thresholds"),
    (["simulate", "--thresholds", "-1"], "--thresholds"),
    (["simulate", "--thresholds", ""], "--thresholds"),
    (["simulate", "--policies", "mru"], "--policies"),
    (["simulate", "--policies", ","], "--policies"),
    (["simulate", "--policies", "os:system"], "--policies"),
    (["simulate", "--trace", "{t}/missing.trace", "--capacity", "10"], "--trace"),
    (["simulate", "--trace", "{f}"], "--capacity"),
    (["simulate", "--seed", "-1"], "--seed"),
    (["config", "--cpu", HUGE], "--cpu"),
    (["config", "--cpu", "0"], "--cpu"),
    (["config", "--cpu", "1GiB", "--threshold", "-1"], "--threshold"),
    (["config", "--cpu", "1GiB", "--io-threads", "0"], "--io-threads"),
    (["config", "--cpu", "1GiB", "--disk", "{t}/x:" + HUGE], "capacity"),
    (["config", "--cpu", "1GiB", "--disk", ":1GiB"], "--disk"),
    (["config", "--cpu", "1GiB", "--disk", "{t}/x:1GiB", "--compression", "lz4"], "compression"),
    (["config", "--cpu", "1GiB", "--disk", "{t}/x:1GiB", "--cpu-policy", "a:b"], "policy"),
    (["nosuchcommand"], "command"),
    (["inspect"], "path"),
    (["-v"], "COMMAND"),
    (["evict", "{c}"], "exactly one of --bytes"),
    (["evict", "{c}", "--bytes", "1", "--older-than", "1d"], "exactly one of --bytes"),
    (["evict", "{c}", "--bytes", ""], "--bytes"),
    (["evict", "{c}", "--bytes", "0x10"], "--bytes"),
    (["evict", "{c}", "--bytes", "1e3"], "--bytes"),
    (["evict", "{c}", "--bytes", "1 GiB GiB"], "--bytes"),
    (["evict", "{c}", "--older-than", ""], "--older-than"),
    (["evict", "{c}", "--older-than", "1.5.5d"], "--older-than"),
    (["evict", "{c}", "--older-than", "nan"], "--older-than"),
    (["verify", "{c}", "--bogus"], "--bogus"),
    (["inspect", "{c}", "--json", "extra"], "extra"),
    (["export", "{c}", "--namespace", "ZZZZ"], "--namespace"),
    (["stats", "{c}", "--namespace", "0123456789abcdef0"], "--namespace"),
    (["simulate", "--workload", "nope"], "--workload"),
    (["simulate", "--trace", "{c}"], "--trace"),
    (["simulate", "--capacity", "1.5"], "--capacity"),
    (["simulate", "--capacity", "-3"], "--capacity"),
    (["simulate", "--thresholds", "1,,x"], "--thresholds"),
    (["bench", "{t}/bench", "--row-bytes", "-4096"], "--row-bytes"),
    (["bench", "{t}/bench", "--row-bytes", "2GiB"], "--row-bytes"),
    (["bench", "{t}/bench", "--row-bytes", "1MiB", "--total", "4KiB"], "--total"),
    (["bench", "{t}/bench", "--only", "fio"], "--only"),
    (["watch", "http://127.0.0.1:1/metrics", "--interval", "-5"], "--interval"),
    (["watch", "http://127.0.0.1:1/metrics", "--interval", "inf"], "--interval"),
    (["watch", "http://127.0.0.1:1/metrics", "--count", "x"], "--count"),
    (["watch", "not a url"], "url"),
    (["config", "--cpu", "1GiB", "--disk", "{t}/x:0"], "capacity"),
    (["config", "--cpu", "1GiB", "--disk", "{t}/x:lots"], "capacity"),
    (["config", "--cpu", "1GiB", "--disk", "{t}/x:1GiB", "--policy", "os:system"], "policy"),
    (["config", "--cpu", "-1GiB"], "--cpu"),
    (["config", "--cpu", "1GiB", "--cpu-threshold", "x"], "--cpu-threshold"),
    (["config", "--cpu", "1GiB", "--disk", "{f}:1GiB"], "path"),
    (["config"], "--cpu"),
]


@pytest.mark.parametrize("argv, words", CLI_CASES, ids=lambda v: " ".join(v)[:60]
                         if isinstance(v, list) else None)
def test_bad_cli_input_is_exit_2_one_line_nothing_touched(cache, tmp_path, capsys, argv, words):
    before = snapshot(cache)
    args = [a.format(c=cache, t=tmp_path, f=__file__) for a in argv]
    try:
        rc = main(args)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert words in lines[0], lines[0]
    assert "Traceback" not in err
    assert snapshot(cache) == before, "a rejected command changed the cache"
    assert not (tmp_path / "bench").exists(), "a rejected bench created its scratch folder"


CONFIG_CASES = [
    ({"capacity": HUGE}, "capacity"),
    ({"capacity": "1e400"}, "capacity"),
    ({"capacity": -1}, "capacity"),
    ({"capacity": 2**80}, "capacity"),
    ({"capacity": 1.5}, "capacity"),
    ({"capacity": None}, "capacity"),
    ({"slab_file_bytes": 0}, "slab_file_bytes"),
    ({"slab_file_bytes": HUGE}, "slab_file_bytes"),
    ({"io_threads": True}, "io_threads"),
    ({"io_threads": 10**6}, "io_threads"),
    ({"max_batch": -1}, "max_batch"),
    ({"compression_level": 99}, "compression_level"),
    ({"compression_level": "1"}, "compression_level"),
    ({"element_bytes": 3}, "element_bytes"),
    ({"verify": "yes"}, "verify"),
    ({"preallocate": 1}, "preallocate"),
    ({"direct": None}, "direct"),
    ({"path": ""}, "path"),
    ({"path": 5}, "path"),
    ({"policy": "os:system"}, "policy"),
    ({"policy": 3}, "policy"),
    ({"io": None}, "io"),
    ({"tracker_size": 0}, "tracker_size"),
]


EXTRA_CASES = [  # kv_connector_extra_config, as vllm serve passes it
    ({"cpu_bytes_to_use": HUGE}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": "x"}, "tiers"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [5]}, "tiers[0]"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "file"}]}, "tiers[0].medium"),
    ({"cpu_bytes_to_use": "1GiB", "bogus": 1}, "bogus"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu", "policy": "os:system"}]},
     "tiers[0].policy"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu", "store_threshold": -1}]},
     "tiers[0].store_threshold"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu"}, {"medium": "file", "path": "",
                                                                 "capacity": "1GiB"}]},
     "tiers[1].path"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu"}, {
        "medium": "file", "path": "{t}/x", "capacity": HUGE}]}, "tiers[1]"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu"}, {
        "medium": "file", "path": "{t}/x", "capacity": "1GiB", "io_threads": 0}]}, "io_threads"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu"}, {
        "medium": "file", "path": "{t}/x", "capacity": "1GiB", "verify": "no"}]}, "verify"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu"}, {
        "medium": "file", "path": "{t}/x", "capacity": "1GiB", "flavour": 1}]}, "flavour"),
    ({"cpu_bytes_to_use": "1GiB", "tiers": [{"medium": "cpu"}] + [{
        "medium": "file", "path": "{t}/x", "capacity": "1GiB"}] * 2}, "share one path"),
]


def _fill_in(value, tmp):
    if isinstance(value, str):
        return value.replace("{t}", str(tmp))
    if isinstance(value, list):
        return [_fill_in(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: _fill_in(v, tmp) for k, v in value.items()}
    return value


@pytest.mark.parametrize("extra, words", EXTRA_CASES, ids=lambda v: repr(v)[:40])
def test_bad_extra_config_is_one_error_naming_the_key(tmp_path, extra, words):
    from tiering.config import parse

    with pytest.raises(ValueError) as exc:
        parse(_fill_in(extra, tmp_path))
    assert words in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("override, words", CONFIG_CASES, ids=lambda v: repr(v)[:40])
def test_bad_file_tier_setting_is_one_error_and_creates_nothing(tmp_path, override, words):
    path = tmp_path / "cache"
    cfg = {"path": str(path), "capacity": 16 * ROW, "io": "posix", **override}
    with pytest.raises(ValueError) as exc:
        FileTier(cfg, facts())
    assert words in str(exc.value) and "\n" not in str(exc.value)
    assert not path.exists()


# -- paths the system cannot walk: a symbolic link loop, a path too long -----------------------
LONG = "a" * 5000
PATH_CMDS = [  # (argv with {p} for the bad path, the argument the one line names)
    (["inspect", "{p}"], "path"),
    (["verify", "{p}"], "path"),
    (["stats", "{p}"], "path"),
    (["export", "{p}"], "path"),
    (["export", "{c}", "-o", "{p}/out.prom"], "--output"),
    (["clear", "{p}"], "path"),
    (["clear", "{p}", "--dry-run"], "path"),
    (["evict", "{p}", "--bytes", "1"], "path"),
    (["bench", "{p}"], "path"),
    (["config", "--cpu", "1GiB", "--disk", "{p}:1MiB"], "path"),
]


@pytest.mark.parametrize("kind", ["loop", "too-long", "long-name"])
@pytest.mark.parametrize("argv, words", PATH_CMDS, ids=lambda v: " ".join(v)[:40]
                         if isinstance(v, list) else None)
def test_bad_path_is_exit_2_one_line_naming_the_argument(cache, tmp_path, capsys, monkeypatch,
                                                         kind, argv, words):
    monkeypatch.chdir(tmp_path)
    if kind == "loop":
        (tmp_path / "L").symlink_to("L")  # ln -s L L
        bad = "L/kv"
    elif kind == "too-long":
        bad = LONG
    else:
        bad = str(tmp_path / ("n" * 300) / "kv")
    before = snapshot(cache)
    listing = sorted(p.name for p in tmp_path.iterdir())
    args = [a.format(p=bad, c=cache) for a in argv]
    try:
        rc = main(args)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err[:300])
    assert len(lines) == 1 and "Traceback" not in err, err[:300]
    assert words in lines[0] and "Errno" not in lines[0], lines[0][:300]
    assert snapshot(cache) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing, "a bad path created something"


@pytest.mark.parametrize("kind", ["loop", "too-long", "long-name"])
def test_file_tier_on_a_bad_path_is_one_error_naming_the_key(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    if kind == "loop":
        (tmp_path / "L").symlink_to("L")
        bad = "L/kv"
    elif kind == "too-long":
        bad = LONG
    else:
        bad = str(tmp_path / ("n" * 300) / "kv")
    with pytest.raises(ValueError) as exc:
        FileTier({"path": bad, "capacity": 16 * ROW, "io": "posix"}, facts())
    msg = str(exc.value)
    assert msg.startswith("path: ") and "\n" not in msg and "Errno" not in msg, msg[:300]
    assert ("loop" in msg) if kind == "loop" else ("bytes" in msg)
