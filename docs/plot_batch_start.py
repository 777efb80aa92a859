"""Tokens scheduled against time from a batch's first step, one line per traced setup: where a
prefill-sweep batch loses its time (issue 15, the 0% batch). Reads step traces written by
``gpu-bench --sweep-trace`` (``tiering/step_trace.py``); needs matplotlib.

    python docs/plot_batch_start.py OUT.png LABEL=TRACE.jsonl[.gz] ... [--rate 0] [--tokens 16384]

A batch starts at the first ``schedule`` row with tokens after one with none scheduled and none
waiting, and is counted when its steps schedule at least eight full steps (``--tokens``); each
setup's median batch by length is drawn (the first batch of a setup is the engine's first
under load and is left out when there are more)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from tiering.step_trace import load  # noqa: E402


def rows(path: str) -> list[dict[str, Any]]:
    return [r for r in load([path]) if r["k"] == "schedule"]


def batches(sched: list[dict[str, Any]], full_tokens: int) -> list[list[tuple[float, int]]]:
    """Each batch as (ms from its first step, tokens scheduled by then); a batch's curve ends
    at its last step with tokens."""
    out: list[list[tuple[float, int]]] = []
    cur: list[dict[str, Any]] = []
    idle = True  # the engine had nothing scheduled and nothing waiting
    for r in sched:
        if r["tokens"] and idle and cur:
            out.append(_curve(cur))
            cur = []
        if r["tokens"] or cur:
            cur.append(r)
        idle = not r["tokens"] and not r["waiting"]
    if cur:
        out.append(_curve(cur))
    return [b for b in out if b and max(t for _, t in b) >= full_tokens * 8]


def _curve(steps: list[dict[str, Any]]) -> list[tuple[float, int]]:
    while steps and not steps[-1]["tokens"]:
        steps = steps[:-1]
    t0, total, pts = steps[0]["t0"], 0, []
    for r in steps:
        total += r["tokens"]
        pts.append(((r["t0"] - t0) * 1e3, total))
    return pts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("traces", nargs="+", help="LABEL=PATH")
    ap.add_argument("--tokens", type=int, default=16384, help="a full step's tokens")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, spec in enumerate(a.traces):
        label, _, path = spec.partition("=")
        bs = batches(rows(path), a.tokens)
        if len(bs) > 1:
            bs = bs[1:]
        mid = sorted(bs, key=lambda b: b[-1][0])[len(bs) // 2]
        lengths = [b[-1][0] for b in bs]
        ax.step([x for x, _ in mid], [y / 1e3 for _, y in mid], where="post",
                linestyle=("-", "--", "-.", ":")[i % 4], linewidth=1.6,
                label=f"{label} (last step at {statistics.median(lengths):.0f} ms, "
                      f"median of {len(bs)})")
    ax.set_xlabel("ms from the batch's first step")
    ax.set_ylabel("prompt tokens scheduled (thousands)")
    ax.set_title(a.title or "Where a batch's time goes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {Path(a.out)}")


if __name__ == "__main__":
    main()
