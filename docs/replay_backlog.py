"""The disk-backed prefill workload replayed on the H200's recorded costs (tests/data), with the
advisor seeing only the step being scheduled (before 6396b69) and with the requests waiting
behind each decision (after): prompt tokens/s and the runs loaded. A discrete-event replay of
the advisor's own decisions (tests/test_advisor_replay.py, ``serve``), not a GPU measurement.

    .venv/bin/python docs/replay_backlog.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_advisor_replay import serve  # noqa: E402


def main() -> None:
    print("| disk GB/s | step cost, load overhead | hit rate | none | step only (loaded) "
          "| with the waiting requests (loaded) |")
    print("|---|---|---|---|---|---|")
    for rate in (1.5e9, 5.0e9):
        for c, overhead in ((0.01, 0.0), (0.02, 0.15)):
            for hit in (0.5, 1.0):
                none, _ = serve("none", hit, rate=rate, c=c)
                blind, r1 = serve("advisor", hit, rate=rate, c=c, overhead_s=overhead)
                seeing, r2 = serve("advisor", hit, rate=rate, c=c, overhead_s=overhead,
                                   announce=True)
                loads = [sum(v for k, v in r.items() if k.startswith("load")) for r in (r1, r2)]
                print(f"| {rate / 1e9:.1f} | {c * 1e3:.0f} ms, {overhead * 1e3:.0f} ms | "
                      f"{hit:.0%} | {none / 1e3:.1f}k | {blind / 1e3:.1f}k "
                      f"({blind / none:.2f}x, {loads[0]}) | {seeing / 1e3:.1f}k "
                      f"({seeing / none:.2f}x, {loads[1]}) |")


if __name__ == "__main__":
    main()
