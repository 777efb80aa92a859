"""The measuring half of scripts/fast_disk_bench.sh (which sets up the RAM-backed ext4).

    python3 scripts/fast_disk_bench.py SCRATCH_DIR OUT_DIR --threads N [--rows 256KiB 2MiB]

For each row size: ``tiering.bench.bench`` (our tier through its own API and through vLLM's
SecondaryTierManager interface, vLLM's fs tier through that interface, fio with the same
threads and block size, and the ceiling of a Python tier: Python threads issuing the same
calls, without and with the per-row xxh3), medians of ``--repeat`` interleaved runs, every byte compared. Prints
one table (GB/s, % of fio, CPU seconds per GB next to fio's) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from tiering.backends.sizes import parse_size
from tiering.bench import PARTS, bench


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import lmdb
    import xxhash

    # xxhash < 4 holds the GIL in its one-shot hash (see backends/checksum.py): worth knowing
    return {"cpus": os.cpu_count(), "cpu": model, "kernel": platform.release(),
            "python": platform.python_version(), "xxhash": xxhash.VERSION,
            "lmdb": lmdb.__version__}


def table(results: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = [f"{'rows':>7} {'system':<10} {'write GB/s':>10} {'% fio':>6} {'read GB/s':>9} "
             f"{'% fio':>6} {'CPU s/GB w':>10} {'r':>5} {'bad':>4}"]
    for r in results:
        rows = f"{r['row_bytes'] >> 10}K" if r["row_bytes"] < 1 << 20 else \
            f"{r['row_bytes'] >> 20}M"
        fw, fr = r.get("fio_write_GBps"), r.get("fio_read_GBps")
        for p in PARTS:
            w, rd = r.get(f"{p}_write_GBps"), r.get(f"{p}_read_GBps")
            if w is None:
                continue
            pw = 100 * w / fw if fw else None
            pr = 100 * rd / fr if fr else None
            lines.append(f"{rows:>7} {p:<10} {f(w):>10} {f(pw, '{:.0f}'):>6} {f(rd):>9} "
                         f"{f(pr, '{:.0f}'):>6} {f(r.get(f'{p}_write_cpu_s_per_GB')):>10} "
                         f"{f(r.get(f'{p}_read_cpu_s_per_GB')):>5} "
                         f"{r.get(f'{p}_bad_rows', '-'):>4}")
        for a in ("tier", "vllm_tier"):
            for b in ("vllm_fs", "py_io_xxh3"):
                for d in ("write", "read"):
                    v = r.get(f"ratio_{a}_vs_{b}_{d}")
                    if v is not None:
                        lines.append(f"{rows:>7}   {a} / {b} {d}: {v:.2f}x")
        lines += [f"{rows:>7}   note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scratch")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--total", default="2GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", nargs="+", default=["256KiB", "2MiB"])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--job-rows", type=int, default=16)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"--parts: unknown {unknown}; expected {', '.join(PARTS)}", file=sys.stderr)
        return 2
    info = {**machine(), "threads": args.threads, "total": args.total, "repeat": args.repeat,
            "fio": os.environ.get("TIERING_FIO"), "filesystem": "ext4 on loop over tmpfs"}
    print(json.dumps(info), flush=True)
    results = []
    for rows in args.rows:
        rb = parse_size(rows, "--rows")
        r = bench(args.scratch, rb, parse_size(args.total, "--total"), args.threads,
                  args.repeat, None, "posix", 0, parts, args.job_rows)
        results.append(r)
        (out / f"fast_disk_{rows}.json").write_text(json.dumps({"machine": info, **r}, indent=2))
        print(table([r]), flush=True)
    (out / "fast_disk.json").write_text(json.dumps({"machine": info, "results": results},
                                                   indent=2))
    print("\n" + table(results))
    bad = sum(r.get(f"{p}_bad_rows", 0) for r in results for p in PARTS)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
