"""The master's view of our namespaces, for ``tiering inspect|stats mooncake://HOST:PORT``.

Read-only, through the master's HTTP admin service (``mooncake_master --metrics_port``, 9003 by
default): ``/get_all_keys`` lists every object name, ``/batch_query_keys`` gives their sizes and
replicas, ``/metrics`` the master's totals (capacity, allocated bytes, keys, clients, evictions).
Our objects are the names under ``vt<FORMAT_VERSION>/<namespace>/`` (``mooncake_value.py``);
other names (other applications sharing the master, other format versions) are only counted.
No Mooncake client is set up, no segment mounted: the tool changes nothing in the cluster.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from typing import Any

from tiering.backends.mooncake_value import HEADER_BYTES, KEY_PREFIX, META_NAME

QUERY_BATCH = 256  # names per /batch_query_keys call (a URL of about 20 KB)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)$")
# the master's own gauges and counters shown beside our namespaces
MASTER_METRICS = ("master_total_capacity_bytes", "master_allocated_bytes", "master_key_count",
                  "master_active_clients", "master_put_start_alloc_failures_total",
                  "master_get_replica_list_requests_total", "master_batch_exist_key_requests_total")


def parse_address(url: str) -> str:
    """``mooncake://HOST:PORT`` (or ``http://HOST:PORT``) -> ``HOST:PORT``; ValueError else."""
    m = re.match(r"^(mooncake|https?)://([A-Za-z0-9_.\-]+:\d{1,5})/?$", url)
    if not m:
        raise ValueError(f"{url!r}: expected mooncake://HOST:PORT, the master's HTTP admin "
                         "address (mooncake_master --metrics_port, 9003 by default)")
    return m.group(2)


def _get(admin: str, path: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(f"http://{admin}{path}", timeout=timeout) as r:
            return bytes(r.read())
    except OSError as exc:
        raise OSError(f"mooncake master admin {admin}: {path.split('?')[0]} failed ({exc})") \
            from None


def master_metrics(admin: str, timeout: float = 10.0) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in _get(admin, "/metrics", timeout).decode(errors="replace").splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not m.group(2) and m.group(1) in MASTER_METRICS:
            out[m.group(1)] = float(m.group(3))
    return out


def _sizes(admin: str, names: list[str], timeout: float) -> dict[str, tuple[int, int]]:
    """name -> (bytes of one replica, replicas), for the names the master still has."""
    out: dict[str, tuple[int, int]] = {}
    for i in range(0, len(names), QUERY_BATCH):
        part = names[i:i + QUERY_BATCH]
        query = urllib.parse.quote(",".join(part), safe="/,")
        body = json.loads(_get(admin, f"/batch_query_keys?keys={query}", timeout))
        for name, entry in (body.get("data") or {}).items():
            if not isinstance(entry, dict):
                continue
            values = entry.get("values") or []
            if entry.get("ok") and values:
                out[name] = (int(values[0].get("size_", 0)), len(values))
    return out


def master_view(admin: str, timeout: float = 10.0) -> dict[str, Any]:
    """Every namespace of ours the master holds: chunks, bytes (values and KV rows), replicas;
    plus the master's totals and how many names are not ours."""
    names = [n for n in _get(admin, "/get_all_keys", timeout).decode(errors="replace")
             .splitlines() if n]
    prefix = KEY_PREFIX + "/"
    by_ns: dict[str, list[str]] = {}
    meta: set[str] = set()
    other = 0
    for n in names:
        parts = n.split("/")
        if not n.startswith(prefix) or len(parts) != 3:
            other += 1
        elif parts[2] == META_NAME:
            meta.add(parts[1])
        else:
            by_ns.setdefault(parts[1], []).append(n)
    sizes = _sizes(admin, [n for ns in by_ns.values() for n in ns], timeout)
    namespaces = []
    for ns in sorted(set(by_ns) | meta):
        found = [sizes[n] for n in by_ns.get(ns, []) if n in sizes]
        value_bytes = sum(s for s, _ in found)
        namespaces.append({"namespace": ns, "chunks": len(found), "value_bytes": value_bytes,
                           "kv_bytes": value_bytes - HEADER_BYTES * len(found),
                           "replicas": sum(r for _, r in found),
                           "facts_published": ns in meta})
    return {"master_admin": admin, "keys": len(names), "other_keys": other,
            "namespaces": namespaces, "master": master_metrics(admin, timeout)}


def format_view(view: dict[str, Any]) -> list[str]:
    """``tiering inspect mooncake://...`` as text lines."""
    from tiering.backends.sizes import format_size

    m = view["master"]
    lines = [f"mooncake master {view['master_admin']}: "
             f"{format_size(m.get('master_allocated_bytes', 0))} of "
             f"{format_size(m.get('master_total_capacity_bytes', 0))} allocated, "
             f"{int(m.get('master_key_count', view['keys']))} keys "
             f"({view['other_keys']} not vllm-tiering's), "
             f"{int(m.get('master_active_clients', 0))} clients"]
    for ns in view["namespaces"]:
        lines.append(f"namespace {ns['namespace']}: {ns['chunks']} chunks, "
                     f"{format_size(ns['kv_bytes'])} of KV ({format_size(ns['value_bytes'])} "
                     f"stored, {ns['replicas']} replicas)"
                     + ("" if ns["facts_published"] else "  [no facts object]"))
    return lines
