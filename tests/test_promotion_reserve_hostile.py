"""Hostile tests of the promotion reserve (CpuTier.promotion_reserve, TierChain's sizing of it):
random store/lookup/load/reset sequences with the chain checked after every operation, and the
edges (1-3 row tiers, no file tier, a share of 0, the idle release, a request's own prefix)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from tierutil import facts, key

import tiering.backends.staging as staging
from tiering.backends.file_tier import FileTier
from tiering.backends.staging import StagingRegion
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier

ROW = 4096


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def chain(tmp_path, rows, share=0.125, disk=True, threshold=0, name="h") -> TierChain:
    tiers = [FileTier({"path": str(tmp_path / f"d-{name}"), "capacity": 256 * ROW, "io": "posix",
                       "policy": "lru"}, facts(ROW))] if disk else []
    return TierChain(CpuTier(StagingRegion(name, rows, ROW), "lru", threshold), tiers,
                     promotion_reserve=share)


def content(k: bytes) -> bytes:
    return np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(ROW)


class Driver:
    """vLLM's side: one-key stores left WRITING until the next step's end, lookups, loads."""

    def __init__(self, c: TierChain, share: float) -> None:
        self.c, self.n = c, c.num_rows
        self.init = (min(max(1, int(self.n * share)), (self.n - 1) // 2)
                     if c.file_tiers and share > 0 else 0)
        self.cur: list[bytes] = []  # store jobs of this step
        self.prev: list[bytes] = []  # store jobs of the last step: they end at this step's end
        self.loading: list[list[bytes]] = []
        self.starved = False  # a disk-only key's promotion found no row since the last step end

    def store(self, keys: list[bytes]) -> list[bytes]:
        cpu = self.c.cpu
        res, unpinned = cpu.promotion_reserve, self.n - cpu.pinned_rows()
        wanted = [k for k in dict.fromkeys(keys) if k not in cpu.key_row]
        # rows a store may take: not pinned, not holding a key of the same call (protected)
        usable = unpinned - sum(not cpu.key_row[k].pins for k in set(keys) if k in cpu.key_row)
        out = self.c.prepare_store(keys)
        self.c.check()
        got = out[0] if out else []
        assert got == wanted[:len(got)], "admitted keys are not a prefix of the wanted ones"
        assert not (res and got) or self.n - cpu.pinned_rows() >= res, (res, cpu.pinned_rows())
        assert not (res and unpinned <= res and got), ("admitted into the reserve", unpinned)
        if not res and usable >= len(wanted):
            assert got == wanted, "refused with rows and no reserve"
        for k, r in zip(got, out[1] if out else [], strict=True):
            self.c.region.rows[r][:] = np.frombuffer(content(k), np.uint8)
        self.cur += got
        return got

    def request(self, keys: list[bytes]) -> None:
        c, seen, hits = self.c, set(), []
        for k in keys:
            disk_only = k not in c.cpu.key_row and c.file_tiers and c.file_tiers[0].contains(k)
            r = c.lookup(k, protect=seen)
            c.check()
            seen.add(k)
            self.starved |= bool(disk_only and r is Lookup.MISS)
            if r is not Lookup.HIT:
                break
            hits.append(k)
        if hits:
            for k, r in zip(hits, c.prepare_load(hits), strict=True):
                assert c.region.row(r).tobytes() == content(k), f"wrong bytes for {k.hex()}"
            self.loading.append(hits)

    def step_end(self, rng: random.Random) -> None:
        c = self.c
        for k in self.prev:  # a failed job: the row holds garbage and must never hit
            ok = rng.random() > 0.15
            if not ok and k in c.cpu.key_row:
                c.region.rows[c.cpu.row_of(k)][:] = 0xEE
            c.complete_store([k], success=ok)
            c.check()
        self.prev, self.cur = self.cur, []
        before = c.cpu.promotion_reserve
        c.on_schedule_end()
        after = c.cpu.promotion_reserve
        if self.starved and self.init:
            assert after == min((self.n - 1) // 2, max(self.init, 2 * before)), (before, after)
        else:
            assert after == before, (before, after)  # the idle release is off here
        assert 2 * after < self.n and (self.init or after == 0), (after, self.n)
        self.starved = False

    def end_jobs(self) -> None:
        for k in self.prev + self.cur:
            self.c.complete_store([k])
        for job in self.loading:
            self.c.complete_load(job)
        self.prev, self.cur, self.loading = [], [], []

    def settle(self, *keys: bytes) -> None:
        """Every job ends and is written down (``keys`` first stored one by one, so)."""
        for k in [*keys, None]:
            if k is not None:
                self.store([k])
            self.end_jobs()
            self.c.wait_idle()


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_keep_the_reserve_and_the_bytes(tmp_path, monkeypatch, seed):
    monkeypatch.setattr("tiering.promotion_reserve.PROMOTION_RESERVE_IDLE_S", 1e9)
    rng = random.Random(seed)
    rows = rng.choice([3, 4, 5, 8, 12, 16])  # (1-2 rows, a share of 0: tests below)
    share = rng.choice([0.125, 0.125, 0.25, 0.49])
    c = chain(tmp_path, rows, share, name=f"r{seed}")
    d = Driver(c, share)
    universe = [key(f"{seed}-{i}") for i in range(3 * rows + 6)]
    for _ in range(400):
        op = rng.random()
        if op < 0.35:  # a step's stores: one chunk a call, as vLLM 0.33 prepares them
            for k in rng.sample(universe, rng.randint(1, rows)):
                d.store([k])
        elif op < 0.4:
            d.store(rng.sample(universe, rng.randint(2, 4)))
        elif op < 0.6:
            cold = [k for k in universe if k not in c.cpu.key_row and c.file_tiers[0].contains(k)]
            start = universe.index(rng.choice(cold or universe))
            d.request(universe[start:start + rng.randint(1, 5)])
        elif op < 0.8:
            d.step_end(rng)
        elif op < 0.88 and d.loading:
            c.complete_load(d.loading.pop(rng.randrange(len(d.loading))))
        elif op < 0.95:
            c.wait_idle()
        elif op < 0.98:  # vLLM's reset forgets its jobs
            c.reset()
            d.prev, d.cur, d.loading = [], [], []
        c.check()
    assert c.cpu.stats["rejections:reserved"] > 0  # the reserve was in play
    d.settle()
    c.check()
    assert c.cpu.pinned_rows() == 0 and not c.has_pending_work()
    # never refused forever: with nothing pinned, stores get every row but the reserve
    res = c.cpu.promotion_reserve
    fresh = [key(f"fresh-{seed}-{i}") for i in range(rows)]
    assert sum(len(d.store([k])) for k in fresh) == rows - res
    c.close()


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_tiny_tiers_reserve_at_most_under_half_and_stores_go_on(tmp_path, rows):
    c = chain(tmp_path, rows, share=0.49, name=f"t{rows}")
    d = Driver(c, 0.49)
    old = [key(f"old{rows}-{i}") for i in range(4)]
    d.settle(*old)
    for step in range(8):
        d.settle()
        got = [k for j in range(rows) for k in d.store([key(f"s{rows}-{step}-{j}")])]
        assert len(got) == rows - c.cpu.promotion_reserve >= 1, (step, got)
        d.request([old[step % 4]])
        d.step_end(random.Random(step))
        assert c.cpu.promotion_reserve == (0 if rows < 3 else 1)
    d.settle()
    assert c.cpu.pinned_rows() == 0 and not c.has_pending_work()
    c.close()


@pytest.mark.parametrize(("disk", "share"), [(False, 0.125), (False, 0.49), (True, 0.0)])
def test_no_reserve_without_a_file_tier_or_with_a_share_of_zero(tmp_path, disk, share):
    c = chain(tmp_path, 6, share=share, disk=disk, name="z")
    d = Driver(c, share)
    universe = [key(f"z{i}") for i in range(66)]
    d.settle(*universe[:6])  # the chunks the requests ask for (on disk, if there is one)
    for step in range(10):
        d.settle()
        got = [k for k in universe[6 + 6 * step:12 + 6 * step] for k in d.store([k])]
        assert len(got) == 6, (step, len(got))  # every row: none kept for promotions
        d.request(universe[:6])  # its disk chunks find every row pinned
        d.step_end(random.Random(step))
        assert c.cpu.promotion_reserve == 0
    assert c.cpu.stats["rejections:reserved"] == 0
    c.close()


def _starve(c: TierChain, d: Driver, old: list[bytes], tag: str) -> None:
    """Every row WRITING, then a disk-only key's promotion: a miss, and the step ends."""
    for j in range(c.num_rows):
        d.store([key(f"{tag}-{j}")])
    d.request([old[0]])
    d.step_end(random.Random(0))


@pytest.mark.parametrize(("rows", "share"), [(8, 0.9), (9, 1.0), (4, 0.6)])
def test_a_share_over_half_is_capped_under_half(tmp_path, rows, share):
    c = chain(tmp_path, rows, share=share, name=f"cap{rows}")
    d = Driver(c, share)
    old = [key(f"cap{i}") for i in range(rows)]
    d.settle(*old)
    _starve(c, d, old, "s")
    assert c.cpu.promotion_reserve == (rows - 1) // 2
    c.close()


def test_the_idle_release_then_a_new_starvation_starts_again_from_the_share(tmp_path,
                                                                            monkeypatch):
    c = chain(tmp_path, 16, name="idle")
    d = Driver(c, 0.125)
    old = [key(f"o{i}") for i in range(16)]
    d.settle(*old)
    _starve(c, d, old, "a")
    d.end_jobs()
    _starve(c, d, old[1:], "b")  # the 2 rows b's stores left give this promotion one
    assert c.cpu.promotion_reserve == 2 and c.cpu.stats["rejections:reserved"] > 0
    monkeypatch.setattr("tiering.promotion_reserve.PROMOTION_RESERVE_IDLE_S", 0.2)
    d.settle()
    d.request([old[5]])  # a promotion asked: the reserve stays through this step
    c.on_schedule_end()
    assert c.cpu.promotion_reserve == 2
    time.sleep(0.25)
    c.on_schedule_end()
    assert c.cpu.promotion_reserve == 0
    d.settle()
    assert sum(len(d.store([key(f"all-{j}")])) for j in range(16)) == 16
    _starve(c, d, old[6:], "c")  # all 16 pinned again: back to the initial share, not doubled
    assert c.cpu.promotion_reserve == 2
    c.close()


def test_a_promotion_blocked_by_its_own_request_prefix_does_not_reserve_rows(tmp_path):
    """Nothing is pinned: the promotion finds no row only because every row holds a chunk of
    the same request's prefix (protected). Rows left unpinned by stores cannot give it one, so
    it must not start a reserve that refuses stores for PROMOTION_RESERVE_IDLE_S."""
    c = chain(tmp_path, 8, name="prefix")
    d = Driver(c, 0.125)
    ks = [key(f"p{i}") for i in range(9)]
    d.settle(*ks[8:], *ks[:8])  # all on disk; the CPU tier holds ks[0:8]
    assert c.cpu.pinned_rows() == 0 and all(k in c.cpu.key_row for k in ks[:8])
    assert c.lookup(ks[8], protect=set(ks[:8])) == Lookup.MISS  # no row it may take
    c.on_schedule_end()
    assert c.cpu.promotion_reserve == 0, "a reserve started with no row pinned"
    assert sum(len(d.store([key(f"n{j}")])) for j in range(8)) == 8
    c.close()


def test_a_key_refused_for_the_reserve_keeps_its_store_threshold_offers(tmp_path):
    """store_threshold 2: the second offer admits a key; refused then only for the reserve,
    it must not have to prove its reuse again (its third offer, with rows, stores it)."""
    c = chain(tmp_path, 8, threshold=2, name="thr")
    c.cpu.keep_for_promotions(3)
    d = Driver(c, 0.125)
    for i in range(5):  # 5 rows WRITING: 8 - 5 = the reserve
        assert d.store([key(f"w{i}")]) == []
        assert len(d.store([key(f"w{i}")])) == 1
    x = key("x")
    assert d.store([x]) == []  # threshold
    assert c.prepare_store([x]) is None and c.cpu.stats["rejections:reserved"] == 1
    d.settle()
    assert d.store([x]) == [x], "offered 3 times with a threshold of 2 and rows free"
    c.close()
