"""docs/bench_copy_queue.py runs only on a GPU; here it runs over a stand-in torch (numpy
arrays, copies that take time, PyTorch's allocation counts), so that its cases, the alloc
cases' bookkeeping and its JSON are checked where CI runs."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _stand_in_torch() -> types.ModuleType:
    counts = {"host": 0, "device": 0}

    class Tensor:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __getitem__(self, k):
            return Tensor(self.a[k])

        def copy_(self, other: Tensor, non_blocking: bool = False) -> Tensor:
            time.sleep(0.0002)  # a copy engine's time: the fed bulk outlasts the first probes
            self.a[...] = other.a
            return self

        def add_(self, v: float) -> Tensor:
            self.a += v
            return self

    def empty(n: int, dtype=None, pin_memory: bool = False, device=None) -> Tensor:
        if n > 1 << 24:  # larger than anything cached: a real allocation
            counts["host" if pin_memory else "device"] += 1
        return Tensor(np.zeros(n, dtype=dtype))

    class Stream:
        def __init__(self, device=None, priority: int = 0) -> None:
            pass

        @staticmethod
        def priority_range() -> tuple[int, int]:
            return (0, -5)

        def wait_stream(self, other) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    torch = types.ModuleType("torch")
    torch.uint8, torch.float32 = np.uint8, np.float32
    torch.device = lambda *a: "cuda:0"
    torch.empty = empty
    torch.ones = lambda n, dtype=None, pin_memory=False, device=None: Tensor(np.ones(n, dtype))
    torch.cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event, stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda d=None: Stream(), synchronize=lambda d=None: None,
        get_device_name=lambda d=None: "stand-in",
        memory_stats_as_nested_dict=lambda d=None: {"num_device_alloc": counts["device"]},
        memory=types.SimpleNamespace(
            host_memory_stats_as_nested_dict=lambda: {"num_host_alloc": counts["host"]}))
    return torch


def test_every_case_runs_and_the_alloc_cases_report_their_step(monkeypatch, tmp_path):
    """Each case gives its rows; in ``fed+host-alloc`` and ``fed+malloc`` the step probed
    after ``--alloc-after-ms`` made exactly one allocation PyTorch counted (``fed+sync``: none,
    a device sync), and its end is placed against the bulk's (here before it: the stand-in's
    steps never wait)."""
    monkeypatch.setitem(sys.modules, "torch", _stand_in_torch())
    spec = importlib.util.spec_from_file_location("bench_copy_queue",
                                                  ROOT / "docs" / "bench_copy_queue.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cq.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_copy_queue.py", "--bulk-gib", "0,0.25", "--repeat", "1", "--probe-ms", "1",
        "--alloc-after-ms", "3", "--json", str(out)])
    assert bench.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["idle", "queued", "high-priority", "waves", "fed",
                                         "fed-waves", "fed+host-alloc", "fed+malloc", "fed+sync"]
    for r in rows[4:6]:  # the fed cases without an allocation: probes, the bulk, no alloc keys
        assert r["probes"] >= 1 and r["bulk_ms"] > 0 and "alloc_calls" not in r
    for r in rows[-3:]:
        assert r["alloc_calls"] == (0 if r["case"] == "fed+sync" else 1)
        assert r["alloc_began_ms"] >= 3.0
        assert r["alloc_step_end_after_bulk_ms"] < 0 < r["bulk_ms"]
        assert r["probes"] >= 2
