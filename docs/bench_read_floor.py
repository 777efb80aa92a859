"""Where a promotion read's time goes, without the tier: plain ``preadv`` of a file's rows into
distinct rows of memory, by threads, one factor added at a time.

On the H200 machine's RAM disk our promotions read 1.6-1.7 GB/s while plain ``preadv`` into
distinct rows read 3.6-4.5 (docs/benchmarks.md). What differs between the two, each a switch
here: the destination (a private anonymous mapping, or a shared mapping of a ``/dev/shm`` file
as the CPU tier's staging region is), the checksum of every row (xxh3, as the tier verifies),
a main thread running Python meanwhile (vLLM's scheduler thread scanning the waiting request's
chunks every step), and the interpreter's switch interval (how long a thread that wants the
GIL waits before the running one is asked to drop it: 5 ms by default).

    python docs/bench_read_floor.py FILE [--gib 2] [--threads 8] [--run-rows 2] [--json OUT]

FILE: at least ``--gib`` GiB, read with O_DIRECT (make it first, e.g. ``dd``). Prints one line
per combination: GB/s, median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def one_read(path: str, total: int, row: int, threads: int, run_rows: int, dest: str,
             checksum: bool, busy: bool, switch_s: float) -> float:
    from xxhash import xxh3_64

    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    shm = None
    if dest == "shm":
        shm = tempfile.TemporaryFile(dir="/dev/shm")
        os.ftruncate(shm.fileno(), total)
        region = mmap.mmap(shm.fileno(), total, flags=mmap.MAP_SHARED | populate)
    else:
        region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    view = memoryview(region)
    runs = [(o, min(run_rows * row, total - o)) for o in range(0, total, run_rows * row)]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not runs:
                    return
                off, n = runs.pop(0)
            bufs = [view[o:o + row] for o in range(off, off + n, row)]
            os.preadv(fd, bufs, off)
            if checksum:
                for b in bufs:
                    xxh3_64(b).intdigest()

    try:
        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        spin = 0
        if busy:  # Python bytecode on the main thread, as a scheduler's scan runs
            while any(t.is_alive() for t in ts):
                for i in range(1000):
                    spin += i
        for t in ts:
            t.join()
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        sys.setswitchinterval(old)
        os.close(fd)
        view.release()
        region.close()
        if shm is not None:
            shm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--gib", type=float, default=2)
    ap.add_argument("--row-mib", type=float, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--run-rows", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--switch-ms", default="5,0.5")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    row = int(a.row_mib * 2**20) // 4096 * 4096
    total = int(a.gib * 2**30) // row * row
    if Path(a.file).stat().st_size < total:
        print(f"{a.file}: smaller than {total} bytes", file=sys.stderr)
        return 2
    one_read(a.file, total, row, a.threads, a.run_rows, "anon", False, False, 0.005)  # warm-up
    out: list[dict[str, Any]] = []
    switches = [float(x) / 1000 for x in a.switch_ms.split(",")]
    for dest, checksum, busy, sw in itertools.product(("anon", "shm"), (False, True),
                                                      (False, True), switches):
        rates = [one_read(a.file, total, row, a.threads, a.run_rows, dest, checksum, busy, sw)
                 for _ in range(a.repeat)]
        med = statistics.median(rates)
        out.append({"dest": dest, "checksum": checksum, "busy_main": busy, "switch_s": sw,
                    "GBps": med, "runs": rates})
        print(f"dest={dest:<4} checksum={int(checksum)} busy_main={int(busy)} "
              f"switch={sw * 1000:g} ms: {med:5.2f} GB/s  ({', '.join(f'{r:.2f}' for r in rates)})",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv[1:], "threads": a.threads,
                                            "run_rows": a.run_rows, "row_bytes": row,
                                            "bytes": total, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
