"""docs/plot_hit_batch.py reads gpu-bench's step tables: every batch at the rate asked, each
step's start and the requests computed by then (the figure of docs/benchmarks.md, 2026-12-07d)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs/results/2026-12-07d/callF/sw8g/prefill_sweep_h100k_8b_ours-sched.txt"


def _plot():
    spec = importlib.util.spec_from_file_location("plot_hit_batch", ROOT / "docs/plot_hit_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_recorded_table_gives_each_100_percent_batch_with_every_request_computed():
    found = _plot().batches(TABLE, 100)
    assert [tps for tps, _ in found] == [290587, 311641, 272020]
    for _, steps in found:
        times = [ms for ms, _ in steps]
        assert times == sorted(times) and times[0] < 10
        assert steps[-1][1] == 256  # 256 prompts a batch, each computed once
        done = [n for _, n in steps]
        assert done == sorted(done)


def test_other_rates_and_sections_are_left_out(tmp_path):
    plot = _plot()
    assert len(plot.batches(TABLE, 0)) == 0  # the fill batch is "fill", not "hit"
    t = tmp_path / "steps.txt"
    t.write_text("== 8b ours-sched hit 50% seen: 100 tok/s, 1.0 s\n"
                 "      ms sched ms    cpu  tokens  reqs\n"
                 "     1.0      0.1    0.1     512     1\n"
                 "window 1.0 ms, 1 steps\n"
                 "== 8b ours-sched hit 100% seen: 200 tok/s, 0.5 s\n"
                 "      ms sched ms    cpu  tokens  reqs\n"
                 "     2.0      0.1    0.1       3     3\n"
                 "     5.0      0.1    0.1       2     2\n"
                 "window 6.0 ms, 2 steps\n"
                 "== 8b ours-sched fill 0% seen: 50 tok/s, 2.0 s\n"
                 "     9.0      0.1    0.1     512     7\n")
    assert plot.batches(t, 100) == [(200, [(2.0, 3), (5.0, 5)])]
    assert plot.batches(t, 50) == [(100, [(1.0, 1)])]


def test_bad_arguments_are_refused_before_anything_is_drawn(monkeypatch, tmp_path):
    """Checked before matplotlib is imported (the test venv has none): a label without a table,
    then a table without a batch at the rate asked; no picture is written."""
    import sys

    out = tmp_path / "x.png"
    monkeypatch.setattr(sys, "argv", ["plot", str(out), f"ok={TABLE}", "no-equals-sign"])
    with pytest.raises(SystemExit, match="'no-equals-sign': expected LABEL=STEPS.txt"):
        _plot().main()
    monkeypatch.setattr(sys, "argv", ["plot", str(out), f"ok={TABLE}", "--rate", "50"])
    with pytest.raises(SystemExit, match="no batch at 50% in this step table"):
        _plot().main()
    assert not out.exists()
