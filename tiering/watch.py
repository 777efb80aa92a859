"""``tiering watch URL``: a live terminal view of per-tier hit rates from vLLM's /metrics."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any, TextIO

from tiering.prometheus_text import Samples, metric, parse_metrics


def _snapshot(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as r:
        return parse_metrics(r.read().decode())


def rows(prev: Samples, cur: Samples, dt: float) -> dict[str, Any]:
    """Per-tier numbers between two scrapes ``dt`` seconds apart."""
    tiers = sorted({t for (n, ls) in cur if n.startswith("vllm:kv_tier_")
                    for k, t in ls if k == "tier"}, key=lambda t: (t != "cpu", t))
    out: dict[str, Any] = {"tiers": {}}
    for t in tiers:
        def m(name: str, snap: Samples = cur, t: str = t) -> float:
            return metric(snap, f"vllm:kv_tier_{name}", tier=t)
        lk, ht = m("lookups_total"), m("hits_total")
        dl, dh = lk - m("lookups_total", prev), ht - m("hits_total", prev)
        out["tiers"][t] = {
            "hit_ratio": ht / lk if lk else 0.0, "hit_ratio_now": dh / dl if dl else 0.0,
            "usage": m("usage_perc"), "entries": int(m("entries")),
            "in_MBps": (m("store_bytes_total") - m("store_bytes_total", prev)) / dt / 1e6,
            "out_MBps": (m("hit_bytes_total") - m("hit_bytes_total", prev)) / dt / 1e6,
            "rejections": int(m("rejections_total")),
            "errors": int(m("io_errors_total") + m("checksum_failures_total"))}
    name = "vllm:prompt_tokens_cached_by_source_total"
    out["prompt_tokens_cached"] = {"cpu": int(metric(cur, name, source="host")),
                                   "disk": int(metric(cur, name, source="disk"))}
    return out


def table(data: dict[str, Any]) -> list[str]:
    lines = [f"{'tier':<6} {'hit% (all)':>10} {'hit% (now)':>10} {'usage':>7} {'entries':>8} "
             f"{'in MB/s':>8} {'out MB/s':>8} {'rejected':>8} {'errors':>6}"]
    for t, r in data["tiers"].items():
        lines.append(f"{t:<6} {100 * r['hit_ratio']:>9.1f}% {100 * r['hit_ratio_now']:>9.1f}% "
                     f"{100 * r['usage']:>6.1f}% {r['entries']:>8} {r['in_MBps']:>8.1f} "
                     f"{r['out_MBps']:>8.1f} {r['rejections']:>8} {r['errors']:>6}")
    p = data["prompt_tokens_cached"]
    lines.append(f"prompt tokens cached: cpu {p['cpu']}, disk {p['disk']}")
    return lines


def watch(url: str, interval: float, count: int, out: TextIO, as_json: bool = False) -> int:
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    prev, t_prev = _snapshot(url), time.monotonic()
    n = 0
    while count <= 0 or n < count:
        time.sleep(interval)
        cur, now = _snapshot(url), time.monotonic()
        data = rows(prev, cur, now - t_prev)
        if as_json:  # one JSON object per refresh (JSON lines)
            out.write(json.dumps({"url": url, "time": time.time(), **data}) + "\n")
        else:
            if out.isatty():
                out.write("\x1b[2J\x1b[H")  # clear the screen, cursor home
            out.write(f"{url}  every {interval:g}s\n" + "\n".join(table(data)) + "\n")
        out.flush()
        prev, t_prev = cur, now
        n += 1
    return 0
