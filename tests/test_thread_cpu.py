"""Per-thread CPU accounting (benchmarks/thread_cpu.py) and our threads' OS names."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks import thread_cpu
from tiering.thread_names import name_os_thread, os_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

BUSY = """
import sys, time
from tiering.thread_names import name_os_thread
import threading
def spin():
    name_os_thread("tier-spinner-0-and-more")
    while True:
        sum(range(1000))
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(30)
"""


def test_a_busy_named_thread_of_another_process_is_the_busiest(tmp_path):
    root = Path(__file__).resolve().parent.parent
    p = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True,
                         cwd=root)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        before = thread_cpu.snapshot()
        time.sleep(1.0)
        rows = thread_cpu.busiest(before, thread_cpu.snapshot(), top=5)
    finally:
        p.kill()
        p.wait()
    top = rows[0]
    assert top["pid"] == p.pid and top["tid"] != p.pid
    assert top["thread"] == "tier-spinner-0-"  # the kernel keeps 15 bytes
    assert 0.3 <= float(top["cpu_s"]) <= 1.5  # one spinning thread for a second (or less of it)
    assert all(float(a["cpu_s"]) >= float(b["cpu_s"]) for a, b in zip(rows, rows[1:], strict=False))


def test_names_are_cut_to_whole_characters_and_naming_never_raises():
    assert os_name("tier-posix-12") == b"tier-posix-12"
    assert os_name("x" * 14 + "é") == b"x" * 14  # é is 2 bytes: never half of it
    got: list[bool] = []
    named, done = threading.Event(), threading.Event()

    def body() -> None:
        got.append(name_os_thread("tier-test"))
        named.set()
        done.wait(10)

    t = threading.Thread(target=body)
    t.start()
    try:
        assert named.wait(10) and got == [True]
        assert Path(f"/proc/self/task/{t.native_id}/comm").read_text().strip() == "tier-test"
    finally:
        done.set()
        t.join()


def test_a_stat_line_with_spaces_and_parentheses_in_the_name_parses(tmp_path):
    d = tmp_path / "42" / "task" / "43"
    d.mkdir(parents=True)
    rest = "S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 2 0 100"
    (tmp_path / "42" / "stat").write_text(f"42 (py (x) 3) {rest}\n")
    (d / "stat").write_text(f"43 (tier-posix-0) {rest.replace('250 50', '300 60')}\n")
    (tmp_path / "7").mkdir()  # a process gone between the listing and the read
    snap = thread_cpu.snapshot(str(tmp_path))
    assert snap == {(42, 43): thread_cpu.ThreadCpu(42, 43, "py (x) 3", "tier-posix-0", 360)}
    later = {(42, 43): thread_cpu.ThreadCpu(42, 43, "py (x) 3", "tier-posix-0", 360 + 2 * thread_cpu.TICKS_PER_S)}
    assert thread_cpu.busiest(snap, later) == [{"pid": 42, "tid": 43, "process": "py (x) 3",
                                                "thread": "tier-posix-0", "cpu_s": 2.0}]
