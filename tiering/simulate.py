"""Trace-driven cache simulation: pick a policy and a store_threshold before deploying.

One simulated tier of ``capacity`` chunks behaves as our tiers do: each request looks its
chunks up in prefix order (hits are recorded as one batch, misses notify the policy), then the
missed chunks are offered to admission and the admitted ones are stored, evicting as needed
(never a key of the same request). Reported per policy x threshold:

* ``hit_ratio``        — chunk hits / chunk lookups;
* ``prefix_hit_ratio`` — chunks served before a request's first miss / chunk lookups (what vLLM
  can actually use: a prefix cache stops at the first missing chunk);
* ``admitted_writes``  — chunks written to the tier (SSD wear, write bandwidth);
* ``ops_per_s``        — policy operations (insert, access, evict, on_miss) per second of time
  spent inside the policy and admission calls, on one core.

``simulate_demotion`` replays the same requests through a CPU tier over a disk tier and compares
write-through (``demote: on_store``) with write-back (``on_evict``): hit ratio and disk writes per
served hit (SSD wear per unit of benefit).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from tiering.policies import EvictionPolicy, StoreThreshold, create
from tiering.workloads import Request


@dataclass
class SimResult:
    policy: str
    threshold: int
    capacity: int
    requests: int
    lookups: int
    hits: int
    prefix_hits: int
    admitted_writes: int
    rejected: int
    evictions: int
    policy_ops: int
    policy_seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits / self.lookups if self.lookups else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.policy_ops / self.policy_seconds if self.policy_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_ratio=self.hit_ratio, prefix_hit_ratio=self.prefix_hit_ratio,
                 ops_per_s=self.ops_per_s)
        return d


def simulate(requests: Iterable[Request], policy: str, capacity: int, threshold: int = 0,
             tracker_size: int = 64_000) -> SimResult:
    pol: EvictionPolicy[str] = create(policy, capacity)
    adm = StoreThreshold(threshold, tracker_size)
    clock = time.perf_counter
    n_req = lookups = hits = prefix_hits = writes = evictions = ops = 0
    spent = 0.0
    for _rid, keys in requests:
        n_req += 1
        lookups += len(keys)
        t0 = clock()
        hit_keys, missed = [], []
        in_prefix = True
        for k in keys:
            if k in pol:
                hit_keys.append(k)
                if in_prefix:
                    prefix_hits += 1
            else:
                in_prefix = False
                pol.on_miss(k)
                missed.append(k)
        pol.access_many(hit_keys)
        admitted = [k for k in dict.fromkeys(missed) if adm.offer(k)]
        if admitted:
            admitted = admitted[:capacity]
            need = len(pol) + len(admitted) - capacity
            if need > 0:
                victims = pol.evict(need, protected=keys)
                if victims is None:  # this request's own keys fill the tier: store fewer
                    free = capacity - len(pol)
                    admitted = admitted[:max(0, free)]
                else:
                    evictions += len(victims)
                    ops += 1
            pol.insert_many(admitted)
            writes += len(admitted)
        spent += clock() - t0
        hits += len(hit_keys)
        ops += len(keys) + len(missed) + len(admitted)
    return SimResult(policy, threshold, capacity, n_req, lookups, hits, prefix_hits, writes,
                     adm.rejected, evictions, ops, spent)


def format_table(results: list[SimResult]) -> str:
    head = (f"{'policy':<8} {'thr':>3} {'hit%':>6} {'prefix%':>7} {'writes':>9} "
            f"{'evictions':>9} {'Mops/s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.policy:<8} {r.threshold:>3} {100 * r.hit_ratio:>6.2f} "
                     f"{100 * r.prefix_hit_ratio:>7.2f} {r.admitted_writes:>9} "
                     f"{r.evictions:>9} {r.ops_per_s / 1e6:>7.2f}")
    return "\n".join(lines)


@dataclass
class DemotionResult:
    """Two tiers (CPU over disk) under one demotion mode, per workload."""

    demote: str  # "on_store" (write-through) or "on_evict" (write-back)
    policy: str
    threshold: int
    cpu_capacity: int
    disk_capacity: int
    lookups: int
    cpu_hits: int
    disk_hits: int
    disk_writes: int

    @property
    def served_hits(self) -> int:
        return self.cpu_hits + self.disk_hits

    @property
    def hit_ratio(self) -> float:
        return self.served_hits / self.lookups if self.lookups else 0.0

    @property
    def disk_writes_per_hit(self) -> float:
        """Chunks written to disk per chunk served from either tier (x chunk bytes = bytes)."""
        return self.disk_writes / self.served_hits if self.served_hits else float("inf")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_ratio=self.hit_ratio, disk_writes_per_hit=self.disk_writes_per_hit)
        return d


def simulate_demotion(requests: Iterable[Request], policy: str, cpu_capacity: int,
                      disk_capacity: int, threshold: int = 0, demote: str = "on_store",
                      tracker_size: int = 64_000) -> DemotionResult:
    """Replay requests through a CPU tier over a disk tier, as the chain routes them.

    Each request's chunks are looked up in prefix order until the first miss (CPU hit, or disk
    hit promoted into the CPU tier); the rest are computed and stored in the CPU tier. With
    ``on_store`` every chunk stored in the CPU tier is offered to the disk at once; with
    ``on_evict`` a chunk is offered only when the CPU tier evicts it and the disk lacks it.
    The disk's ``store_threshold`` admission sees each offer.
    """
    if demote not in ("on_store", "on_evict"):
        raise ValueError(f"demote: expected on_store or on_evict, got {demote!r}")
    cpu: EvictionPolicy[str] = create(policy, cpu_capacity)
    disk: EvictionPolicy[str] = create(policy, disk_capacity)
    adm = StoreThreshold(threshold, tracker_size)
    lookups = cpu_hits = disk_hits = writes = 0

    def offer_to_disk(keys: list[str], protected: Collection[str]) -> int:
        admitted = [k for k in keys if k not in disk and adm.offer(k)][:disk_capacity]
        need = len(disk) + len(admitted) - disk_capacity
        if need > 0 and disk.evict(need, protected=protected) is None:
            admitted = admitted[:max(0, disk_capacity - len(disk))]
        disk.insert_many(admitted)
        return len(admitted)

    def put_cpu(keys: list[str], protected: Collection[str]) -> int:
        """Insert into the CPU tier; returns the disk writes its evictions caused."""
        keys = keys[:cpu_capacity]
        need = len(cpu) + len(keys) - cpu_capacity
        written = 0
        if need > 0:
            victims = cpu.evict(need, protected=protected) or []
            if demote == "on_evict":
                written = offer_to_disk(victims, protected)
        cpu.insert_many(keys)
        return written

    for _rid, keys in requests:
        lookups += len(keys)
        cpu_hit, promoted, i = [], [], 0
        for i, k in enumerate(keys):  # noqa: B007 - i is used after the loop
            if k in cpu:
                cpu_hit.append(k)
            elif k in disk:
                promoted.append(k)
            else:
                cpu.on_miss(k)
                break
        else:
            i = len(keys)
        cpu_hits += len(cpu_hit)
        disk_hits += len(promoted)
        cpu.access_many(cpu_hit)
        disk.access_many(promoted)
        stored = [k for k in dict.fromkeys(keys[i:]) if k not in cpu]
        writes += put_cpu(promoted + stored, keys)
        if demote == "on_store":
            writes += offer_to_disk(stored, keys)
    return DemotionResult(demote, policy, threshold, cpu_capacity, disk_capacity, lookups,
                          cpu_hits, disk_hits, writes)


def format_demotion_table(results: list[DemotionResult]) -> str:
    head = (f"{'demote':<9} {'policy':<7} {'thr':>3} {'hit%':>6} {'cpu hits':>9} "
            f"{'disk hits':>9} {'disk writes':>11} {'writes/hit':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.demote:<9} {r.policy:<7} {r.threshold:>3} {100 * r.hit_ratio:>6.2f} "
                     f"{r.cpu_hits:>9} {r.disk_hits:>9} {r.disk_writes:>11} "
                     f"{r.disk_writes_per_hit:>10.3f}")
    return "\n".join(lines)
