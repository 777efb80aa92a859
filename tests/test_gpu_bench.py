"""The GPU benchmark's parts that run without a GPU: waiting for a process tree's writes to end
(``benchmarks.write_quiesce``), the model shapes' arithmetic, the offloading configs it builds and
the throughput table. The benchmark itself runs on a GPU (``scripts/gpu_session.sh``) and in a
CPU smoke run (``--cpu-platform``, docs/gpu.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from benchmarks import gpu_bench
from benchmarks.write_quiesce import process_tree, wait_for_quiet_writes, written_bytes

# A writer that overwrites 4 MiB at the start of a file every 20 ms (about 200 MiB/s, far above
# the 8 MiB per 0.5 s quiet threshold) for SECONDS seconds (forever if negative), then prints
# the monotonic clock and sleeps: still alive, no longer writing. It ends when its launcher does
# (no writer is left behind, whatever the test's outcome).
WRITER = r"""
import os, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
parent = os.getppid()
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
chunk = os.urandom(4 << 20)
end = time.monotonic() + seconds
while (seconds < 0 or time.monotonic() < end) and os.getppid() == parent:
    os.pwrite(fd, chunk, 0)
    time.sleep(0.02)
print(time.monotonic(), flush=True)
while os.getppid() == parent:  # alive, not writing, until its launcher is gone
    time.sleep(0.1)
"""

# The writer as a grandchild: an intermediate process starts it and waits, as vLLM's engine
# core is a child of the frontend and its workers may be children of the engine core.
LAUNCHER = r"""
import subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
"""


def start_writer(tmp_path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, WRITER, str(tmp_path / "f"),
                             str(seconds)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the grandchild has written something
        if len(process_tree(proc.pid)) == 2 and sum(written_bytes(process_tree(proc.pid)).values()):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the writer did not start")


def stop(proc: subprocess.Popen) -> None:
    for pid in reversed(process_tree(proc.pid)):  # grandchild first, then the launcher
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def test_process_tree_finds_a_grandchild(tmp_path):
    proc = start_writer(tmp_path, -1)
    try:
        tree = process_tree(proc.pid)
        assert tree[0] == proc.pid and len(tree) == 2
        assert set(tree) <= set(process_tree(os.getpid()))
    finally:
        stop(proc)


def test_waits_until_a_grandchild_stops_writing(tmp_path):
    proc = start_writer(tmp_path, 2.0)
    try:
        got = wait_for_quiet_writes(window_s=0.5, max_s=60)
        returned = time.monotonic()
        stopped = float(proc.stdout.readline())  # printed right after the last write
        assert got.quiet
        assert returned > stopped  # not before the writer stopped
        assert returned - stopped < 30  # and not long after (a generous bound)
        assert got.syncs >= 1
        # most of the ~2 s of writing (at ~200 MiB/s) happened during the wait
        assert got.written_bytes > 64 << 20
    finally:
        stop(proc)


def test_returns_at_the_bound_when_the_writes_never_stop(tmp_path):
    proc = start_writer(tmp_path, -1)
    try:
        t = time.monotonic()
        got = wait_for_quiet_writes(window_s=0.5, max_s=2.0)
        assert not got.quiet
        assert 2.0 <= got.waited_s < 30 and time.monotonic() - t < 30
        assert got.written_bytes > 16 << 20
    finally:
        stop(proc)


def test_an_idle_tree_settles_at_once(tmp_path):
    got = wait_for_quiet_writes(window_s=0.2, max_s=30)
    assert got.quiet and got.waited_s < 30


# ---- shapes -----------------------------------------------------------------------------

def test_8b_shape_is_llama_3_1_8b():
    s = gpu_bench.shape_sizes("8b", "bfloat16")
    assert s["kv_bytes_per_token"] == 128 << 10  # 32 layers x 8 kv heads x 128 x 2 (K, V) x 2 B
    assert 7.9e9 < s["params"] < 8.1e9  # Llama-3.1-8B has 8.03e9 parameters


def test_32b_shape_fits_one_h200_with_a_32k_prompt():
    s = gpu_bench.shape_sizes("32b", "bfloat16")
    assert 31e9 < s["params"] < 34e9
    assert s["kv_bytes_per_token"] == 256 << 10  # 64 layers x 8 kv heads x 128 x 2 x 2 B
    h200 = 141e9
    kv_32k = 32768 * 1.25 * s["kv_bytes_per_token"]  # the phase engines' GPU cache for 32k
    assert s["weight_bytes"] + kv_32k < 0.85 * h200 - 8e9  # 8 GB left for activations
    layers, hidden, heads, kv_heads, inter, vocab = gpu_bench.SHAPES["32b"]
    assert hidden % heads == 0 and heads % kv_heads == 0


def test_fillers_push_everything_out_of_the_cpu_tier():
    for cpu_bytes, length, kvb in ((int(4.5 * 2**30), 32768, 128 << 10), (3 << 30, 8192, 256 << 10),
                                   (4 << 20, 1024, 2048)):
        n = gpu_bench.fillers(cpu_bytes, length, kvb)
        assert n * length * kvb >= 1.25 * cpu_bytes
        assert (n - 2) * length * kvb < 1.25 * cpu_bytes  # not many more than needed


def test_cpu_tier_auto_size_holds_the_longest_prompt():
    kvb = gpu_bench.shape_sizes("32b", "bfloat16")["kv_bytes_per_token"]
    assert gpu_bench.auto_cpu_bytes([2048, 8192], kvb) >= 8192 * kvb
    assert gpu_bench.auto_cpu_bytes([2048, 32768], kvb) >= 32768 * kvb
    # the 8B run's 4.5 GiB tier for a 32k prompt
    assert gpu_bench.auto_cpu_bytes([32768], 128 << 10) == int(4.5 * 2**30)


# ---- configs and options ------------------------------------------------------------------

def test_configs_name_the_spec_and_tiers(tmp_path):
    none = gpu_bench.transfer_config("none", tmp_path, 1 << 30, 4.0)
    assert none is None
    extra = {c: gpu_bench.transfer_config(c, tmp_path, 1 << 30, 4.0)["kv_connector_extra_config"]
             for c in gpu_bench.CONFIGS if c != "none"}
    assert extra["cpu"]["spec_name"] == "CPUOffloadingSpec"
    assert extra["vtier-fs"]["spec_name"] == "TieringOffloadingSpec"
    assert extra["vtier-fs"]["secondary_tiers"] == [{"type": "fs",
                                                     "root_dir": str(tmp_path / "vtier-fs")}]
    ours_tier = extra["vtier-ours"]["secondary_tiers"][0]
    assert ours_tier["type"] == "FileTier" and ours_tier["module_path"] == "tiering.vllm"
    assert ours_tier["path"] == str(tmp_path / "vtier-ours")
    for c in ("ours", "ours-wb"):
        assert extra[c]["spec_name"] == "TieredOffloadingSpec"
        assert extra[c]["tiers"][1]["path"] == str(tmp_path / c)
    assert "demote" not in extra["ours"]["tiers"][1]  # the default: write-through
    assert extra["ours-wb"]["tiers"][1]["demote"] == "on_evict"
    for c, e in extra.items():
        assert e["cpu_bytes_to_use"] == 1 << 30, c
    assert gpu_bench.HAS_DISK == {"vtier-fs", "vtier-ours", "ours", "ours-wb", "ours-fed"}


def test_our_configs_are_valid_for_our_spec(tmp_path):
    """The tiers list our spec would be given parses (a wrong key or demote mode would raise)."""
    from tiering.config import parse

    demote = {}
    for c in ("ours", "ours-wb"):
        extra = gpu_bench.transfer_config(c, tmp_path, 1 << 30, 4.0)["kv_connector_extra_config"]
        cfg = parse({k: v for k, v in extra.items() if k not in ("spec_name",
                                                                  "spec_module_path")})
        assert cfg.cpu_bytes_to_use == 1 << 30 and len(cfg.files) == 1
        demote[c] = cfg.files[0].demote
    assert demote == {"ours": "on_store", "ours-wb": "on_evict"}


def test_switch_ms_reaches_our_tiers_only(tmp_path):
    """--switch-ms (an A/B of the engine's switch interval) sets switch_interval_ms where our
    spec or our secondary tier reads it, in a form each accepts, and nowhere else."""
    from tiering.config import parse

    for c in gpu_bench.CONFIGS:
        kvt = gpu_bench.transfer_config(c, tmp_path, 1 << 30, 4.0)
        before = json.dumps(kvt, sort_keys=True)
        assert gpu_bench.with_switch_interval(kvt, None) is kvt
        assert json.dumps(kvt, sort_keys=True) == before  # None: the spec's default, untouched
        kvt = gpu_bench.with_switch_interval(kvt, 5.0)
        if kvt is None:
            continue
        extra = kvt["kv_connector_extra_config"]
        if c in ("ours", "ours-wb"):
            assert extra["switch_interval_ms"] == 5.0
            cfg = parse({k: v for k, v in extra.items()
                         if k not in ("spec_name", "spec_module_path")})
            assert cfg.switch_interval_ms == 5.0
        elif c == "vtier-ours":
            assert extra["secondary_tiers"][0]["switch_interval_ms"] == 5.0
        else:
            assert "switch_interval_ms" not in json.dumps(kvt), c
    disk = gpu_bench.sweep_transfer_config("ours-disk", 1 << 30, None, 16, disk=(tmp_path, 1 << 30))
    assert gpu_bench.with_switch_interval(disk, 0)["kv_connector_extra_config"][
        "switch_interval_ms"] == 0


def test_io_threads_reach_our_file_tiers_only(tmp_path, monkeypatch, capsys):
    """--io-threads (an A/B of the reads a disk gets in flight) sets io_threads on every file
    tier of ours, in a form the tier's parser takes, and leaves vLLM's tiers and our CPU tier
    alone; a count outside 1..1024 is refused at parse time."""
    from tiering.backends.file_config import FileTierConfig
    from tiering.config import parse

    assert FileTierConfig(path="x", capacity=1).io_threads != 12

    for c in gpu_bench.CONFIGS:
        kvt = gpu_bench.transfer_config(c, tmp_path, 1 << 30, 4.0)
        before = json.dumps(kvt, sort_keys=True)
        assert gpu_bench.with_io_threads(kvt, None) is kvt
        assert json.dumps(kvt, sort_keys=True) == before
        kvt = gpu_bench.with_io_threads(kvt, 12)  # not the tier's default (16)
        if kvt is None:
            continue
        extra = kvt["kv_connector_extra_config"]
        if c in ("ours", "ours-wb"):
            cfg = parse({k: v for k, v in extra.items()
                         if k not in ("spec_name", "spec_module_path")})
            assert [f.io_threads for f in cfg.files] == [12]
            assert "io_threads" not in extra["tiers"][0]  # the CPU tier has none
        elif c == "vtier-ours":
            entry = dict(extra["secondary_tiers"][0])
            entry.pop("type"), entry.pop("module_path")
            assert FileTierConfig.from_dict(entry).io_threads == 12
        else:
            assert '"io_threads"' not in json.dumps(kvt), c  # the key (tmp_path has the word)
    disk = gpu_bench.sweep_transfer_config("ours-disk", 1 << 30, None, 16, disk=(tmp_path, 1 << 30))
    assert gpu_bench.with_io_threads(disk, 32)["kv_connector_extra_config"]["tiers"][1][
        "io_threads"] == 32
    for bad in ("0", "2000"):
        monkeypatch.setattr(sys, "argv", ["gpu_bench", "--io-threads", bad])
        with pytest.raises(SystemExit):
            gpu_bench.parse()
        assert f"--io-threads: expected 1 to 1024 threads a file tier, got {bad}" in \
            capsys.readouterr().err


def test_vtier_configs_build_the_tiers_they_name(tmp_path):
    """vtier-ours's entry is a valid FileTier config once vLLM's factory has taken ``type`` and
    ``module_path`` off it; under vLLM 0.33 (.venv033) the factory resolves both entries."""
    from tiering.backends.file_config import FileTierConfig

    extra = {c: gpu_bench.transfer_config(c, tmp_path, 1 << 30, 4.0)["kv_connector_extra_config"]
             for c in ("vtier-fs", "vtier-ours")}
    entry = dict(extra["vtier-ours"]["secondary_tiers"][0])
    entry.pop("type"), entry.pop("module_path")
    cfg = FileTierConfig.from_dict(entry, "vtier-ours")
    assert cfg.path == str(tmp_path / "vtier-ours") and cfg.io == "posix"
    from tiering.backends.sizes import parse_size

    assert parse_size(cfg.capacity, "capacity") == 4 << 30
    factory = pytest.importorskip("vllm.v1.kv_offload.tiering.factory",
                                  reason="vLLM 0.33's tiering (the .venv033 environment)")
    from tiering.vllm import FileTier

    get = factory.SecondaryTierFactory.get_tier_class
    assert get(extra["vtier-ours"]["secondary_tiers"][0]) is FileTier
    assert get(extra["vtier-fs"]["secondary_tiers"][0]).__module__.endswith("fs.manager")


def test_ours_fed_is_ours_with_every_load_through_the_feeder(tmp_path, monkeypatch):
    """ours-fed, the A/B of load_direct: ours' tiers and disk, with load_direct false; run only
    where --configs names it (the default list stays as it was); the sweep's
    --sweep-load-direct sets it for ours, and nothing where not given."""
    from tiering.config import parse
    from tiering.settings import LOAD_DIRECT

    def cfg(kvt):
        return parse({k: v for k, v in kvt["kv_connector_extra_config"].items()
                      if k not in ("spec_name", "spec_module_path")})

    fed = gpu_bench.transfer_config("ours-fed", tmp_path, 1 << 30, 4.0)
    ours = gpu_bench.transfer_config("ours", tmp_path, 1 << 30, 4.0)
    assert cfg(fed).load_direct is False and cfg(ours).load_direct is LOAD_DIRECT is True
    assert fed["kv_connector_extra_config"]["tiers"][1]["path"] == str(tmp_path / "ours-fed")
    assert "ours-fed" in gpu_bench.HAS_DISK and "ours-fed" not in gpu_bench.CONFIGS
    monkeypatch.setattr(sys, "argv", ["gpu_bench"])
    assert "ours-fed" not in gpu_bench.parse().configs
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--configs", "none,ours,ours-fed,cpu"])
    assert gpu_bench.parse().configs == ["none", "ours", "ours-fed", "cpu"]
    for value in (True, False):
        kvt = gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16,
                                             load_direct=value)
        assert cfg(kvt).load_direct is value
    assert "load_direct" not in gpu_bench.sweep_transfer_config(
        "ours-sched", 1 << 30, None, 16)["kv_connector_extra_config"]
    assert "load_direct" not in gpu_bench.sweep_transfer_config(
        "cpu", 1 << 30, None, 16, load_direct=False)["kv_connector_extra_config"]


def test_sweep_load_waves_reaches_ours_only(monkeypatch):
    """--sweep-load-waves on|off sets our spec's load_waves in the sweep's configs, never
    vLLM's spec's, and nothing where not given (the spec's default, on)."""
    from tiering.config import parse

    def cfg(kvt):
        return parse({k: v for k, v in kvt["kv_connector_extra_config"].items()
                      if k not in ("spec_name", "spec_module_path")})

    for value in (True, False):
        kvt = gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16, load_waves=value)
        assert cfg(kvt).load_waves is value
    assert cfg(gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16)).load_waves
    assert "load_waves" not in gpu_bench.sweep_transfer_config(
        "ours-sched", 1 << 30, None, 16)["kv_connector_extra_config"]
    assert "load_waves" not in gpu_bench.sweep_transfer_config(
        "cpu", 1 << 30, None, 16, load_waves=False)["kv_connector_extra_config"]
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--sweep-load-waves", "off"])
    assert gpu_bench.parse().sweep_load_waves == "off"
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--sweep-load-waves", "maybe"])
    with pytest.raises(SystemExit):
        gpu_bench.parse()


def test_sweep_load_wave_streams_reaches_ours_only(monkeypatch):
    """--sweep-load-wave-streams 1|2 sets our spec's load_wave_streams in the sweep's configs,
    never vLLM's spec's, and nothing where not given (the spec's default, 1); 2 with
    --sweep-load-waves off is refused when the config is parsed, naming the key."""
    from tiering.config import parse

    def cfg(kvt):
        return parse({k: v for k, v in kvt["kv_connector_extra_config"].items()
                      if k not in ("spec_name", "spec_module_path")})

    for value in (1, 2):
        kvt = gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16,
                                             load_wave_streams=value)
        assert cfg(kvt).load_wave_streams == value
    assert cfg(gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16)
               ).load_wave_streams == 1
    assert "load_wave_streams" not in gpu_bench.sweep_transfer_config(
        "ours-sched", 1 << 30, None, 16)["kv_connector_extra_config"]
    assert "load_wave_streams" not in gpu_bench.sweep_transfer_config(
        "cpu", 1 << 30, None, 16, load_wave_streams=2)["kv_connector_extra_config"]
    with pytest.raises(ValueError, match="load_wave_streams"):
        cfg(gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16, load_waves=False,
                                            load_wave_streams=2))
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--sweep-load-wave-streams", "2"])
    assert gpu_bench.parse().sweep_load_wave_streams == 2
    monkeypatch.setattr(sys, "argv", ["gpu_bench"])
    assert gpu_bench.parse().sweep_load_wave_streams is None
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--sweep-load-wave-streams", "3"])
    with pytest.raises(SystemExit):
        gpu_bench.parse()


def test_options_parse_lists_and_reject_garbage(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--tp-cpu-fraction", "0.5,2",
                                      "--configs", "none,ours-wb", "--settle-max-s", "30"])
    a = gpu_bench.parse()
    assert a.tp_cpu_fraction == [0.5, 2.0] and a.configs == ["none", "ours-wb"]
    assert a.settle_max_s == 30
    for bad in (["--tp-cpu-fraction", "0.5,x"], ["--tp-cpu-fraction", "0"],
                ["--configs", "none,nope"], ["--kv-layout", "BLXYZ"]):
        monkeypatch.setattr(sys, "argv", ["gpu_bench", *bad])
        with pytest.raises(SystemExit):
            gpu_bench.parse()
        assert bad[-1].split(",")[-1] in capsys.readouterr().err


def test_kv_layouts_are_vllms():
    """--kv-layout offers exactly the layouts vLLM names (where this vLLM has them)."""
    layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
    assert set(gpu_bench.KV_LAYOUTS) == {m.name for m in layouts.KVCacheLayout}


def test_throughput_table_shows_each_size():
    rows = [{"config": "none", "cpu_fraction": None, "requests": 8, "requests_per_s": 2.0,
             "ttft_mean_s": 0.5, "ttft_p99_s": 0.9, "from_gpu": 10, "from_cpu": 0,
             "from_disk": 0, "working_set_tokens": 4096, "gpu_kv_tokens": 1024,
             "cpu_tier_bytes": 0, "token_ids": [[1]]}]
    for frac, rps in ((0.5, 3.0), (2.0, 4.0)):
        rows.append({**rows[0], "config": "ours", "cpu_fraction": frac, "requests_per_s": rps,
                     "cpu_tier_bytes": int(4096 * 2048 * frac), "from_cpu": 5, "from_disk": 1})
    gpu_bench.compare([], rows)
    text = gpu_bench.table([], rows, ["none", "ours"])
    lines = [x for x in text.splitlines() if "| ours |" in x or "| none |" in x]
    assert len(lines) == 3  # none once (no CPU tier), ours per size, smallest first
    assert lines[0].startswith("| - | none | 2.00 |")
    assert lines[1].startswith("| 0.5x | ours | 3.00 |")
    assert lines[2].startswith("| 2x | ours | 4.00 |")
    assert "4.0x" in text  # working set / GPU KV cache
    json.dumps(rows)  # the rows stay JSON-serialisable


class _RoundsEngine:
    """A stand-in engine for ``throughput_for``: each timed ``generate`` of the requests takes
    the next of ``walls`` seconds and serves ``disk`` tokens from the disk; ``settle`` counts."""

    walls: list[float] = []
    settles = 0

    def __init__(self, *_a, **_k) -> None:
        self.init_s = 1.0
        self.rounds = 0

    def generate(self, prompts, max_tokens, skip_cache=False):
        if max_tokens == 1 and len(prompts) != 32:  # the populating call
            return 0.1, {"device": 0, "host": 0, "disk": 0}, []
        wall = self.walls[self.rounds]
        self.rounds += 1
        res = [{"ttft_s": wall / 2 + i / 1000, "token_ids": [self.rounds, i]}
               for i in range(len(prompts))]
        return wall, {"device": 10.0 * self.rounds, "host": 0.0, "disk": 100.0 * self.rounds}, res

    def settle(self, seconds=0.5, sync=False):
        type(self).settles += 1
        return {"waited_s": 0.0, "written_bytes": 0, "quiet": True}

    def close(self) -> None:
        pass


def test_throughput_rounds_report_the_median_round_whole_and_check_every_rounds_outputs(
        monkeypatch, tmp_path, capsys):
    """``--tp-rounds 3``: three timed rounds on one engine, each after a settle; the row is the
    median round (its req/s with its own TTFTs and sources, not a mix of rounds), lists every
    round's req/s, and the table gives the range. Every round's outputs are compared with the
    reference, so one round's wrong tokens show. 0 rounds is refused."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "throughput", "--configs", "ours",
                                      "--tp-rounds", "3", "--tp-prefix-tokens", "64"])
    a = gpu_bench.parse()
    monkeypatch.setattr(gpu_bench, "Engine", _RoundsEngine)
    _RoundsEngine.walls, _RoundsEngine.settles = [8.0, 16.0, 10.0], 0
    row = gpu_bench.throughput_for(a, tmp_path / "m", "ours", tmp_path, 1 << 10, 16, 0.5)
    assert _RoundsEngine.settles == 3  # before every round, not only the first
    assert row["rounds"] == 3
    assert row["requests_per_s_rounds"] == [32 / 8.0, 32 / 16.0, 32 / 10.0]
    assert row["requests_per_s"] == 32 / 10.0 and row["wall_s"] == 10.0  # the median round
    assert row["from_disk"] == 300.0 and row["from_gpu"] == 30.0  # the third round's own
    assert row["ttft_mean_s"] == pytest.approx(5.0 + 0.0155)
    assert "[2.00-4.00 over 3 rounds]" in capsys.readouterr().out
    ref = {**row, "config": "none", "cpu_fraction": None, "token_ids_rounds": None,
           "token_ids": row["token_ids_rounds"][0]}
    gpu_bench.compare([], [ref, row])
    # the reference's ids are the first round's [1, i]: the other two rounds differ everywhere
    assert row["same_tokens_fraction"] == pytest.approx(1 / 3)
    assert ref["same_tokens_fraction"] == 1.0
    text = gpu_bench.table([], [ref, row], ["none", "ours"])
    assert "| 0.5x | ours | 3.20 [2.00-4.00 over 3 rounds] | 5016 |" in text
    assert "req/s: the median of 3 rounds per engine" in text
    json.dumps(row)
    # one round (the default): the row as before, no range
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "throughput", "--configs", "ours",
                                      "--tp-prefix-tokens", "64"])
    one = gpu_bench.parse()
    assert one.tp_rounds == 1
    _RoundsEngine.walls = [8.0]
    row1 = gpu_bench.throughput_for(one, tmp_path / "m", "ours", tmp_path, 1 << 10, 16, 0.5)
    assert row1["requests_per_s"] == 4.0 and gpu_bench.rounds_note(row1) == ""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--tp-rounds", "0"])
    with pytest.raises(SystemExit):
        gpu_bench.parse()
    assert "--tp-rounds" in capsys.readouterr().err


def test_budget_skips_a_step_that_would_end_past_it():
    now = [0.0]
    b = gpu_bench.StepBudget(300, 0.0, clock=lambda: now[0])
    assert b.fits("phases", "none")  # nothing known: it starts
    now[0] = 60.0
    b.took("phases", "none", 57.0)  # no starts given: all of it is work
    guess = gpu_bench.StepBudget.START_GUESS_S
    assert b.estimate("phases", "ours") == 114.0 + 2 * guess  # restart and disk phase too
    assert b.estimate("phases", "cpu") == 57.0 + guess
    assert b.fits("phases", "ours")  # 60 + 144 <= 300
    now[0] = 160.0
    b.took("phases", "ours", 100.0, (10.0, 8.0))  # the run's first start, then a restart
    assert b.estimate("phases", "vtier-fs") == 82.0 + 2 * 8.0  # its work, starts at 8 s
    assert b.fits("phases", "cpu")  # 160 + 57 + 8
    assert b.fits("phases", "vtier-fs")  # 160 + 98 <= 300
    now[0] = 210.0
    assert not b.fits("phases", "vtier-fs")  # 210 + 98 > 300
    assert b.fits("throughput", "vtier-fs")  # no throughput run yet: nothing to go by
    b.took("throughput", "none", 30.0, (9.0,))
    assert b.estimate("throughput", "ours") == 21.0 + 8.0  # no restart in a throughput run
    assert gpu_bench.StepBudget(0, 0.0, clock=lambda: 1e9).fits("phases", "ours")  # no limit


def test_a_disk_config_without_disk_phases_is_expected_to_take_what_the_others_take():
    """Phases ``cold,cpu`` run no disk phase and no restart: a disk config's step then does
    what a config without disk does. Expecting twice that skipped our spec's CPU hits in the
    H100 run of 2026-12-06g (--budget-s 130: 59 s spent, 107 s expected for ~50)."""
    now = [0.0]
    b = gpu_bench.StepBudget(130, 0.0, clock=lambda: now[0], disk_phases=False)
    b.took("phases", "cpu", 59.0, (8.0,))
    now[0] = 59.0
    guess = gpu_bench.StepBudget.START_GUESS_S
    assert b.estimate("phases", "ours") == 51.0 + guess  # one engine, the same work
    assert b.fits("phases", "ours")  # 59 + 66 <= 130
    with_disk = gpu_bench.StepBudget(130, 0.0, clock=lambda: now[0])
    with_disk.took("phases", "cpu", 59.0, (8.0,))
    assert not with_disk.fits("phases", "ours")  # 59 + 102 + 2 * 15 > 130


def test_counters_the_kernel_refuses_are_reported_not_taken_for_quiet(monkeypatch, tmp_path):
    """A process whose /proc/<pid>/io may not be read (another user's, a ptrace restriction)
    is named, and the wait says how many there were."""
    import builtins

    from benchmarks import write_quiesce

    proc = start_writer(tmp_path, -1)
    try:
        hidden = process_tree(proc.pid)[1]  # the writing grandchild

        def refusing_open(path, *args, **kw):
            if path == f"/proc/{hidden}/io":
                raise PermissionError(13, "Permission denied", path)
            return builtins.open(path, *args, **kw)

        monkeypatch.setattr(write_quiesce, "open", refusing_open, raising=False)
        denied: list[int] = []
        seen = written_bytes(process_tree(proc.pid), denied)
        assert denied == [hidden] and hidden not in seen and proc.pid in seen
        got = wait_for_quiet_writes(window_s=0.3, max_s=10, sync=False)
        assert got.unreadable == 1
    finally:
        stop(proc)


# ---- the prefill sweep (issue 15) ------------------------------------------------------------

def test_1b_shape_is_llama_3_2_1b_with_half_a_mib_per_block():
    layers, hidden, heads, kv_heads, _, _ = gpu_bench.SHAPES["1b"]
    assert (layers, hidden // heads, kv_heads) == (16, 64, 8)
    assert 16 * gpu_bench.kv_bytes_per_token("1b", "bfloat16") == 512 << 10
    assert 16 * gpu_bench.kv_bytes_per_token("8b", "bfloat16") == 2 << 20
    assert 16 * gpu_bench.kv_bytes_per_token("32b", "bfloat16") == 4 << 20


def test_sweep_batches_reuse_the_last_prompts_of_the_batch_before():
    n = 50
    plan = gpu_bench.sweep_batches(n, [0, 20, 50, 80, 100])
    assert [(k, r) for k, r, _ in plan] == [("fill", 0), ("hit", 0), ("hit", 20), ("hit", 50),
                                            ("hit", 80), ("hit", 100)]
    assert plan[0][2] == list(range(n))
    seen: set[int] = set()
    prev_order: list[int] = []
    for kind, rate, batch in plan:
        assert len(batch) == len(set(batch)) == n
        old = [p for p in batch if p in seen]
        assert len(old) == round(rate * n / 100), (kind, rate)
        if old:  # exactly the most recently submitted prompts of the batch before
            assert set(old) == set(prev_order[n - len(old):])
        seen |= set(batch)
        prev_order = batch
    assert len(seen) == n + n * (1 + 0.8 + 0.5 + 0.2)


def test_sweep_configs_are_valid_and_set_the_chunk_size():
    from tiering.config import parse

    assert gpu_bench.sweep_transfer_config("none", 1 << 30, None, 16) is None
    cpu = gpu_bench.sweep_transfer_config("cpu", 1 << 30, 64, 16)["kv_connector_extra_config"]
    assert cpu == {"cpu_bytes_to_use": 1 << 30, "block_size": 64,
                   "spec_name": "CPUOffloadingSpec"}
    ours = gpu_bench.sweep_transfer_config("ours", 1 << 30, 16, 16)["kv_connector_extra_config"]
    assert ours["block_size"] == 16  # named, since our default on CUDA is longer
    default = gpu_bench.sweep_transfer_config("ours", 1 << 30, None, 16)
    assert "block_size" not in default["kv_connector_extra_config"]
    assert gpu_bench.default_chunk_tokens("ours", 16, True) == 64
    assert gpu_bench.default_chunk_tokens("ours-disk", 16, True) == 64
    assert gpu_bench.default_chunk_tokens("ours", 16, False) == 16
    assert gpu_bench.default_chunk_tokens("cpu", 16, True) == 16
    assert gpu_bench.default_chunk_tokens("ours", 128, True) == 128
    assert ours["spec_name"] == "TieredOffloadingSpec"
    cfg = parse(dict(ours))
    assert cfg.cpu_bytes_to_use == 1 << 30 and cfg.files == []  # the CPU tier alone
    with pytest.raises(ValueError, match="unknown config"):
        gpu_bench.sweep_transfer_config("vtier-fs", 1 << 30, None, 16)
    with pytest.raises(ValueError, match="needs a folder"):
        gpu_bench.sweep_transfer_config("ours-disk", 1 << 30, None, 16)
    disk = gpu_bench.sweep_transfer_config("ours-disk", 1 << 28, None, 16,
                                           disk=(Path("/x/kv"), 3 << 30))
    dcfg = parse(dict(disk["kv_connector_extra_config"]))
    assert dcfg.cpu_bytes_to_use == 1 << 28
    assert [(f.path, f.capacity) for f in dcfg.files] == [("/x/kv", "3.000GiB")]
    assert dcfg.cpu.promote == "auto"
    always = gpu_bench.sweep_transfer_config("ours-disk", 1 << 28, None, 16,
                                            disk=(Path("/x/kv"), 3 << 30), promote="always")
    assert parse(dict(always["kv_connector_extra_config"])).cpu.promote == "always"
    assert dcfg.cpu.promotion_reserve == 0.0  # the spec's default (off) when the sweep names none
    on = gpu_bench.sweep_transfer_config("ours-disk", 1 << 28, None, 16,
                                        disk=(Path("/x/kv"), 3 << 30), promotion_reserve=0.125)
    assert parse(dict(on["kv_connector_extra_config"])).cpu.promotion_reserve == 0.125
    fed = gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16,
                                         load_queue_bytes=256 << 20)
    assert parse(dict(fed["kv_connector_extra_config"])).load_queue_bytes == 256 << 20
    from tiering.settings import LOAD_QUEUE_BYTES

    # the spec's default where none is named; 0 (not fed) only where named
    assert parse(dict(ours)).load_queue_bytes == LOAD_QUEUE_BYTES
    unfed = gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16, load_queue_bytes=0)
    assert parse(dict(unfed["kv_connector_extra_config"])).load_queue_bytes == 0


def test_ours_sched_is_ours_under_our_scheduler():
    """ours-sched: the same transfer config as ours; the sweep names our scheduler to vLLM."""
    assert (gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16)
            == gpu_bench.sweep_transfer_config("ours", 1 << 30, None, 16))
    assert gpu_bench.default_chunk_tokens("ours-sched", 16, True) == 64
    from tiering.config import parse

    hf = gpu_bench.sweep_transfer_config("ours-hf", 1 << 30, None, 16)
    assert parse(dict(hf["kv_connector_extra_config"])).hits_first is True
    sched = gpu_bench.sweep_transfer_config("ours-sched", 1 << 30, None, 16)
    assert parse(dict(sched["kv_connector_extra_config"])).hits_first is False
    assert parse(dict(sched["kv_connector_extra_config"])).sort_gpu_blocks is True
    vorder = gpu_bench.sweep_transfer_config("ours-vorder", 1 << 30, None, 16)
    assert parse(dict(vorder["kv_connector_extra_config"])).sort_gpu_blocks is False
    assert set(gpu_bench.SWEEP_SCHEDULER_CONFIGS) == {"ours-sched", "ours-hf", "ours-vorder",
                                                      "none-sched"}
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(gpu_bench.SCHEDULER_CLS)
    from vllm.v1.core.sched.scheduler import Scheduler

    assert issubclass(cls, Scheduler)


def test_a_stack_timeline_without_py_spy_records_why_and_samples_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_bench, "_py_spy", lambda: None)
    tl = gpu_bench.StackTimeline(tmp_path / "t.jsonl.gz", 0.1)
    assert tl.error and "py-spy not found" in tl.error
    tl.start("0:hit:100")
    tl.stop()
    assert tl.samples == 0 and not (tmp_path / "t.jsonl.gz").exists()


def test_sweep_options_parse_and_reject_garbage(monkeypatch, capsys):
    base = ["gpu_bench", "--phases", "prefill-sweep"]
    monkeypatch.setattr(sys, "argv", base + ["--sweep-hit-rates", "100,0,50",
                                             "--sweep-chunk-tokens", "16,256",
                                             "--sweep-shapes", "1b,32b", "--profile", "cprofile"])
    a = gpu_bench.parse()
    assert a.sweep_hit_rates == [0, 50, 100] and a.sweep_chunk_tokens == [16, 256]
    assert a.sweep_shapes == ["1b", "32b"] and a.profile == ["cprofile"]
    for bad in (["--sweep-hit-rates", "0,120"], ["--sweep-shapes", "70b"],
                ["--profile", "perf"], ["--phases", "prefill-sweep,cold"]):
        monkeypatch.setattr(sys, "argv", base + bad)
        with pytest.raises(SystemExit):
            gpu_bench.parse()
        assert bad[1].split(",")[-1] in capsys.readouterr().err


def test_the_sweep_gpu_cache_holds_two_batches_so_later_batches_reuse_freed_blocks(
        monkeypatch, capsys):
    """By default a sweep engine's GPU cache holds 2 batches' blocks (512-token prompts and
    their output token: 33 blocks of 16 tokens each), so the third batch on runs in blocks
    freed by earlier ones, as a running server's requests do; 0 leaves vLLM's sizing."""
    assert gpu_bench.sweep_gpu_blocks(256, 512, 16, 2.0) == 2 * 256 * 33
    assert gpu_bench.sweep_gpu_blocks(96, 512, 16, 2.5) == 7920
    assert gpu_bench.sweep_gpu_blocks(256, 512, 16, 0.0) is None
    # one prompt, one batch: never fewer blocks than one request of the engine's max length
    # (vLLM refuses to start otherwise): 500 tokens + 1 is 32 blocks, 516 need 33
    assert gpu_bench.sweep_gpu_blocks(1, 500, 16, 1.0, max_len=516) == 33
    base = ["gpu_bench", "--phases", "prefill-sweep"]
    monkeypatch.setattr(sys, "argv", base)
    assert gpu_bench.parse().sweep_gpu_cache_batches == 2.0
    for bad in ("0.5", "-1"):  # under one batch, the batch itself would not fit
        monkeypatch.setattr(sys, "argv", base + ["--sweep-gpu-cache-batches", bad])
        with pytest.raises(SystemExit):
            gpu_bench.parse()
        assert "--sweep-gpu-cache-batches" in capsys.readouterr().err


def test_none_sched_offloads_nothing_under_our_scheduler_and_is_not_the_baseline():
    """none-sched: no transfer config, none's batches, our scheduler (for its step trace);
    the table names it without a chunk size and keeps plain none as the speed-ups' base."""
    assert gpu_bench.sweep_transfer_config("none-sched", 1 << 30, None, 16) is None
    assert "none-sched" not in gpu_bench.OURS_SWEEP_CONFIGS
    assert (gpu_bench.sweep_plan("none-sched", 4, [0.0, 50.0, 100.0], 2)
            == gpu_bench.sweep_plan("none", 4, [0.0, 50.0, 100.0], 2))
    rows = [{"shape": "1b", "config": c, "chunk_tokens": 16, "batch": "hit", "hit_rate": r,
             "prompts": 4, "prompt_tokens": 512, "tokens_per_s": t, "blocks_loaded": 0,
             "blocks_per_s": 0}
            for c, r, t in (("none", 0, 100.0), ("none", 100, 100.0),
                            ("none-sched", 0, 98.0), ("none-sched", 100, 97.0))]
    text = gpu_bench.sweep_table(rows, [0, 100])
    assert "| none-sched | 98 (0.98x) | 97 (0.97x) |" in text
    assert "| none | 100 (1.00x) | 100 (1.00x) |" in text


def test_none_sched_is_a_sweep_config_the_options_accept(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "prefill-sweep",
                                      "--sweep-configs", "ours-sched,none-sched,none"])
    a = gpu_bench.parse()
    assert a.sweep_configs == ["ours-sched", "none-sched", "none"]


def _llm_arguments(monkeypatch) -> dict:
    """vLLM's ``LLM`` replaced by one that keeps the keyword arguments an ``Engine`` gives it in
    the dict returned, then stops the engine's start with a RuntimeError."""
    seen: dict = {}

    class LLM:
        def __init__(self, **kw):
            seen.update(kw)
            raise RuntimeError("stop after the arguments")

    import vllm
    monkeypatch.setattr(vllm, "LLM", LLM)
    return seen


def test_prefix_hash_algo_and_sweep_prefix_caching_reach_the_engine_and_the_table(monkeypatch):
    """2026-12-07c, an H100's 1B 0% batch: vLLM's input thread hashed every arriving request's
    blocks for ours (a connector is loaded) and not for no offloading. --sweep-prefix-caching
    makes no offloading hash too, --prefix-hash-algo picks vLLM's hash; both reach the engine's
    arguments, and the table's title says which ran."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "prefill-sweep",
                                      "--sweep-prefix-caching", "--prefix-hash-algo", "xxhash"])
    a = gpu_bench.parse()
    assert a.sweep_prefix_caching and a.prefix_hash_algo == "xxhash"
    seen = _llm_arguments(monkeypatch)
    with pytest.raises(RuntimeError, match="stop after"):
        gpu_bench.Engine(a, Path("m"), "none", None, 64, 528, prefix_caching=True)
    assert seen["prefix_caching_hash_algo"] == "xxhash" and seen["enable_prefix_caching"]
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "prefill-sweep",
                                      "--prefix-hash-algo", "md5"])
    with pytest.raises(SystemExit):
        gpu_bench.parse()
    row = {"shape": "1b", "config": "none", "chunk_tokens": 16, "batch": "hit", "hit_rate": 0,
           "prompts": 4, "prompt_tokens": 512, "tokens_per_s": 1.0, "blocks_loaded": 0,
           "blocks_per_s": 0}
    assert "prefix caching off, eager launches; " in gpu_bench.sweep_table([row], [0])
    text = gpu_bench.sweep_table([{**row, "prefix_caching": True, "hash_algo": "xxhash"}], [0])
    assert "max_tokens 1, prefix caching on (hash xxhash), eager launches; tokens/s" in text


@pytest.mark.parametrize("mode, eager, graphs", [("eager", True, None),
                                                 ("decode", False, "FULL_DECODE_ONLY"),
                                                 ("compiled", False, "FULL_AND_PIECEWISE")])
def test_cuda_graphs_reach_the_engine_and_the_table(monkeypatch, mode, eager, graphs):
    """--cuda-graphs: the runs before 2026-12-07d were all eager, where a 100% batch's one-token
    steps cost a launch of every kernel from Python (57-190 ms a step on H100s); vLLM serves
    with CUDA graphs by default. The mode reaches the engine's arguments, GPU engines only, and
    the sweep's table and rows say which ran."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "prefill-sweep",
                                      "--cuda-graphs", mode])
    a = gpu_bench.parse()
    seen = _llm_arguments(monkeypatch)
    a.cpu_platform = False
    with pytest.raises(RuntimeError, match="stop after"):
        gpu_bench.Engine(a, Path("m"), "none", None, 64, 528)
    assert seen["enforce_eager"] is eager
    assert seen["compilation_config"].get("cudagraph_mode") == graphs
    assert seen["compilation_config"]["custom_ops"] == ["none"]
    # each engine gets its own copy: vLLM may write into the dict it is given
    seen["compilation_config"]["custom_ops"].append("+rms_norm")
    assert gpu_bench.engine_launch_kw(mode)["compilation_config"]["custom_ops"] == ["none"]
    row = {"shape": "1b", "config": "none", "chunk_tokens": 16, "batch": "hit", "hit_rate": 0,
           "prompts": 4, "prompt_tokens": 512, "tokens_per_s": 1.0, "blocks_loaded": 0,
           "blocks_per_s": 0, "cuda_graphs": mode}
    assert f"prefix caching off, {mode} launches; " in gpu_bench.sweep_table([row], [0])
    # the CPU platform has no CUDA graphs: its engines stay eager whatever the option says
    seen.clear()
    a.cpu_platform = True
    with pytest.raises(RuntimeError, match="stop after"):
        gpu_bench.Engine(a, Path("m"), "none", None, 64, 528)
    assert seen["enforce_eager"] is True and "compilation_config" not in seen


def test_an_unknown_cuda_graph_mode_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--cuda-graphs", "full"])
    with pytest.raises(SystemExit):
        gpu_bench.parse()
    with pytest.raises(ValueError, match="--cuda-graphs: expected one of"):
        gpu_bench.engine_launch_kw("full")
    with pytest.raises(ValueError, match="--cuda-graph-max-batch: expected 0 or more, got -1"):
        gpu_bench.engine_launch_kw("decode", -1)
    cc = gpu_bench.engine_launch_kw("decode", 1024)["compilation_config"]
    assert cc["max_cudagraph_capture_size"] == 1024
    assert "max_cudagraph_capture_size" not in gpu_bench.engine_launch_kw("eager", 1024)[
        "compilation_config"]


def test_sweep_table_gives_the_speedup_over_no_offloading():
    rows = [{"shape": "8b", "config": c, "chunk_tokens": 16, "batch": "hit", "hit_rate": r,
             "prompts": 4, "prompt_tokens": 512, "tokens_per_s": t, "blocks_loaded": b,
             "blocks_per_s": b * 10}
            for c, r, t, b in (("none", 0, 100.0, 0), ("none", 100, 100.0, 0),
                               ("ours", 0, 90.0, 0), ("ours", 100, 800.0, 124))]
    text = gpu_bench.sweep_table(rows, [0, 100])
    assert "| none | 100 (1.00x) | 100 (1.00x) |" in text
    assert "| ours (16-token chunks) | 90 (0.90x) | 800 (8.00x) 1240 b/s |" in text


def test_sweep_rounds_repeat_every_rate_and_the_table_gives_medians_and_the_ratio_to_vllm():
    """--sweep-rounds 3: every hit rate runs three batches on one engine (the LRU reuse of
    sweep_batches holds across rounds); the table gives each rate's median with its range and
    our setup over vLLM's spec from the medians, so one slow batch does not decide parity."""
    n = 10
    plan = gpu_bench.sweep_plan("ours", n, [0, 100], 3)
    assert [(k, r) for k, r, _ in plan] == [("fill", 0)] + [("hit", 0), ("hit", 100)] * 3
    for (_, _, prev), (_, rate, batch) in zip(plan, plan[1:], strict=False):
        if rate == 100:  # every prompt of a 100% batch is one of the batch just before
            assert set(batch) == set(prev)
    none = gpu_bench.sweep_plan("none", n, [0, 50, 100], 2)
    assert [(r, b[0]) for _, r, b in none] == [(0, 0), (100, 0), (0, n), (100, n)]
    rows = [{"shape": "8b", "config": c, "chunk_tokens": 16, "batch": "hit", "hit_rate": r,
             "prompts": 4, "prompt_tokens": 512, "tokens_per_s": t, "blocks_loaded": b,
             "blocks_per_s": b * 10}
            for c, r, t, b in (("none", 0, 100.0, 0), ("none", 100, 100.0, 0),
                               ("cpu", 50, 200.0, 62), ("cpu", 50, 260.0, 62),
                               ("cpu", 50, 250.0, 62),
                               ("ours-sched", 50, 180.0, 62), ("ours-sched", 50, 255.0, 62),
                               ("ours-sched", 50, 300.0, 62))]
    text = gpu_bench.sweep_table(rows, [50])
    assert "| cpu (16-token chunks) | 250 [200-260] (2.50x) 620 b/s |" in text
    assert "| ours-sched (16-token chunks) | 255 [180-300] (2.55x) 620 b/s |" in text
    assert "| ours-sched ÷ cpu | 1.020 |" in text
    monkeypatch_argv = ["gpu_bench", "--phases", "prefill-sweep", "--sweep-rounds", "0"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", monkeypatch_argv)
        with pytest.raises(SystemExit):
            gpu_bench.parse()


def test_profile_summary_splits_time_by_part_of_the_code(tmp_path):
    """A real cProfile run through start/stop, read back: our worker code and our scheduler
    code land in their groups, with µs per block."""
    import numpy as np

    from tiering import profiling
    from tiering.backends.block_copy import merge_runs
    from tiering.chain import tier_label

    path = tmp_path / "p.pstats"
    assert profiling.stop_profile(None, str(path)) is False  # none running
    profiling.start_profile(None, str(path))
    a = np.arange(0, 4096 * 64, 4096, dtype=np.int64)
    for _ in range(200):
        merge_runs(a, a + 7, np.full(64, 4096, dtype=np.int64))
        for i in range(20):
            tier_label(i)
    assert profiling.stop_profile(None, str(path)) is True
    text = profiling.summarize(str(path), blocks=100)
    worker = next(line for line in text.splitlines() if line.startswith("ours: worker"))
    sched = next(line for line in text.splitlines() if line.startswith("ours: scheduler"))
    assert float(worker.split()[-3]) > 0 and float(worker.split()[-1]) > 0
    assert float(sched.split()[-3]) > 0
    assert "block_copy.py:merge_runs" in text
    assert profiling.group_of("/x/vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
                              "scheduler.py", "f").startswith("vLLM offloading: scheduler")
    assert profiling.group_of("/x/vllm/v1/kv_offload/cpu/gpu_worker.py", "f").startswith(
        "vLLM offloading: worker")
    assert profiling.group_of("~", "{built-in method time.sleep}").startswith("waiting")


def test_latency_split_says_whether_the_slowest_request_loaded_or_computed():
    from types import SimpleNamespace as NS

    def out(cached: int, latency: float | None):
        return NS(num_cached_tokens=cached,
                  metrics=None if latency is None else NS(first_token_latency=latency))

    outs = [out(0, 0.5), out(0, 1.5), out(0, 1.0), out(512, 2.6), out(448, 0.4), out(512, None)]
    split = gpu_bench.latency_split(outs)
    assert split["computed"] == {"requests": 3, "median_s": 1.0, "max_s": 1.5}
    # a request without a latency still counts, and no latency is made up for it
    assert split["loaded"] == {"requests": 3, "median_s": 1.5, "max_s": 2.6}
    none = gpu_bench.latency_split([out(0, None)])
    assert none["computed"] == {"requests": 1, "median_s": None, "max_s": None}
    assert none["loaded"]["requests"] == 0


def test_repeats_give_each_length_prompts_of_other_tokens(monkeypatch, capsys):
    """``--repeats R``: R prompts per length, the first the one a run without it uses, the others
    of other tokens; 0 is refused."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--lengths", "64,128", "--repeats", "3"])
    a = gpu_bench.parse()
    got = gpu_bench.phase_prompts(a.lengths, a.repeats, 1000)
    assert [(n, r) for n, _, r in got] == [(64, 0), (64, 1), (64, 2), (128, 0), (128, 1),
                                           (128, 2)]
    assert all(len(p) == n for n, p, _ in got)
    assert got[0][1] == gpu_bench.prompt(64, 64, 1000) and got[3][1] == gpu_bench.prompt(128, 128, 1000)
    assert len({tuple(p) for _, p, _ in got}) == 6
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--repeats", "0"])
    with pytest.raises(SystemExit):
        gpu_bench.parse()
    assert "--repeats" in capsys.readouterr().err


def _phase_row(config, phase, repeat, ms, tokens, source="r", length=2048):
    hit = {"g": "from_gpu", "c": "from_cpu", "d": "from_disk"}.get(source)
    row = {"config": config, "length": length, "phase": phase, "repeat": repeat,
           "ttft_s": ms / 1000, "wall_s": ms / 1000, "cached_tokens": 0, "from_gpu": 0,
           "from_cpu": 0, "from_disk": 0, "token_ids": tokens, "logprobs": [-1.0] * len(tokens)}
    if hit:
        row[hit] = length
    return row


def test_a_cell_of_several_repeats_gives_the_median_and_range_and_each_repeat_is_checked_alone():
    """Each repeat's tier hit is checked against that repeat's own GPU hit and no-offloading
    run (another prompt's tokens would never match); the cell shows the median TTFT, every
    source seen and the range; one inexact repeat marks the cell."""
    rows = []
    for rep, toks in ((0, [1, 2]), (1, [3, 4]), (2, [5, 6])):
        rows.append(_phase_row("none", "cold", rep, 70 + rep, toks))
        rows.append(_phase_row("ours", "gpu", rep, 60, toks, "g"))
    # disk: recomputed twice (73, 147 ms), loaded once (90 ms); the loaded one differs
    rows.append(_phase_row("ours", "disk", 0, 73, [1, 2]))
    rows.append(_phase_row("ours", "disk", 1, 147, [3, 4]))
    rows.append(_phase_row("ours", "disk", 2, 90, [5, 7], "d"))
    gpu_bench.compare(rows, [])
    disk = [r for r in rows if r["phase"] == "disk"]
    assert [r["same_tokens"] for r in disk] == [True, True, False]
    assert [r["exact_vs_gpu_hit"] for r in disk] == [True, True, False]
    text = gpu_bench.table(rows, [], ["none", "ours"])
    line = next(x for x in text.splitlines() if x.startswith("| disk |"))
    assert line == "| disk |  | 90 (r/d) * ! [73-147, 3] |"
    cold = next(x for x in text.splitlines() if x.startswith("| cold |"))
    assert cold == "| cold | 71 (r) [70-72, 3] |  |"
    # one prompt a length (no --repeats): the cell as before
    one = [r for r in rows if r["repeat"] == 0]
    gpu_bench.compare(one, [])
    assert "| disk |  | 73 (r) = |" in gpu_bench.table(one, [], ["none", "ours"])


def test_a_hits_ttft_is_split_at_vllms_scheduled_timestamp():
    """vLLM records SCHEDULED for a loading request only once its load is done: queued to
    scheduled is admission plus the load, scheduled to the first token the compute step. The
    table gives both medians per spec, so two specs' hits split where they differ; a request
    without vLLM's timestamps (stats off) gives none, never a negative time."""
    from types import SimpleNamespace as NS

    split = gpu_bench.engine_core_split(NS(queued_ts=10.0, scheduled_ts=10.012,
                                           first_token_ts=10.130))
    assert split["wait_s"] == pytest.approx(0.012) and split["compute_s"] == pytest.approx(0.118)
    for bad in (None, NS(queued_ts=0.0, scheduled_ts=0.0, first_token_ts=0.0),
                NS(queued_ts=10.0, scheduled_ts=9.0, first_token_ts=10.1)):
        assert gpu_bench.engine_core_split(bad) == {"wait_s": None, "compute_s": None}
    rows = []
    for config, waits, computes in (("ours", (12, 14, 40), (120, 118, 121)),
                                    ("cpu", (11, 11, 12), (119, 119, 120))):
        for rep, (w, c) in enumerate(zip(waits, computes, strict=True)):
            rows.append({**_phase_row(config, "cpu", rep, w + c + 2, [1, 2], "c"),
                         "wait_s": w / 1000, "compute_s": c / 1000})
    rows.append({**_phase_row("ours", "cold", 0, 300, [1, 2]), "wait_s": 0.001,
                 "compute_s": 0.299})
    text = gpu_bench.table(rows, [], ["ours", "cpu"])
    assert "| cpu 2048 | 14.0 + 120.0 | 11.0 + 119.0 |" in text
    assert "| cold 2048 |" not in text  # cold prompts load nothing: not in the split
    assert "Where a hit's first token goes" not in gpu_bench.table(
        [_phase_row("ours", "cpu", 0, 130, [1, 2], "c")], [], ["ours"])


def test_cprofile_phases_must_be_run_and_mark_their_cells(monkeypatch, capsys):
    """``--cprofile-phases``: only phases that run may be profiled (a typo is refused, not a
    run without the profile it was for), and a profiled request's cell says so, since its
    TTFT includes the profiler's cost."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "cold,disk,restart",
                                      "--cprofile-phases", "disk,restart"])
    assert gpu_bench.parse().cprofile_phases == ["disk", "restart"]
    for opt in ("--cprofile-phases", "--thread-cpu-phases"):
        monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "cold,disk", opt,
                                          "disk,restrat"])
        with pytest.raises(SystemExit):
            gpu_bench.parse()
        err = capsys.readouterr().err
        assert "restrat" in err and opt in err
    rows = [_phase_row("ours", "gpu", 0, 60, [1, 2], "g"),
            {**_phase_row("ours", "disk", 0, 900, [1, 2], "d"), "profiled": {"stats": "x"}},
            _phase_row("ours", "restart", 0, 800, [1, 2], "d")]
    gpu_bench.compare(rows, [])
    text = gpu_bench.table(rows, [], ["ours"])
    assert "| disk | 900 (d) = p |" in text and "| restart | 800 (d) = |" in text


def test_a_fresh_machines_first_engine_start_is_not_taken_for_every_start():
    """2026-12-06d, an H100 just started: no offloading's phases took 95 s, 53 of them its
    engine's first start (kernels compiled, caches warmed); the disk configs were then expected
    to take 190 s and both were skipped, with 233 s of budget and 109 s spent, though ours then
    took 108 s (its own start 35 s) in the next call. The first start is not what a start costs."""
    now = [109.0]
    b = gpu_bench.StepBudget(233, 0.0, clock=lambda: now[0])
    b.took("phases", "none", 95.2, (52.7,))
    est = b.estimate("phases", "ours")
    assert est == 2 * (95.2 - 52.7) + 2 * gpu_bench.StepBudget.START_GUESS_S
    assert b.fits("phases", "ours")  # 109 + 115 <= 233
    now[0] = 217.0
    b.took("phases", "ours", 107.7, (35.2, 8.4))
    assert b.start_s() == 8.4  # the quickest start after the first
    assert b.estimate("phases", "vtier-fs") == (107.7 - 35.2 - 8.4) + 2 * 8.4


class _WarmRecorder:
    """Stands in for ``Engine`` in ``phases_for``: runs the real ``Engine.warm_up`` against an
    LLM that only records the prompts, and does nothing else."""

    started: list[list[list[int]]] = []
    warm_up = gpu_bench.Engine.warm_up  # the real one (the test replaces gpu_bench.Engine)

    def __init__(self, a, model, config, kvt, gpu_blocks, max_len, warm_tokens=64,
                 max_num_seqs=64, prefix_caching=True, engine_kw=None,
                 warm_base=gpu_bench.WARM_BASE) -> None:
        prompts: list[list[int]] = []
        self.llm = type("LLM", (), {"generate": lambda _s, ps, *_a, **_k: prompts.extend(
            p["prompt_token_ids"] for p in ps)})()
        self.init_s = self.weights_s = 0.0
        self.settle = lambda *_a, **_k: {}
        self.warm_up(warm_tokens, warm_base)
        _WarmRecorder.started.append(prompts)

    def generate(self, *_a, **_k):
        return 0.0, {}, [{}]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["fresh", "same"])
def test_a_restarted_engines_warm_up_loads_nothing_from_the_disk_unless_asked(
        monkeypatch, tmp_path, mode):
    """2026-12-06d, H100 virtual disk: the restarted engine's warm-up prompts were the first
    engine's, so it loaded them (4.5 GiB at 32k) from the disk tier seconds before the measured
    restart hit, while the first engine's warm-up computed. Under ``fresh`` (the default) no
    warm-up prompt of the restarted engine shares even its first token with one the first engine
    stored; ``same`` keeps the old behaviour for an A/B."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "cold,disk,restart",
                                      "--lengths", "256,1024", "--configs", "ours",
                                      *(["--restart-warmup", mode] if mode == "same" else [])])
    a = gpu_bench.parse()
    assert a.restart_warmup == mode
    monkeypatch.setattr(gpu_bench, "Engine", _WarmRecorder)
    monkeypatch.setattr(gpu_bench, "record", lambda *_a, **_k: None)
    _WarmRecorder.started = []
    kvb = 1 << 10
    timings = gpu_bench.phases_for(a, tmp_path / "m", "ours", tmp_path, [], [], kvb, 2048, 0,
                                   4 << 20)
    first, restarted = _WarmRecorder.started
    assert timings["restart_warmup"] == mode
    assert sorted(map(len, first)) == sorted(map(len, restarted)) == [64, 256, 1024]
    # nothing a measured prompt uses (they draw from 100 up)
    assert max(max(p) for p in first + restarted) < 100
    if mode == "fresh":
        assert not {p[0] for p in first} & {p[0] for p in restarted}
    else:
        assert first == restarted


def test_file_tier_gib_fits_the_scratch_disk_or_says_so(tmp_path, monkeypatch):
    """The phases' file tier asks for at most 95% of its disk's free bytes (our tier refuses a
    capacity its disk cannot hold, and the engine does not start); a step that cannot fit at
    all is one error naming the folder, before any engine starts."""
    import shutil
    from collections import namedtuple

    from benchmarks.gpu_bench import file_tier_gib

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 100 << 30}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, free["bytes"]))
    scratch = tmp_path / "not" / "made" / "yet"
    assert file_tier_gib(0.0, 10 << 30, scratch) == 15.0  # 1.5x what it stores
    assert file_tier_gib(0.0, 1 << 20, scratch) == 1.0  # at least 1 GiB
    assert file_tier_gib(7.0, 90 << 30, scratch) == 7.0  # --disk-gib wins
    free["bytes"] = 26 << 30  # the H100's RAM disk; three prompts a cell store 23.7 GiB
    assert file_tier_gib(0.0, 20 << 30, scratch) == pytest.approx(0.95 * 26)
    with pytest.raises(SystemExit, match=str(scratch)):
        file_tier_gib(0.0, int(23.7 * 2**30), scratch)


def _sweep_setup_whose_warm_up_runs_out_of_memory(monkeypatch, tmp_path, close) -> None:
    """``sweep_setup`` over a stand-in engine whose warm-up hits raise CUDA out of memory and
    whose ``close`` is ``close``; the error must come out of the setup."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "prefill-sweep", "--out",
                                      str(tmp_path), "--sweep-shapes", "8b",
                                      "--sweep-configs", "ours-sched"])
    a = gpu_bench.parse()

    class Engine:
        def __init__(self, *args, **kw):
            self.init_s = self.weights_s = 0.0

        def warm_hits(self, tokens, vocab):
            raise RuntimeError("CUDA out of memory in a warm-up step")

        def close(self):
            close()

    monkeypatch.setattr(gpu_bench, "SweepEngine", Engine)
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_bench.sweep_setup(a, tmp_path / "m", "8b", "ours-sched", None, 4, 512, 16,
                              tmp_path, "t")


def test_an_engine_whose_warm_up_fails_is_closed_so_the_next_setup_can_start(monkeypatch, tmp_path):
    """2026-12-07e, an H100: the 32B ours-sched engine ran out of GPU memory in its warm-up hit
    rounds; the engine was never closed, its process kept 78 GiB, and the next setup (vLLM's
    spec) could not start ("Free memory on device cuda:0 (1.05/79.18 GiB) on startup"). Every
    engine a setup opens is closed whatever stops the setup."""
    closed: list[bool] = []
    _sweep_setup_whose_warm_up_runs_out_of_memory(monkeypatch, tmp_path,
                                                  lambda: closed.append(True))
    assert closed == [True]


def test_an_engine_whose_start_up_warm_up_fails_is_closed_before_the_error_leaves(monkeypatch):
    """The warm-up and the random weights run inside ``Engine``'s constructor, after vLLM's
    engine started: if either fails, the caller has no engine to close, so the constructor
    closes it (its process would keep the GPU's memory)."""
    monkeypatch.setattr(sys, "argv", ["gpu_bench", "--phases", "prefill-sweep"])
    a = gpu_bench.parse()
    shut = []

    class Core:
        def shutdown(self):
            shut.append(True)

    class LLM:
        def __init__(self, **kw):
            self.llm_engine = types.SimpleNamespace(engine_core=Core())

        def apply_model(self, fn):
            return None

        def generate(self, *args, **kw):
            raise RuntimeError("CUDA out of memory in the warm-up")

    import vllm
    monkeypatch.setattr(vllm, "LLM", LLM)
    monkeypatch.setattr(gpu_bench.time, "sleep", lambda s: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_bench.Engine(a, Path("m"), "none", None, 64, 528)
    assert shut == [True]


def test_a_close_that_fails_does_not_hide_why_the_setup_stopped(monkeypatch, tmp_path, capsys):
    def close():
        raise ValueError("close failed")

    _sweep_setup_whose_warm_up_runs_out_of_memory(monkeypatch, tmp_path, close)
    assert "closing the engine failed" in capsys.readouterr().out


@pytest.mark.parametrize("step_min_s, starts", [(None, False), ("20", True)])
def test_step_min_s_lets_a_short_session_run_a_step_its_own_minimum_would_skip(
        tmp_path, step_min_s, starts):
    """gpu_session.sh starts a step only if the budget left covers the step's minimum (a sweep:
    90 s). A short call whose step is known to fit sets STEP_MIN_S instead of running gpu-bench
    under a bare ``timeout``, which left its engine process holding the GPU's memory
    (2026-12-07e). gpu-bench and nvidia-smi are stand-ins here."""
    root = Path(__file__).resolve().parent.parent
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text("#!/bin/sh\necho \"$@\" >> \"$SHIM_LOG\"\n")
    (shim / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for f in shim.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "BUDGET_S": "60",
           "SHIM_LOG": str(tmp_path / "calls.txt"), "TIERING_WHL_SITE": str(tmp_path / "whl")}
    env.pop("STEP_MIN_S", None)
    if step_min_s:
        env["STEP_MIN_S"] = step_min_s
    out = tmp_path / "out"
    subprocess.run(["bash", str(root / "scripts" / "gpu_session.sh"), str(out), "sweep"],
                   cwd=root, env=env, check=True, capture_output=True, timeout=120)
    session = (out / "session.txt").read_text()
    calls = tmp_path / "calls.txt"
    if starts:
        assert "sweep: start" in session and "sweep: exit 0" in session
        assert "benchmarks.gpu_bench" in calls.read_text()
    else:
        assert "sweep skipped" in session and "at least 90s" in session
        assert not calls.exists() or "benchmarks.gpu_bench" not in calls.read_text()
