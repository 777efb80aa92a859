"""Random operation sequences against a real chain (CPU tier over a write-through and a
write-back file tier): after every step the row table is consistent, and every chunk vLLM
loads holds exactly the bytes that were stored for its key."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from tierutil import facts, key

import tiering.backends.staging as staging
from tiering.backends.file_tier import FileTier
from tiering.backends.staging import StagingRegion
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier

ROW = 4096
TRIALS = int(os.environ.get("TIERING_CHAIN_TRIALS", "12"))


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def content(k: bytes) -> np.ndarray:
    seed = int.from_bytes(k[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, ROW, dtype=np.uint8)


@pytest.mark.parametrize("seed", range(TRIALS))
def test_random_operations_keep_invariants_and_bytes(tmp_path, seed):
    rng = random.Random(seed)
    policy = rng.choice(["lru", "arc", "s3fifo"])
    tiers = [FileTier({"path": str(tmp_path / f"d{i}"), "capacity": rng.randint(4, 24) * ROW,
                       "io": "posix", "policy": rng.choice(["lru", "arc", "s3fifo"]),
                       "demote": mode, "store_threshold": rng.choice([0, 0, 1])},
                      facts(ROW, model=f"m{i}"))
             for i, mode in enumerate(("on_store", "on_evict"))]
    c = TierChain(CpuTier(StagingRegion(f"r{seed}", rng.randint(3, 10), ROW), policy), tiers,
                  events=True)
    universe = [key(f"{seed}-{i}") for i in range(30)]
    writing: list[list[bytes]] = []  # GPU store jobs in flight
    loading: list[list[bytes]] = []  # GPU load jobs in flight
    for _ in range(300):
        op = rng.random()
        if op < 0.3:  # a request's lookups, in prefix order, then a load of what hit
            start = rng.randrange(len(universe) - 4)
            req = universe[start:start + rng.randint(1, 6)]
            seen: set[bytes] = set()
            hits = []
            for k in req:
                r = c.lookup(k, protect=seen)
                seen.add(k)
                if r is Lookup.MISS:
                    break
                if r is Lookup.HIT:
                    hits.append(k)
                else:
                    break
            if hits:
                rows = c.prepare_load(hits)
                for k, r in zip(hits, rows, strict=True):
                    got = np.frombuffer(c.region.row(r), np.uint8)
                    assert np.array_equal(got, content(k)), f"wrong bytes for {k.hex()}"
                loading.append(hits)
        elif op < 0.55:  # a store job: reserve rows, the "GPU" writes them
            ks = rng.sample(universe, rng.randint(1, 4))
            out = c.prepare_store(ks)
            if out is not None and out[0]:
                for k, r in zip(out[0], out[1], strict=True):
                    np.frombuffer(c.region.row(r), np.uint8)[:] = content(k)
                writing.append(out[0])
        elif op < 0.7 and writing:  # a store job ends (rarely as a failure)
            c.complete_store(writing.pop(rng.randrange(len(writing))), rng.random() > 0.1)
        elif op < 0.8 and loading:
            c.complete_load(loading.pop(rng.randrange(len(loading))))
        elif op < 0.83:  # vLLM's reset forgets its jobs
            c.reset()
            writing.clear()
            loading.clear()
        elif op < 0.95:
            c.on_schedule_end()
        else:
            c.poll(wait=0.01)
        c.check()
        for t in tiers:
            assert len(t) <= t.n_slots
    for job in writing:
        c.complete_store(job)
    for job in loading:
        c.complete_load(job)
    c.wait_idle()
    c.check()
    assert c.usage()["pinned"] == 0
    # everything a file tier holds reads back byte-exact
    for t in tiers:
        for k in universe:
            if t.contains(k):
                out = bytearray(ROW)
                assert t.get([(k, memoryview(out), None)]) == [True]
                (done,) = t.wait_idle()
                assert done.ok and np.array_equal(np.frombuffer(out, np.uint8), content(k))
    c.close()
