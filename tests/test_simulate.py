"""The trace-driven simulator and its CLI."""

from __future__ import annotations

import json

import pytest

from tiering.cli import main
from tiering.simulate import simulate
from tiering.workloads import BUILTIN, from_trace


def test_trace_parsing_groups_by_request(tmp_path):
    trace = tmp_path / "t.txt"
    trace.write_text("a r1\nb r1\n# comment\n\nc r2\nd\ne r2\n")
    assert list(from_trace(trace)) == [("r1", ["a", "b"]), ("r2", ["c"]), ("line6", ["d"]),
                                       ("r2", ["e"])]


def test_trace_bad_line_names_file_and_line(tmp_path):
    trace = tmp_path / "t.txt"
    trace.write_text("a r1\na b c\n")
    with pytest.raises(ValueError, match=r"t.txt:2: expected 'key \[request_id\]'"):
        list(from_trace(trace))


def test_simulate_counts_hits_and_writes_exactly():
    reqs = [("1", ["a", "b"]), ("2", ["a", "b"]), ("3", ["c"]), ("4", ["a", "c"])]
    r = simulate(iter(reqs), "lru", capacity=2)
    # 1: miss a,b (store both); 2: hit a,b; 3: miss c -> evict one (b, the suffix); 4: hit a, hit c
    assert (r.lookups, r.hits, r.admitted_writes, r.evictions) == (7, 4, 3, 1)
    assert r.prefix_hits == 4


def test_simulate_threshold_two_cuts_writes():
    reqs = list(BUILTIN["zipf"].make(1))[:20_000]
    r0 = simulate(iter(reqs), "lru", 500, threshold=0)
    r2 = simulate(iter(reqs), "lru", 500, threshold=2)
    assert r2.admitted_writes < r0.admitted_writes / 2
    assert r2.rejected > 0


def test_arc_beats_lru_on_scan_workload():
    reqs = list(BUILTIN["scan"].make(0))[:60_000]
    lru = simulate(iter(reqs), "lru", 1000)
    arc = simulate(iter(reqs), "arc", 1000)
    assert arc.hit_ratio > lru.hit_ratio * 1.5


def test_cli_json(tmp_path, capsys):
    trace = tmp_path / "t.txt"
    trace.write_text("\n".join(f"k{i % 5} r{i}" for i in range(50)))
    assert main(["simulate", "--trace", str(trace), "--capacity", "5", "--policies", "lru,arc",
                 "--thresholds", "0,3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity"] == 5 and len(out["results"]) == 4
    first = out["results"][0]
    assert first["policy"] == "lru" and first["threshold"] == 0
    assert first["hits"] == 45 and first["admitted_writes"] == 5


def test_cli_unknown_policy_is_usage_error(capsys):
    assert main(["simulate", "--policies", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_demotion_modes_exactly_on_a_small_trace():
    from tiering.simulate import simulate_demotion

    # CPU holds 2 chunks, disk 8. a,b stored; c,d push a,b out; a,b come back from disk and
    # push c,d out: write-back writes each chunk once as it leaves the CPU tier.
    reqs = [("1", ["a", "b"]), ("2", ["c", "d"]), ("3", ["a", "b"])]
    wt = simulate_demotion(iter(reqs), "lru", 2, 8, demote="on_store")
    wb = simulate_demotion(iter(reqs), "lru", 2, 8, demote="on_evict")
    assert (wt.cpu_hits, wt.disk_hits, wt.disk_writes) == (0, 2, 4)  # every store written
    assert (wb.cpu_hits, wb.disk_hits, wb.disk_writes) == (0, 2, 4)  # a,b then c,d evicted
    wb2 = simulate_demotion(iter(reqs[:2]), "lru", 2, 8, demote="on_evict")
    assert wb2.disk_writes == 2  # c,d still in the CPU tier: not written yet
    # a CPU tier that holds everything: write-back never writes, write-through writes all
    reqs = [(str(i), ["x", "y"]) for i in range(5)]
    assert simulate_demotion(iter(reqs), "arc", 4, 8, demote="on_evict").disk_writes == 0
    assert simulate_demotion(iter(reqs), "arc", 4, 8, demote="on_store").disk_writes == 2


def test_simulate_cli_compares_demotion_modes(capsys):
    assert main(["simulate", "--workload", "rag", "--cpu-capacity", "300", "--policies", "lru",
                 "--thresholds", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    modes = {r["demote"]: r for r in out["results"]}
    assert set(modes) == {"on_store", "on_evict"}
    assert modes["on_evict"]["disk_writes"] <= modes["on_store"]["disk_writes"]
    assert main(["simulate", "--cpu-capacity", "0"]) == 2
