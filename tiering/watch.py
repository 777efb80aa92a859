"""``tiering watch URL``: a live terminal view of per-tier hit rates from vLLM's /metrics."""

from __future__ import annotations

import time
import urllib.request
from typing import TextIO

from tiering.serving import metric, parse_metrics


def _snapshot(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return parse_metrics(r.read().decode())


def table(prev: dict, cur: dict, dt: float) -> list[str]:
    tiers = sorted({dict(ls).get("tier") for (n, ls) in cur if n.startswith("vllm:kv_tier_")}
                   - {None}, key=lambda t: (t != "cpu", t))
    lines = [f"{'tier':<6} {'hit% (all)':>10} {'hit% (now)':>10} {'usage':>7} {'entries':>8} "
             f"{'in MB/s':>8} {'out MB/s':>8} {'rejected':>8} {'errors':>6}"]
    for t in tiers:
        def m(name, snap=cur, t=t, **lab):
            return metric(snap, f"vllm:kv_tier_{name}", tier=t, **lab)
        lk, ht = m("lookups_total"), m("hits_total")
        dl = lk - m("lookups_total", prev)
        dh = ht - m("hits_total", prev)
        din = (m("store_bytes_total") - m("store_bytes_total", prev)) / dt / 1e6
        dout = (m("hit_bytes_total") - m("hit_bytes_total", prev)) / dt / 1e6
        lines.append(
            f"{t:<6} {100 * ht / lk if lk else 0:>9.1f}% {100 * dh / dl if dl else 0:>9.1f}% "
            f"{100 * m('usage_perc'):>6.1f}% {int(m('entries')):>8} {din:>8.1f} {dout:>8.1f} "
            f"{int(m('rejections_total')):>8} "
            f"{int(m('io_errors_total') + m('checksum_failures_total')):>6}")
    host = metric(cur, "vllm:prompt_tokens_cached_by_source_total", source="host")
    disk = metric(cur, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    lines.append(f"prompt tokens cached: cpu {int(host)}, disk {int(disk)}")
    return lines


def watch(url: str, interval: float, count: int, out: TextIO) -> int:
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    prev, t_prev = _snapshot(url), time.monotonic()
    n = 0
    while count <= 0 or n < count:
        time.sleep(interval)
        cur, now = _snapshot(url), time.monotonic()
        if out.isatty():
            out.write("\x1b[2J\x1b[H")  # clear the screen, cursor home
        out.write(f"{url}  every {interval:g}s\n" + "\n".join(table(prev, cur, now - t_prev))
                  + "\n")
        out.flush()
        prev, t_prev = cur, now
        n += 1
    return 0
