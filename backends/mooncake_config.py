"""Mooncake-tier settings and their validation.

The tier config (``tiers[i]`` of the tiered spec, or a secondary tier of vLLM's own spec)::

    {"medium": "mooncake", "master": "10.0.0.5:50051", "metadata": "http://10.0.0.5:8080/metadata",
     "protocol": "tcp", "segment": "8GiB", "local_buffer": "64MiB", "store_threshold": 2,
     "verify": true}

Every check runs before a thread starts or a byte is allocated, and each failure is one
``ValueError`` naming the setting and what was expected. Nothing here talks to Mooncake: a master
that is down at engine start is not a configuration error (the tier starts, serves misses, and
connects when the master answers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from tiering.backends.sizes import parse_size

DEMOTE_MODES = ("on_store", "on_evict")
PROTOCOLS = ("tcp", "rdma")
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses to mount a smaller segment
_HOST_PORT = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
_URL = re.compile(r"^https?://[^/\s]+(/\S*)?$")


@dataclass
class MooncakeTierConfig:
    master: str  # HOST:PORT of the master's RPC service (mooncake_master --rpc_port)
    metadata: str  # the transfer engine's metadata server: http://HOST:PORT/metadata
    protocol: str = "tcp"
    # bytes of this process's memory lent to the cluster-wide pool (other engines' chunks land
    # here too); 0 lends nothing (a pure client that only reads and writes others' segments);
    # otherwise at least 16MiB
    segment: int | str = "1GiB"
    # the client's own transfer buffer, used only for values not in registered memory (the
    # staging rows are registered, so their transfers bypass it)
    local_buffer: int | str = "64MiB"
    store_threshold: int = 0
    tracker_size: int = 64_000
    verify: bool = True  # check each read value's xxh3 checksum (the header is always checked)
    demote: str = "on_store"
    # this client's address as the other clients reach it: "" takes this host's name with a
    # free port; give HOST or HOST:PORT on a multi-homed host
    local_hostname: str = ""
    rdma_devices: str = ""  # with protocol "rdma": the NICs, e.g. "mlx5_0,mlx5_1"
    # threads making Mooncake data calls (one more asks the master what exists); on the 2-core
    # build machine one or two read fastest (docs/scale-out.md), more help with cores to spare
    io_threads: int = 2
    timeout_s: float = 5.0  # bound of one Mooncake call (its RPC timeout; our watchdog)
    batch_rows: int = 16  # rows per Mooncake batch call (batches run on the I/O threads at once)
    # the master's HTTP admin service (mooncake_master --metrics_port): only tools use it
    # (`tiering inspect|stats mooncake://HOST:PORT`); "" = the master's host, port 9003
    admin: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "mooncake tier") -> MooncakeTierConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known keys: {', '.join(sorted(known))}")
        for required in ("master", "metadata"):
            if required not in d:
                raise ValueError(f"{where}: {required!r} is required (e.g. \"master\": "
                                 "\"10.0.0.5:50051\", \"metadata\": "
                                 "\"http://10.0.0.5:8080/metadata\")")
        cfg = cls(**d)
        try:
            validate(cfg)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None
        return cfg

    @property
    def segment_bytes(self) -> int:
        return parse_size(self.segment, "segment")

    @property
    def local_buffer_bytes(self) -> int:
        return parse_size(self.local_buffer, "local_buffer")

    @property
    def admin_address(self) -> str:
        """HOST:PORT of the master's HTTP admin service."""
        if self.admin:
            return self.admin
        m = _HOST_PORT.match(self.master)
        return f"{m.group('host') if m else '127.0.0.1'}:9003"


_INT_RANGES = {"store_threshold": (0, 10**6), "tracker_size": (1, 10**9), "io_threads": (1, 64),
               "batch_rows": (1, 4096)}


def validate(cfg: MooncakeTierConfig) -> None:
    """Types, ranges and address formats; ``ValueError("<setting>: ...")`` on the first bad one."""
    for name in ("master", "admin"):
        v = getattr(cfg, name)
        if name == "admin" and v == "":
            continue
        if not isinstance(v, str) or not _HOST_PORT.match(v) \
                or not 0 < int(_HOST_PORT.match(v).group("port")) < 65536:  # type: ignore[union-attr]
            raise ValueError(f"{name}: expected HOST:PORT like 10.0.0.5:50051, got {v!r:.80}")
    if not isinstance(cfg.metadata, str) or not _URL.match(cfg.metadata):
        raise ValueError(f"metadata: expected the metadata server's URL like "
                         f"http://10.0.0.5:8080/metadata, got {cfg.metadata!r:.80}")
    if cfg.protocol not in PROTOCOLS:
        raise ValueError(f"protocol: expected one of {', '.join(PROTOCOLS)}, got "
                         f"{cfg.protocol!r:.40}")
    segment = parse_size(cfg.segment, "segment")
    local = parse_size(cfg.local_buffer, "local_buffer")
    if local < 1 << 20:
        raise ValueError(f"local_buffer: expected at least 1MiB (the client's transfer buffer), "
                         f"got {cfg.local_buffer!r:.40}")
    if segment and segment < MIN_SEGMENT_BYTES:
        raise ValueError(f"segment: expected 0 (lend nothing) or at least 16MiB (Mooncake's "
                         f"smallest segment), got {cfg.segment!r:.40}")
    for name, (low, high) in _INT_RANGES.items():
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"{name}: expected an integer from {low} to {high}, got {v!r:.40}")
    t = cfg.timeout_s
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0.1 <= t <= 600:
        raise ValueError(f"timeout_s: expected seconds from 0.1 to 600, got {t!r:.40}")
    if not isinstance(cfg.verify, bool):
        raise ValueError(f"verify: expected true or false, got {cfg.verify!r:.40}")
    if cfg.demote not in DEMOTE_MODES:
        raise ValueError(f"demote: expected one of {', '.join(DEMOTE_MODES)}, got "
                         f"{cfg.demote!r:.40}")
    for name in ("local_hostname", "rdma_devices"):
        v = getattr(cfg, name)
        if not isinstance(v, str) or any(c.isspace() for c in v):
            raise ValueError(f"{name}: expected a string without spaces, got {v!r:.80}")


def check_row(cfg: MooncakeTierConfig, row_bytes: int) -> None:
    """What needs the engine's row size: a row must fit the lent segment (when one is lent)."""
    from tiering.backends.mooncake_value import HEADER_BYTES

    segment = cfg.segment_bytes
    if segment and segment < row_bytes + HEADER_BYTES:
        raise ValueError(f"segment: {segment} bytes holds no value of this engine "
                         f"({row_bytes} bytes a row plus a {HEADER_BYTES}-byte header)")
