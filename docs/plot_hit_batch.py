"""Requests computed against time through a prefill-sweep batch, from gpu-bench's step tables:
how the one-token steps of a hit batch end it, eager against CUDA graphs (issue 15).

    python docs/plot_hit_batch.py OUT.png LABEL=STEPS.txt ... [--rate 100]

``STEPS.txt`` is a step table that ``gpu-bench --sweep-trace`` writes
(``prefill_sweep_TAG_SHAPE_SETUP.txt``): one section per batch, headed ``== SHAPE SETUP hit
RATE% seen: ...``, one row per step with the step's start (``ms``) and the requests it computed
(``reqs``). Every batch at ``--rate`` is drawn, one colour per label; the dots are the steps.
Needs matplotlib."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HEAD = re.compile(r"^== \S+ \S+ hit\s+(\d+)% seen: (\d+) tok/s")


def batches(path: Path, rate: int) -> list[tuple[int, list[tuple[float, int]]]]:
    """Each batch at ``rate`` in the table: (tokens/s, [(step start ms, requests computed by the
    end of that step)])."""
    out: list[tuple[int, list[tuple[float, int]]]] = []
    steps: list[tuple[float, int]] | None = None
    done = 0
    for line in path.read_text().splitlines():
        m = HEAD.match(line)
        if m:
            steps = [] if int(m.group(1)) == rate else None
            done = 0
            if steps is not None:
                out.append((int(m.group(2)), steps))
            continue
        if line.startswith("== "):
            steps = None
            continue
        cols = line.split()
        if steps is None or len(cols) < 5:
            continue
        try:
            ms, reqs = float(cols[0]), int(cols[4])
        except ValueError:
            continue  # the header row
        done += reqs
        steps.append((ms, done))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("tables", nargs="+", help="LABEL=STEPS.txt")
    ap.add_argument("--rate", type=int, default=100)
    a = ap.parse_args()
    # every table read and checked before matplotlib is imported: bad input fails first
    drawn: list[tuple[str, list[tuple[int, list[tuple[float, int]]]]]] = []
    for spec in a.tables:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{spec!r}: expected LABEL=STEPS.txt")
        found = batches(Path(path), a.rate)
        if not found:
            raise SystemExit(f"{path}: no batch at {a.rate}% in this step table")
        drawn.append((label, found))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, found) in enumerate(drawn):
        for j, (tps, steps) in enumerate(found):
            xs = [ms for ms, _ in steps]
            ys = [n for _, n in steps]
            ax.plot(xs, ys, "-o", ms=3, color=f"C{i}", alpha=0.8,
                    label=f"{label}: {tps:,} tok/s" if j == 0 else f"{tps:,} tok/s")
    ax.set_xlabel("ms from the batch's first step")
    ax.set_ylabel("requests computed (cumulative)")
    ax.set_title(f"{a.rate}% hit batches, step by step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
