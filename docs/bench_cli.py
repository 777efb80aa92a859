"""How fast the read-only CLI commands answer on a cache of 100k entries.

    python docs/bench_cli.py [ENTRIES]

Builds a namespace with ENTRIES index records (4 KiB rows, sparse slabs), then times each
command as a user runs it (a new ``tiering`` process, Python start-up included) and in-process.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiering.backends.file_tier import FileTier
from tiering.backends.index import Index, pack_record
from tiering.backends.namespace import NamespaceFacts
from tiering.bench_common import bench_key
from tiering.cli import main as cli


def build(folder: Path, n: int) -> None:
    facts = NamespaceFacts("bench-cli", "bfloat16", "bench", 4096, 16)
    cfg = {"path": str(folder), "capacity": n * 4096, "io": "posix", "preallocate": False}
    FileTier(cfg, facts).close()
    idx = Index(folder / facts.namespace_id, map_size=(64 << 20) + n * 2048)
    now = time.time()
    for s in range(0, n, 50_000):
        idx.publish([(bench_key(i), pack_record(i, 4096, 0, 0, now, now - i, i % 5))
                     for i in range(s, min(n, s + 50_000))], [],
                    stat_delta={"writes": min(50_000, n - s)})
    idx.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    root = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        build(root, n)
        exe = str(Path(sys.executable).with_name("tiering"))
        print(f"{'command':<22} {'process (s)':>12} {'in-process (s)':>15}   ({n} entries)")
        for args in (["inspect", "--json"], ["stats", "--json"], ["export"]):
            proc, inproc = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                subprocess.run([exe, args[0], str(root), *args[1:]], check=True,
                               stdout=subprocess.DEVNULL)
                proc.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with open("/dev/null", "w") as devnull:
                    stdout, sys.stdout = sys.stdout, devnull
                    try:
                        cli([args[0], str(root), *args[1:]])
                    finally:
                        sys.stdout = stdout
                inproc.append(time.perf_counter() - t0)
            print(f"{' '.join(args):<22} {statistics.median(proc):>12.3f} "
                  f"{statistics.median(inproc):>15.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
