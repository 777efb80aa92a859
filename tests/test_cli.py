"""The cache commands of the ``tiering`` CLI on real caches (no server)."""

from __future__ import annotations

import json
import stat
import time

import pytest
from tierutil import ROW, key, open_tier, store

from tiering.backends.namespace import FORMAT_VERSION
from tiering.cli import build_parser, main
from tiering.config import parse
from tiering.prometheus_text import metric, parse_metrics


@pytest.fixture
def cache(tmp_path):
    with open_tier(tmp_path, slots=16) as t:
        store(t, [key(i) for i in range(10)])
        t.touch([key(0), key(1)])
        t.touch([key(0)])
        for i in range(3):
            t.lookup(key(i))
        t.lookup(key("missing"))
    return tmp_path


def run_json(capsys, *args) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_every_command_has_help(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0, name
    capsys.readouterr()


def test_inspect_json(cache, capsys):
    (ns,) = run_json(capsys, "inspect", str(cache), "--json")["namespaces"]
    assert ns["entries"] == 10 and ns["slots"] == 16 and ns["row_bytes"] == ROW
    assert ns["usage_bytes"] == 10 * ROW and ns["usage_perc"] == 0.625
    assert ns["hit_histogram"][">=0"] == 8 and ns["hit_histogram"][">=1"] == 1
    assert ns["hit_histogram"][">=2"] == 1  # key 0 was touched twice
    assert ns["age_histogram"]["<60s"] == 10
    assert ns["model"] == "tiny" and ns["format_version"] == FORMAT_VERSION
    assert main(["inspect", str(cache)]) == 0
    assert "entries 10" in capsys.readouterr().out


def test_stats_and_export_agree_with_inspect(cache, capsys):
    (st,) = run_json(capsys, "stats", str(cache), "--json")["namespaces"]
    assert (st["entries"], st["stores"], st["lookups"], st["hits"]) == (10, 10, 4, 3)
    assert st["store_bytes"] == 10 * ROW
    assert main(["export", str(cache), "--prometheus"]) == 0
    m = parse_metrics(capsys.readouterr().out)
    assert metric(m, "tiering_cache_entries") == 10
    assert metric(m, "tiering_cache_capacity_bytes") == 16 * ROW
    assert metric(m, "tiering_cache_stores_total") == 10
    assert metric(m, "tiering_cache_hits_total") == 3


def test_export_to_file_is_atomic(cache, tmp_path, capsys):
    out = tmp_path / "tiering.prom"
    assert main(["export", str(cache), "-o", str(out)]) == 0
    assert "tiering_cache_entries" in out.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    out.chmod(0o644)  # the operator lets node-exporter's user read it: later exports keep that
    assert main(["export", str(cache), "-o", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_evict_offline_by_bytes_then_by_age_then_clear(cache, capsys):
    r = run_json(capsys, "evict", str(cache), "--bytes", str(3 * ROW), "--json")["results"][0]
    assert (r["removed_entries"], r["entries"], r["via"]) == (3, 7, "offline")
    # key 0 and 1 were used most recently and more often: LRU evicted others
    with open_tier(cache, slots=16) as t:
        assert t.contains(key(0)) and t.contains(key(1))
    time.sleep(0.05)
    r = run_json(capsys, "evict", str(cache), "--older-than", "0s", "--json")["results"][0]
    assert r["entries"] == 0
    with open_tier(cache, slots=16) as t:
        store(t, [key("x")])
    r = run_json(capsys, "clear", str(cache), "--json")["results"][0]
    assert r["removed_entries"] == 1 and r["entries"] == 0


@pytest.mark.parametrize("args, message", [
    (["evict", "{cache}"], "exactly one of --bytes"),
    (["evict", "{cache}", "--bytes", "1", "--older-than", "1d"], "exactly one of --bytes"),
    (["evict", "{cache}", "--older-than", "soon"], "--older-than: expected a duration"),
    (["evict", "{cache}", "--bytes", "lots"], "--bytes: expected a byte size"),
    (["inspect", "{cache}/nothing-here"], "no vllm-tiering namespace"),
    (["stats", "{cache}", "--namespace", "feedfacefeedface"], "no namespace 'feedfacefeedface'"),
])
def test_bad_input_is_exit_2_with_message(cache, capsys, args, message):
    assert main([a.format(cache=cache) for a in args]) == 2
    assert message in capsys.readouterr().err


def test_config_prints_valid_transfer_config(tmp_path, capsys):
    out = run_json(capsys, "config", "--cpu", "1GiB", "--disk", f"{tmp_path}/kv:64MiB",
                   "--policy", "s3fifo", "--threshold", "3", "--json")
    assert out["kv_connector"] == "TieredOffloadingConnector" and out["kv_role"] == "kv_both"
    assert out["kv_connector_module_path"] == "tiering.vllm"
    extra = out["kv_connector_extra_config"]
    cfg = parse(extra)  # what the engine runs at start
    assert cfg.cpu_bytes_to_use == 1 << 30
    assert cfg.files[0].policy == "s3fifo" and cfg.files[0].store_threshold == 3
    assert not (tmp_path / "kv").exists()  # validating creates nothing


def test_config_prints_a_serve_command_naming_our_scheduler(capsys):
    """The printed ``vllm serve`` line names TieringScheduler by a path vLLM resolves to a
    subclass of its scheduler, and carries the printed transfer config as is."""
    assert main(["config", "--cpu", "1GiB"]) == 0
    cap = capsys.readouterr()
    line = cap.err.strip().splitlines()[-1]
    assert line.startswith("vllm serve ") and "--prefix-caching-hash-algo sha256" in line
    flag = line.split("--scheduler-cls ", 1)[1].split()[0]
    assert flag == "tiering.vllm.scheduler.TieringScheduler"
    assert line.endswith(f"--kv-transfer-config '{cap.out.strip()}'")
    pytest.importorskip("vllm")
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.scheduler import Scheduler

    assert issubclass(resolve_obj_by_qualname(flag), Scheduler)


@pytest.mark.parametrize("args, message", [
    (["--disk", "{tmp}/x"], "--disk: expected PATH:CAPACITY"),
    (["--disk", "{tmp}/x:1EiB"], "capacity: expected a byte size"),
    (["--disk", "{tmp}/x:1000000TiB"], "bytes free"),
    (["--disk", "{tmp}/x:1GiB", "--policy", "mru"], "unknown policy 'mru'"),
    (["--disk", "{tmp}/x:1GiB", "--io", "spdk"], "io: unknown I/O kind"),
])
def test_config_rejects_bad_flags(tmp_path, capsys, args, message):
    assert main(["config", "--cpu", "1GiB", *(a.format(tmp=tmp_path) for a in args)]) == 2
    assert message in capsys.readouterr().err
