"""``make demo``: the main job.

Until the vLLM integration lands this replays the built-in workloads through the policy
simulator and prints, per workload, the policy x store_threshold table.
"""

from __future__ import annotations

from tiering.simulate import format_table, simulate
from tiering.workloads import BUILTIN


def main() -> None:
    for wl in BUILTIN.values():
        requests = list(wl.make(0))
        results = [simulate(iter(requests), p, wl.default_capacity, t)
                   for p in ("lru", "arc", "s3fifo") for t in (0, 2)]
        print(f"\n== {wl.name}: {wl.description}; tier of {wl.default_capacity} chunks")
        print(format_table(results))


if __name__ == "__main__":
    main()
