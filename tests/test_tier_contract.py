"""The tier contracts' promises: the store-tier contract suite run against the file tier,
asserted row transitions and pins that agree, one counter registry that every reader agrees
with, validation that knows what the tier owns, counts that ignore vLLM's re-asks.

Adding a store tier: subclass ``StoreTierContract`` (tests/store_tier_contract.py) as
``TestFileTierContract`` does below.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from store_tier_contract import StoreTierContract
from tierutil import facts, key, open_tier, row_for

import tiering.backends.staging as staging
from tiering.backends.file_config import FileTierConfig, validate
from tiering.backends.file_tier import FileTier
from tiering.backends.staging import StagingRegion
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier, IllegalTransition, Row, RowState
from tiering.stats import COUNTER_KEYS, TierStats
from tiering.tier import StoreTier

ROW = 8192


class TestFileTierContract(StoreTierContract):
    @pytest.fixture
    def make_tier(self, tmp_path):
        def make(model: str = "tiny") -> StoreTier:
            return open_tier(tmp_path, slots=self.CAPACITY, model=model)
        return make

    def corrupt(self, tier: StoreTier, k: bytes) -> None:
        assert isinstance(tier, FileTier)
        handle_file, offset = divmod(tier.entry(k).slot, tier.slabs.slots_per_file)
        fd = os.open(tier.folder / f"slab-{handle_file:04d}.dat", os.O_WRONLY)
        try:  # flip a byte in the middle of the row
            pos = offset * tier.slabs.slot_bytes + 1234
            os.pwrite(fd, bytes([bytes(row_for(k))[1234] ^ 0xFF]), pos)
            os.fsync(fd)
        finally:
            os.close(fd)


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def test_row_transitions_are_asserted():
    r = Row(0)
    r.move(RowState.WRITING)
    r.move(RowState.READY)
    with pytest.raises(IllegalTransition, match="row 0: READY -> WRITING"):
        r.move(RowState.WRITING)
    with pytest.raises(IllegalTransition, match="FREE -> READY"):
        Row(1).move(RowState.READY)
    with pytest.raises(IllegalTransition, match="FREE -> DETACHED"):
        Row(2).move(RowState.DETACHED)


def test_cpu_pins_have_one_source_and_check_compares_the_mirror():
    """``Row.pins`` is the source; the policy's pins only mirror them (so ``evict`` steps over
    pinned keys). ``check`` fails as soon as the two disagree."""
    cpu = CpuTier(StagingRegion("pins", 4, ROW), "lru")
    ks = [key(i) for i in range(3)]
    assert cpu.reserve_store(ks).admitted == ks  # pinned while the GPU writes them
    cpu.check()
    assert cpu.finish_store(ks) == ks
    cpu.prepare_load(ks[:1])
    cpu.pin(ks[1], io=True)
    cpu.check()
    assert cpu.policy.pin_counts() == {ks[0]: 1, ks[1]: 1}
    cpu.policy.unpin(ks[0])  # a pin released behind the row's back
    with pytest.raises(AssertionError, match="pins"):
        cpu.check()
    cpu.policy.pin(ks[0])
    cpu.complete_load(ks[:1])
    cpu.unpin_row(cpu.row_of(ks[1]), io=True)
    cpu.check()
    assert cpu.policy.pin_counts() == {}


def test_stats_registry_rejects_unknown_counters():
    s = TierStats()
    with pytest.raises(KeyError, match="unknown counter 'writes'"):
        s.add("writes")
    assert "rejections:full" in COUNTER_KEYS and "rejections:pinned" in COUNTER_KEYS


def test_validation_counts_the_namespace_own_slabs(mount_tmpfs):
    """A tier that takes most of its filesystem must pass validation again on restart."""
    mnt = mount_tmpfs("8m", "fs")
    cap = 5 << 20  # 62.5% of the filesystem: the second start must not count it as used
    cfg = {"path": str(mnt), "capacity": cap, "io": "posix", "policy": "lru"}
    with FileTier(dict(cfg), facts(ROW)) as t:
        t.put([key(1)], [row_for(key(1))])
        t.wait_idle()
        ns = t.folder.name
    # what the engine start checks (the spec calls this before opening anything)
    assert validate(FileTierConfig.from_dict(dict(cfg)), ROW, ns)["n_slots"] == cap // ROW
    with FileTier(dict(cfg), facts(ROW)) as t:  # the restart itself
        assert t.contains(key(1))
    # another namespace on the same drive does not get this one's space
    with pytest.raises(ValueError, match="capacity: .* bytes free"):
        validate(FileTierConfig.from_dict(dict(cfg)), ROW, "someone-else")


def make_chain(tmp_path, rows=4, policy="lru", disk_policy="lru") -> TierChain:
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": 16 * ROW, "io": "posix",
                     "policy": disk_policy}, facts(ROW))
    return TierChain(CpuTier(StagingRegion("e", rows, ROW), policy), [tier], events=True)


def fill(chain: TierChain, keys) -> None:
    stored, rows, _ = chain.prepare_store(keys)
    for k, r in zip(stored, rows, strict=True):
        np.frombuffer(chain.region.row(r), np.uint8)[:] = np.frombuffer(row_for(k), np.uint8)
    chain.complete_store(stored)


def test_reasks_of_a_missing_chunk_count_once_everywhere(tmp_path):
    """vLLM asks again each step; the persisted stats and ARC's adaptation see one miss."""
    c = make_chain(tmp_path, policy="arc", disk_policy="arc")
    disk = c.file_tiers[0]
    misses = []
    disk.policy.on_miss = misses.append  # observe the policy's miss hook
    k = key("absent")
    assert c.lookup(k, count=True) is Lookup.MISS
    for _ in range(4):
        assert c.lookup(k, count=False) is Lookup.MISS
    assert misses == [k]
    assert disk.stats["lookups"] == 1 and c.cpu.stats["lookups"] == 1
    disk.flush()
    assert disk.index.read_stats()["lookups"] == 1
    c.close()


@pytest.mark.parametrize("promote", ["always", "auto"])
def test_reasks_of_a_disk_hit_refused_for_want_of_a_cpu_row_count_once(tmp_path, promote):
    """A disk hit with every CPU row pinned is a miss; vLLM asks again next step (the request
    waits for GPU room too). Each re-ask counted again: 3 asks read as 3 disk hits and 3 CPU
    misses for one chunk."""
    from tiering.advisor import PromotionAdvisor
    from tiering.request_scan import RequestScan

    c = make_chain(tmp_path, rows=2)
    c.advisor = PromotionAdvisor(1, ROW, 16) if promote == "auto" else None  # unmeasured: load
    k = key(0)
    fill(c, [k])
    c.wait_idle()
    c.reset()
    pinned, _, _ = c.prepare_store([key("a"), key("b")])  # the GPU is writing both rows
    req = RequestScan(c, "r")
    for _ in range(3):
        assert req.lookup(k, first_token=0) is Lookup.MISS
        c.on_schedule_end()
    disk = c.file_tiers[0]
    assert (disk.stats["lookups"], disk.stats["hits"]) == (1, 1)
    assert (c.cpu.stats["lookups"], c.cpu.stats["hits"]) == (1, 0)
    c.complete_store(pinned)
    c.wait_idle()  # their writes down done: evictable
    if promote == "auto":
        # the advisor's LOAD found no row: the run is recomputed, and a later ask reads nothing
        # (tiering.request_scan: a read started now would end at a time no decision priced)
        assert req.lookup(k, first_token=0) is Lookup.MISS
        promoted = disk.stats["promotions"] - disk.stats["calibration_reads"]
        assert (disk.stats["lookups"], promoted) == (1, 0)
        assert disk.stats["disk_runs_recomputed:no_cpu_row"] == 1
        assert c.cpu.stats["lookups"] == 1
        c.check()
        c.close()
        return
    assert req.lookup(k, first_token=0) is Lookup.PENDING  # promote always: it reads now
    c.wait_idle()
    assert req.lookup(k, first_token=0) is Lookup.HIT
    assert (disk.stats["lookups"], disk.stats["promotions"]) == (1, 1)
    assert c.cpu.stats["lookups"] == 1
    rows = c.prepare_load([k])
    assert bytes(c.region.row(rows[0])) == bytes(row_for(k))
    c.complete_load([k])
    c.check()
    c.close()


@pytest.mark.parametrize("promote", ["always", "auto"])
def test_reasks_of_a_disk_hit_whose_promotion_failed_count_once(tmp_path, promote):
    """The chunk leaves the disk between the lookup and its read: the promotion fails and the
    chunk is a miss. vLLM asks again; that ask counted a second disk lookup and CPU miss."""
    from tiering.advisor import PromotionAdvisor
    from tiering.request_scan import RequestScan

    c = make_chain(tmp_path, rows=4)
    c.advisor = PromotionAdvisor(1, ROW, 16) if promote == "auto" else None  # unmeasured: load
    k = key(0)
    fill(c, [k])
    c.wait_idle()
    c.reset()
    req = RequestScan(c, "r")
    assert req.lookup(k, first_token=0) is Lookup.PENDING
    disk = c.file_tiers[0]
    assert disk.drop([k]) == 1  # gone before its read is issued
    c.on_schedule_end()
    c.wait_idle()
    for _ in range(3):
        assert req.lookup(k, first_token=0) is Lookup.MISS
        c.on_schedule_end()
    assert (disk.stats["lookups"], disk.stats["hits"]) == (1, 1)
    assert disk.stats["promotion_failures"] == 1
    assert (c.cpu.stats["lookups"], c.cpu.stats["hits"]) == (1, 0)
    c.check()
    assert c.usage()["pinned"] == 0
    c.close()


@pytest.mark.parametrize("order", ["promoter first", "other first"])
def test_a_promoted_chunk_found_by_another_request_counts_its_hit(tmp_path, order):
    """Request a finds a chunk on disk and promotes it; request b, sharing the prefix, finds it
    promoting. Whichever asks first once it is READY: a counted its disk hit when it found it,
    b counts a CPU hit. (b asking first swallowed the mark that says "this hit was the file
    tier's": b's hit was counted nowhere.)"""
    from tiering.request_scan import RequestScan

    c = make_chain(tmp_path)
    k = key(0)
    fill(c, [k])
    c.wait_idle()
    c.reset()
    a, b = RequestScan(c, "a"), RequestScan(c, "b")
    assert a.lookup(k) is Lookup.PENDING
    assert b.lookup(k) is Lookup.PENDING
    c.wait_idle()
    for req in ([a, b] if order == "promoter first" else [b, a]) * 2:
        assert req.lookup(k) is Lookup.HIT
    disk = c.file_tiers[0]
    assert (disk.stats["lookups"], disk.stats["hits"]) == (1, 1)
    assert (c.cpu.stats["lookups"], c.cpu.stats["hits"]) == (2, 1)  # a's miss, b's hit
    c.close()


def test_disk_hit_promotes_and_counts_once(tmp_path):
    c = make_chain(tmp_path)
    ks = [key(i) for i in range(4)]
    fill(c, ks)
    c.wait_idle()
    c.reset()  # CPU emptied, disk keeps them
    assert c.lookup(ks[0]) is Lookup.PENDING
    for _ in range(3):
        assert c.lookup(ks[0]) is Lookup.PENDING  # re-asks before the step ends: uncounted
    c.wait_idle()
    assert c.lookup(ks[0]) is Lookup.HIT
    assert c.hit_source(ks[0]) == "disk"
    disk = c.file_tiers[0]
    assert (disk.stats["lookups"], disk.stats["hits"], disk.stats["promotions"]) == (1, 1, 1)
    assert (c.cpu.stats["lookups"], c.cpu.stats["hits"]) == (1, 0)
    rows = c.prepare_load([ks[0]])
    assert bytes(c.region.row(rows[0])) == bytes(row_for(ks[0]))
    c.complete_load([ks[0]])
    c.check()
    c.close()


def test_file_tier_evictions_are_events(tmp_path):
    c = make_chain(tmp_path, rows=32)
    ks = [key(i) for i in range(20)]  # the disk holds 16
    for i in range(0, 20, 4):
        fill(c, ks[i:i + 4])
        c.wait_idle()
    removed = [k for e in c.take_events() if e.medium == "file" and e.removed for k in e.keys]
    assert len(removed) == 4 and not any(c.file_tiers[0].contains(k) for k in removed)
    c.close()


def test_cpu_tier_full_of_pinned_rows_is_a_counted_rejection(tmp_path):
    c = make_chain(tmp_path, rows=2)
    stored, rows, _ = c.prepare_store([key(0), key(1)])  # both pinned: the GPU is writing
    assert c.prepare_store([key(2)]) is None
    assert c.cpu.stats["rejections:pinned"] == 1
    c.complete_store(stored)
    c.close()


def test_every_reader_agrees_on_every_counter(tmp_path, capsys):
    """chain/tier counters == persisted (`tiering stats`) == exporter, after hits, misses,
    threshold rejections, evictions and a checksum failure."""
    from tiering.cli import main
    from tiering.exporter import render

    t = open_tier(tmp_path, slots=4, store_threshold=0)
    ks = [key(i) for i in range(6)]
    for k in ks:
        t.put([k], [row_for(k)])
        t.wait_idle()
    for k in ks + [key("x")]:
        t.lookup(k)
    out = bytearray(ROW)
    t.get([(ks[-1], memoryview(out), None)])
    t.wait_idle()
    t.evict(1)
    mine = t.stats.snapshot()
    used, capacity, entries = t.usage()
    folder = t.folder
    t.close()
    assert mine["evictions"] == 3 and mine["hits"] == 4 and mine["promotions"] == 1
    assert main(["stats", str(tmp_path), "--json"]) == 0
    import json

    (ns,) = json.loads(capsys.readouterr().out)["namespaces"]
    text = render([folder])
    for flat, v in mine.items():
        assert ns[flat] == v, flat
        name, _, label = flat.partition(":")
        line = [ln for ln in text.splitlines() if ln.startswith(f"tiering_cache_{name}_total{{")
                and (not label or f'reason="{label}"' in ln)]
        assert len(line) == 1 and float(line[0].rsplit(" ", 1)[1]) == v, (flat, line)
    # the gauges too: every fill-level gauge of the registry, with the tier's own numbers
    from tiering.stats import FILL_GAUGES, fill_gauges

    want = fill_gauges(entries, capacity, ROW)
    assert entries == 3 and want["usage_bytes"] == used and want["usage_perc"] == 0.75
    for g in FILL_GAUGES:
        line = [ln for ln in text.splitlines() if ln.startswith(f"tiering_cache_{g}{{")]
        assert len(line) == 1 and float(line[0].rsplit(" ", 1)[1]) == want[g], (g, line)



def test_server_fill_gauges_are_the_registry_computation(tmp_path):
    """The vLLM metrics report each tier's fill level as ``stats.fill_gauges`` computes it,
    under every registry fill-gauge name (the same numbers the exporter writes)."""
    pytest.importorskip("vllm")
    from tiering.stats import FILL_GAUGES, fill_gauges
    from tiering.vllm.metrics import PREFIX, TierMetrics

    c = make_chain(tmp_path, rows=4)
    fill(c, [key(i) for i in range(3)])
    c.wait_idle()
    data = TierMetrics().collect(c).data["data"]
    for label, tier in (("cpu", c.cpu), ("disk", c.file_tiers[0])):
        _, cap, entries = tier.usage()
        want = fill_gauges(entries, cap, ROW)
        assert entries == 3, label
        for g in FILL_GAUGES:
            assert data[PREFIX + g][(label,)] == want[g], (label, g)
    assert data[PREFIX + "usage_perc"][("cpu",)] == 0.75
    c.close()

def writeback_chain(tmp_path, rows=8, disk_slots=64) -> TierChain:
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": disk_slots * ROW, "io": "posix",
                     "policy": "lru", "demote": "on_evict"}, facts(ROW))
    return TierChain(CpuTier(StagingRegion("wb", rows, ROW), "lru"), [tier], events=True)


def test_writeback_writes_only_what_the_cpu_tier_evicts(tmp_path):
    c = writeback_chain(tmp_path)
    disk = c.file_tiers[0]
    ks = [key(i) for i in range(40)]
    fill(c, ks[:4])
    c.wait_idle()
    assert disk.stats["stores"] == 0  # write-back: nothing written while the CPU holds them
    for i in range(4, 40, 2):  # keep storing: the oldest rows are written before eviction
        fill(c, ks[i:i + 2])
        c.wait_idle()
        c.check()
    assert disk.stats["writeback_misses"] == 0
    on_disk = [k for k in ks if disk.contains(k)]
    in_cpu = [k for k in ks if c.cpu.contains(k)]
    assert set(on_disk) | set(in_cpu) == set(ks)  # every chunk is somewhere
    assert disk.stats["stores"] < len(ks)  # rows still in the CPU were not written
    c.reset()  # owed rows are written before they are dropped
    c.wait_idle()
    for k in ks:
        assert disk.contains(k)
        assert c.lookup(k) is Lookup.PENDING
        c.wait_idle()
        rows = c.prepare_load([k])
        assert bytes(c.region.row(rows[0])) == bytes(row_for(k))
        c.complete_load([k])
    c.check()
    c.close()


def test_writeback_keeps_a_step_of_stores_clean(tmp_path):
    """A step's end writes back as many of the next victims as the step stored (here more than
    the fixed reserve of 2 rows), so the next step's stores evict only rows already on disk;
    a store never starts writes of its own victims (they would only be pinned while it evicts
    newer rows that no tier holds)."""
    c = writeback_chain(tmp_path, rows=16)
    disk = c.file_tiers[0]
    ks = [key(i) for i in range(24)]
    for i in range(0, 24, 4):
        fill(c, ks[i:i + 4])
        c.on_schedule_end()  # the step's end (wait_idle counts no step)
        c.wait_idle()
        c.check()
    assert disk.stats["writeback_misses"] == 0
    assert all(disk.contains(k) for k in ks[:8])  # evicted from the CPU tier: on disk
    assert all(c.cpu.contains(k) for k in ks[8:])
    c.close()


def test_a_store_evicts_the_oldest_row_while_the_next_ones_are_written(tmp_path):
    c = writeback_chain(tmp_path, rows=16)  # a reserve of 2 rows, 4 rows' demotion budget
    ks = [key(i) for i in range(17)]
    for k in ks[:16]:  # a step each; the last step's end starts writing the two oldest
        fill(c, [k])
        c.on_schedule_end()
    assert c.file_tiers[0].has_pending_work()
    _, _, evicted = c.prepare_store([ks[16]])  # k0 and k1 are still pinned by their writes
    assert evicted == [ks[2]]  # the oldest row that can go, unwritten: a counted miss
    assert c.file_tiers[0].stats["writeback_misses"] == 1
    assert len(c._in_flight) == 2  # no write started for the store's own victims
    c.close()


def test_writeback_shutdown_persists_owed_rows(tmp_path):
    c = writeback_chain(tmp_path)
    ks = [key(i) for i in range(5)]
    for k in ks:  # a step each: the reserve (the larger of 2 rows and a step's stores) stays free
        fill(c, [k])
        c.wait_idle()
    assert c.file_tiers[0].stats["stores"] == 0
    c.close()
    with FileTier({"path": str(tmp_path / "disk"), "capacity": 64 * ROW, "io": "posix",
                   "policy": "lru", "demote": "on_evict"}, facts(ROW)) as t:
        assert all(t.contains(k) for k in ks)


def test_demote_mode_is_validated(tmp_path):
    with pytest.raises(ValueError, match="demote: expected one of on_store, on_evict, got 'later'"):
        FileTier({"path": str(tmp_path / "d"), "capacity": 4 * ROW, "demote": "later"}, facts(ROW))
    assert not (tmp_path / "d").exists()


def vllm_lookup_round(c: TierChain, keys: list[bytes], seen: set[bytes]) -> int | None:
    """What vLLM's scheduler does each step: ask chunks in order until a miss; None (ask again
    next step) while any asked chunk is pending; else the number of chunks it will load."""
    hits, pending = 0, False
    for k in keys:
        r = c.lookup(k, count=k not in seen, protect=seen)
        seen.add(k)
        if r is Lookup.MISS:
            break
        hits += 1
        pending |= r is Lookup.PENDING
    return None if pending else hits


def test_prefix_larger_than_cpu_tier_loads_what_fits_without_thrashing(tmp_path):
    """A request's own promoted chunks are never evicted by its later promotions: vLLM gets the
    longest prefix the CPU tier can hold, then recomputes the rest (it cannot load a prefix
    larger than the CPU tier in one job, and a failed load cannot be reported to it)."""
    c = make_chain(tmp_path, rows=4)
    ks = [key(i) for i in range(8)]
    for i in range(0, 8, 2):
        fill(c, ks[i:i + 2])
        c.wait_idle()
    c.reset()
    seen: set[bytes] = set()
    for _step in range(10):
        n = vllm_lookup_round(c, ks, seen)
        if n is not None:
            break
        c.wait_idle()
    assert n == 4, "the request must resolve with the CPU tier's worth of chunks"
    rows = c.prepare_load(ks[:n])
    for k, r in zip(ks[:n], rows, strict=True):
        assert bytes(c.region.row(r)) == bytes(row_for(k))
    c.complete_load(ks[:n])
    c.check()
    c.close()


def test_every_registry_metric_is_documented_and_on_the_dashboard_or_rules():
    from pathlib import Path

    from tiering.stats import METRICS

    root = Path(__file__).resolve().parent.parent
    ops = (root / "docs/operations.md").read_text()
    for m in METRICS:
        suffix = "_total" if m.kind == "counter" else ""
        assert f"vllm:kv_tier_{m.name}{suffix}" in ops or f"kv_tier_{m.name}" in ops, m.name
    dash = (root / "examples/grafana/tiering-dashboard.json").read_text()
    used = set(__import__("re").findall(r"kv_tier_([a-z_]+?)(?:_total|_bucket)?\b", dash))
    assert used <= {m.name for m in METRICS}, used - {m.name for m in METRICS}


def test_counters_survive_a_failed_index_commit(tmp_path):
    """A commit that fails (full disk) must not lose the counters it carried."""
    t = open_tier(tmp_path, slots=8)
    real = t.index.publish
    fails = {"n": 1}

    def flaky(*a, **kw):
        if fails["n"]:
            fails["n"] -= 1
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    t.index.publish = flaky
    for i in range(3):
        t.lookup(key(i))  # counted, pending
    t.put([key(0)], [row_for(key(0))])  # this batch's commit fails, with the lookups' counts
    done = t.wait_idle()
    assert [d.reason for d in done] == ["full"]
    assert t.stats["rejections:full"] == 1
    t.flush()
    t.close()
    with open_tier(tmp_path, slots=8) as again:
        persisted = again.index.read_stats()
    assert persisted["lookups"] == 3 and persisted["rejections:full"] == 1


def test_a_disk_behind_the_stores_never_pins_the_whole_cpu_tier(tmp_path):
    """Stores arriving faster than the disk writes them: the chain used to pin every CPU row for
    its write-down and then refuse stores (rejections{reason="pinned"}), so under write pressure
    the CPU tier served fewer hits than vLLM's own CPU offloading. Now at most a quarter of the
    rows are pinned by writes; the rest wait unpinned and are written oldest first."""
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": 64 * ROW, "io": "posix",
                     "policy": "lru"}, facts(ROW))
    c = TierChain(CpuTier(StagingRegion("behind", 16, ROW), "lru"), [tier], events=True)
    ks = [key(i) for i in range(48)]
    for i in range(0, 48, 2):  # no poll in between: no write completion is applied
        out = c.prepare_store(ks[i:i + 2])
        assert out is not None, f"store {i} refused"
        for k, r in zip(out[0], out[1], strict=True):  # what the GPU would write
            np.frombuffer(c.region.row(r), np.uint8)[:] = np.frombuffer(row_for(k), np.uint8)
        c.complete_store(out[0])
        assert c.cpu.pinned_rows() <= 16 // 4
    assert c.cpu.stats["rejections:pinned"] == 0
    assert tier.stats["demotions_deferred"] > 0
    for _ in range(10):  # steps: completions free the budget, waiting rows follow
        c.wait_idle()
    held = [k for k in ks if c.cpu.contains(k)]
    assert len(held) == 16 and all(tier.contains(k) for k in held)
    lost = [k for k in ks if not tier.contains(k)]  # evicted before their turn: counted
    assert len(lost) == tier.stats["writeback_misses"]
    c.reset()
    for k in held:  # what reached the disk reads back exactly
        assert c.lookup(k) is Lookup.PENDING
        c.wait_idle()
        rows = c.prepare_load([k])
        assert bytes(c.region.row(rows[0])) == bytes(row_for(k))
        c.complete_load([k])
    c.check()
    c.close()


@pytest.mark.parametrize("modes", [("on_store",), ("on_evict",), ("on_store", "on_evict")])
def test_a_restart_after_close_finds_every_chunk_the_cpu_tier_held(tmp_path, modes):
    """Stores with no step in between: past the demotion budget the write-through rows are
    owed, and every row is owed to a write-back tier. close() writes them all: a restarted
    tier holds every chunk that was in the CPU tier."""
    def tiers():
        return [FileTier({"path": str(tmp_path / f"d{i}"), "capacity": 64 * ROW, "io": "posix",
                          "policy": "lru", "demote": m}, facts(ROW, model=f"m{i}"))
                for i, m in enumerate(modes)]

    c = TierChain(CpuTier(StagingRegion("restart", 16, ROW), "lru"), tiers())
    ks = [key(i) for i in range(16)]
    for i in range(0, 16, 2):
        fill(c, ks[i:i + 2])
    assert all(c.cpu.contains(k) for k in ks)
    c.poll()
    assert any(not t.contains(k) for t in c.file_tiers for k in ks)  # close() has work to do
    c.close()
    for t in tiers():
        assert [k for k in ks if not t.contains(k)] == [], t.cfg.demote
        for k in ks[::5]:
            out = bytearray(ROW)
            assert t.get([(k, memoryview(out), None)]) == [True]
            (done,) = t.wait_idle()
            assert done.ok and bytes(out) == bytes(row_for(k))
        t.close()
