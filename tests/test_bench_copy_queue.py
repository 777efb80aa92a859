"""docs/bench_copy_queue.py runs only on a GPU; here it runs over a stand-in torch (numpy
arrays, copies that take time, PyTorch's allocation counts), so that its cases, the alloc
cases' bookkeeping and its JSON are checked where CI runs."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _stand_in_torch() -> types.ModuleType:
    counts = {"host": 0, "device": 0}
    # the stream of the enclosing ``torch.cuda.stream`` block, per thread (as PyTorch's is)
    current = threading.local()

    @contextlib.contextmanager
    def on_stream(s):
        before, current.stream = getattr(current, "stream", None), s
        try:
            yield
        finally:
            current.stream = before

    class Tensor:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __getitem__(self, k):
            return Tensor(self.a[k])

        def copy_(self, other: Tensor, non_blocking: bool = False) -> Tensor:
            time.sleep(0.0002)  # a copy engine's time: the fed bulk outlasts the first probes
            self.a[...] = other.a
            if getattr(current, "stream", None) is not None:
                current.stream.copied += self.a.nbytes
            return self

        def add_(self, v: float) -> Tensor:
            self.a += v
            return self

    def empty(n: int, dtype=None, pin_memory: bool = False, device=None) -> Tensor:
        if n > 1 << 24:  # larger than anything cached: a real allocation
            counts["host" if pin_memory else "device"] += 1
        return Tensor(np.zeros(n, dtype=dtype))

    class Stream:
        made: list = []  # every stream, in the order made

        def __init__(self, device=None, priority: int = 0) -> None:
            self.copied = 0  # bytes copied inside a ``torch.cuda.stream`` block of this one
            Stream.made.append(self)

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
        Stream=Stream, Event=Event, stream=on_stream,
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
    torch = _stand_in_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    spec = importlib.util.spec_from_file_location("bench_copy_queue",
                                                  ROOT / "docs" / "bench_copy_queue.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cq.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_copy_queue.py", "--bulk-gib", "0,0.25", "--repeat", "1", "--probe-ms", "1",
        "--alloc-after-ms", "3", "--job-mib", "32", "--fed-wave-mib", "64", "--json", str(out)])
    streams = torch.cuda.Stream.made
    assert bench.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["idle", "queued", "high-priority", "waves", "fed",
                                         "fed-waves", "fed-waves-1g", "fed-pingpong",
                                         "fed+host-alloc", "fed+malloc", "fed+sync"]
    for r in rows[4:8]:  # the fed cases without an allocation: probes, the bulk, no alloc keys
        assert r["probes"] >= 1 and r["bulk_ms"] > 0 and "alloc_calls" not in r
    # fed-pingpong: four waves of 64 MiB, every other one on the second load stream (made
    # fourth: bulk, urgent, output, second), the only case that copies on it
    second = streams[3]
    assert second.copied == 2 * 64 * 2**20
    for r in rows[-3:]:
        assert r["alloc_calls"] == (0 if r["case"] == "fed+sync" else 1)
        assert r["alloc_began_ms"] >= 3.0
        assert r["alloc_step_end_after_bulk_ms"] < 0 < r["bulk_ms"]
        assert r["probes"] >= 2
