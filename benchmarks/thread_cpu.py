"""CPU seconds per thread of every process on the machine, over a span of time (Linux ``/proc``).

What gpu-bench's ``--thread-cpu-phases`` records around a phase's request: which threads ran
while it was served (the engine core's scheduler, our tiers' I/O threads, the kernel's loop
device workers of a RAM disk, another process). Our threads name themselves at the OS level
(``tiering.thread_names``); vLLM's threads are ``python3`` or ``VLLM::...``. Reading every
``/proc/PID/task/TID/stat`` of a machine takes tens of milliseconds: it is done before and
after the request, never during it.

    before = snapshot(); ...; rows = busiest(before, snapshot(), top=15)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ThreadCpu:
    pid: int
    tid: int
    process: str  # the process's comm (its main thread's name)
    thread: str  # the thread's comm
    ticks: int  # user + system, in clock ticks
    # when the thread started (field 22 of stat, clock ticks after boot; 0: not known): tells a
    # thread from a later one given the same id
    started: int = field(default=0, compare=False)


def _stat(path: str) -> tuple[str, int, int] | None:
    """(comm, utime + stime, starttime) of one ``stat`` file, or None if it vanished or is
    unreadable."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # comm is in parentheses and may hold spaces and parentheses: split at the last ')'
    left, right = raw.find(b"("), raw.rfind(b")")
    if left < 0 or right < left:
        return None
    fields = raw[right + 2:].split()
    try:  # fields 14, 15 and 22 of stat(5), here 11, 12 and 19 after the state field
        started = int(fields[19]) if len(fields) > 19 else 0
        return (raw[left + 1:right].decode("utf-8", "replace"), int(fields[11]) + int(fields[12]),
                started)
    except (IndexError, ValueError):
        return None


def snapshot(proc: str = "/proc") -> dict[tuple[int, int], ThreadCpu]:
    """Every thread's CPU ticks now, by (pid, tid)."""
    out: dict[tuple[int, int], ThreadCpu] = {}
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isascii() and p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        main = _stat(f"{proc}/{pid}/stat")
        if main is None:
            continue
        try:
            tids = [int(t) for t in os.listdir(f"{proc}/{pid}/task")
                    if t.isascii() and t.isdigit()]
        except OSError:
            continue
        for tid in tids:
            got = _stat(f"{proc}/{pid}/task/{tid}/stat")
            if got is not None:
                out[(pid, tid)] = ThreadCpu(pid, tid, main[0], got[0], got[1], got[2])
    return out


def busiest(before: dict[tuple[int, int], ThreadCpu], after: dict[tuple[int, int], ThreadCpu],
            top: int = 15) -> list[dict[str, object]]:
    """The ``top`` threads by CPU seconds between the two snapshots (a thread born meanwhile
    counts from zero, also where it was given the id of one that ended), busiest first, each
    with its process and thread names."""
    rows = []
    for key, now in after.items():
        was = before.get(key)
        # another thread given the same id (a start time of 0: not known, taken as the same)
        if was is not None and was.started and now.started and was.started != now.started:
            was = None
        ticks = now.ticks - (was.ticks if was is not None else 0)
        if ticks > 0:
            rows.append({"pid": now.pid, "tid": now.tid, "process": now.process,
                         "thread": now.thread, "cpu_s": ticks / TICKS_PER_S})
    rows.sort(key=lambda r: (-float(r["cpu_s"]), r["pid"], r["tid"]))  # type: ignore[arg-type]
    return rows[:top]
