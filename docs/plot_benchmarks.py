"""Draw the benchmark pictures in docs/ from the JSON results in docs/results/.

    pip install matplotlib && python docs/plot_benchmarks.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RES = HERE / "results"


def file_tier() -> None:
    sizes = ["256KiB", "2MiB", "8MiB"]
    runs = [json.loads((RES / f"bench_{s}.json").read_text()) for s in sizes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, d in zip(axes, ("write", "read"), strict=True):
        width = 0.26
        for i, (sysname, label) in enumerate((("tier", "vllm-tiering FileTier"),
                                              ("fio", "fio (raw, O_DIRECT)"),
                                              ("vllm_fs", "vLLM fs tier"))):
            vals = [r[f"{sysname}_{d}_GBps"] or 0 for r in runs]
            xs = [j + (i - 1) * width for j in range(len(sizes))]
            ax.bar(xs, vals, width, label=label)
        ax.set_xticks(range(len(sizes)), [f"{s} rows" for s in sizes])
        ax.set_title(f"{d}, 4 GiB, 8 threads (median of 3)")
        ax.set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "file_tier_bench.png", dpi=110)


def dma() -> None:
    """Every copy path of ``scripts/gpu_check.py`` against one large copy_ of the same bytes."""
    r = json.loads((RES / "gpu_check_h200_paths.json").read_text())
    rows = r["dma"]
    labels = [f"{d['layout']}\n{d['copy']}" + (f" {d['api'].split('/')[-1]}"
                                                if d["copy"] == "staged" else "") for d in rows]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.13
    series = [("store_GBps", "store"), ("copy_d2h_GBps", "one copy_ D2H"),
              ("load_GBps", "load"), ("copy_h2d_GBps", "one copy_ H2D"),
              ("both_GBps", "both at once"), ("copy_both_GBps", "two copy_ at once")]
    for i, (key, label) in enumerate(series):
        ax.bar([j + (i - 2.5) * width for j in range(len(rows))], [d[key] for d in rows], width,
               label=label)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("H200: 1 GiB of 512 random blocks per job, Llama-3.1-8B shape, each copy path")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(HERE / "dma_h200.png", dpi=110)


if __name__ == "__main__":
    file_tier()
    dma()
