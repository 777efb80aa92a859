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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tiering.policies import StoreThreshold, create
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

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(hit_ratio=self.hit_ratio, prefix_hit_ratio=self.prefix_hit_ratio,
                 ops_per_s=self.ops_per_s)
        return d


def simulate(requests: Iterable[Request], policy: str, capacity: int, threshold: int = 0,
             tracker_size: int = 64_000) -> SimResult:
    pol = create(policy, capacity)
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
