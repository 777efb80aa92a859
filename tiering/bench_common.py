"""What the two disk-benchmark drivers of ``tiering bench`` share (``tiering/bench.py`` and
``tiering/vllm/bench_tiers.py``): the benchmark's keys, the process's CPU seconds, and making
the next reads cold."""

from __future__ import annotations

import hashlib
import os
import resource
from pathlib import Path


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_key(i: int) -> bytes:
    """The benchmark's key of row ``i``: distinct and the same in every run."""
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0"


def drop_caches(folder: Path | None = None) -> str:
    """Make the next reads cold: 'drop_caches', else 'fadvise' (files under ``folder``)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for dirpath, _, files in os.walk(folder or "."):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"
