"""Hostile tests of gpu-bench's step budget by phases (StepBudget, benchmarks/gpu_bench.py) and
the DEBUG lines of a disk hit's time (tiering/request_scan.py, tiering/chain.py)."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import pytest
from test_advisor import ROW, on_disk, scan
from tierutil import key

import tiering.backends.staging as staging
import tiering.chain as chain_mod
import tiering.request_scan as rs_mod
from benchmarks import gpu_bench
from tiering.advisor import PromotionAdvisor
from tiering.request_scan import RequestScan, RunState
from tiering.tier import Completion

GUESS = gpu_bench.StepBudget.START_GUESS_S


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


def main_flag(phases: list[str]) -> bool:
    """What ``gpu_bench.main``'s budget takes ``disk_phases`` to be for ``--phases``."""
    return gpu_bench.StepBudget.for_phases(0, 0.0, phases).disk_phases


# -- StepBudget ----------------------------------------------------------------------------------

@pytest.mark.parametrize("disk_phases", [True, False])
@pytest.mark.parametrize("what", ["phases", "throughput", "sweep-8b"])
@pytest.mark.parametrize("config", gpu_bench.CONFIGS)
def test_a_step_is_estimated_under_the_kind_it_was_recorded_under(disk_phases, what, config):
    """After one step of (what, config), the same step is expected to do that work again:
    ``took`` and ``estimate`` must pick the same kind (else it falls back to the other kind,
    doubled, or to 0)."""
    b = gpu_bench.StepBudget(1000, 0.0, clock=lambda: 0.0, disk_phases=disk_phases)
    b.took(what, config, 40.0)
    starts = 2 if (what == "phases" and config in gpu_bench.HAS_DISK and disk_phases) else 1
    assert b.estimate(what, config) == 40.0 + starts * GUESS
    assert len(b.longest) == 1


def test_without_disk_phases_every_config_shares_the_phases_kind_but_not_throughputs():
    b = gpu_bench.StepBudget(1000, 0.0, clock=lambda: 0.0, disk_phases=main_flag(
        ["cold", "cpu", "throughput"]))
    b.took("phases", "ours", 70.0, (50.0,))  # a disk config's phases first: 20 s of work
    for c in gpu_bench.CONFIGS:
        assert b.estimate("phases", c) == 20.0 + GUESS  # one engine, the same work
    b.took("throughput", "ours", 30.0)
    # a disk config's throughput keeps its own kind; a no-disk one falls back to it undoubled
    assert ("throughput", True) in b.longest and ("throughput", False) not in b.longest
    assert b.estimate("throughput", "cpu") == 30.0 + GUESS
    b.took("throughput", "cpu", 10.0)
    assert b.estimate("throughput", "cpu") == 10.0 + GUESS
    assert b.estimate("throughput", "ours") == 30.0 + GUESS


def test_the_default_still_doubles_a_disk_configs_phases():
    """Nothing changed for a run with every phase (the default ``disk_phases``)."""
    assert main_flag(list(gpu_bench.PHASES)) is True
    b = gpu_bench.StepBudget(1000, 0.0, clock=lambda: 0.0)
    b.took("phases", "cpu", 58.0, (8.0,))  # the run's first start: not a start cost
    assert b.estimate("phases", "ours") == 2 * 50.0 + 2 * GUESS
    assert b.estimate("phases", "none") == 50.0 + GUESS
    b.took("phases", "ours", 100.0, (9.0, 10.0))
    assert b.quickest_start == 9.0
    assert b.estimate("phases", "vtier-fs") == 81.0 + 2 * 9.0
    assert b.estimate("phases", "none") == 50.0 + 9.0


@pytest.mark.parametrize("phases", [
    ["restart"], ["disk"], ["cold", "cpu"], ["cold", "cpu", "throughput"], ["disk", "throughput"],
    ["restart", "throughput"], ["cold", "cpu", "disk"], list(gpu_bench.PHASES)])
def test_a_disk_configs_estimate_counts_the_engines_its_phases_start(phases, monkeypatch, tmp_path):
    """``phases_for`` starts one engine, and a second for a disk config only under "restart":
    the budget main builds for these phases must count as many starts for a disk config's
    phases step (a start it does not make is ~9-15 s the budget wrongly holds back)."""
    engines = []

    class FakeEngine:
        def __init__(self, *a, **k):
            engines.append(self)
            self.init_s, self.weights_s = 1.0, 0.5

        def settle(self, *a, **k):
            return 0.0

        def generate(self, *a, **k):
            return None

        def close(self):
            pass

    monkeypatch.setattr(gpu_bench, "Engine", FakeEngine)
    monkeypatch.setattr(gpu_bench, "record", lambda *a, **k: None)
    monkeypatch.setattr(gpu_bench, "fillers", lambda *a: 2)
    monkeypatch.setattr(gpu_bench, "transfer_config", lambda *a, **k: {})
    monkeypatch.setattr(gpu_bench, "with_step_timing", lambda kvt, t: kvt)
    monkeypatch.setattr(gpu_bench, "with_switch_interval", lambda kvt, ms: kvt)
    a = SimpleNamespace(phases=phases, lengths=[32], repeats=1, disk_gib=1.0, gpu_copy=None,
                        promote=None, switch_ms=None, step_timing=None, shape="tiny",
                        restart_warmup="fresh", io_threads=None)
    gpu_bench.phases_for(a, None, "ours", tmp_path, [], [(32, [1, 2], 0)], 1, 64, 8, 1 << 20)
    b = gpu_bench.StepBudget.for_phases(1000, 0.0, phases, clock=lambda: 0.0)
    b.took("phases", "ours", 100.0)  # its own work, no start given
    assert (b.estimate("phases", "ours") - 100.0) / GUESS == len(engines), (
        f"--phases {','.join(phases)}: phases_for started {len(engines)} engine(s) for 'ours'")


# -- the request scan's and the chain's DEBUG lines ------------------------------------------------

def slow_engine() -> PromotionAdvisor:
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)
    adv.observe_read_batch(1, 16 * ROW, 16 * ROW / 1e9)  # 1 GB/s
    return adv


def loaded(tmp_path, adv, announce: int = 1):
    """A request whose 6 disk chunks were decided LOAD, read and loaded (not yet reported)."""
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=6)
    req = RequestScan(c, "r")
    for _ in range(announce):
        req.arrived()
    assert scan(c, req, ks) is None and req.disk_run.state is RunState.LOAD
    c.wait_idle()
    assert scan(c, req, ks) == 6
    c.prepare_load(ks)
    c.complete_load(ks)
    return c, req


GPU_LINE = (r"request r: its disk run reached the GPU ([0-9.-]+) s after its decision: (\d+) "
            r"chunks read, priced ([0-9.]+) s at ([0-9.e+-]+) GB/s now; the engine computed "
            r"prompts for ([0-9.]+) s of it; ([0-9.]+) s beyond both")


def test_with_debug_off_no_line_is_made_and_the_advisor_still_learns(tmp_path, caplog,
                                                                        monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a DEBUG line was built at INFO")

    adv = slow_engine()
    monkeypatch.setattr(chain_mod.log, "debug", boom)  # guarded by isEnabledFor: never called
    for lg in (chain_mod.log, rs_mod.log):
        monkeypatch.setattr(lg, "makeRecord", boom)
    monkeypatch.setattr(adv, "describe", boom)  # an argument of the decision line only
    with caplog.at_level(logging.INFO, logger="tiering"):
        c, req = loaded(tmp_path, adv)
        decided = req._loading[1]
        req.load_completed(now=decided + 0.25)
    assert adv.measured_load_overhead(1) == pytest.approx(0.25 - 6 * ROW / 1e9)
    assert req._loading is None
    c.close()


def synthetic_batch(c, nbytes_rows: int, rows: int, seconds: float, submitted: float):
    """Register batch 99 of tier 1 of ``rows`` reads, ``nbytes_rows`` of them ok, and end it."""
    c._batches[99] = [1, rows, 0, 0.0, submitted]
    for n in range(rows):
        c._read_done(99, Completion("read", key(n), n < nbytes_rows, seconds=seconds))
    assert 99 not in c._batches


def test_a_read_batch_line_agrees_with_what_the_advisor_learned(tmp_path, caplog, monkeypatch):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)
    c, _ = on_disk(tmp_path, adv, n_cpu=0, n_disk=1)
    full = c._full_batch_rows(1)
    c._reads_ended[0] = 0.0
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        synthetic_batch(c, full, full, 0.004, submitted=time.perf_counter())
    m = re.search(r"tier disk: a read batch of (\d+) bytes took ([0-9.]+) s on the device "
                  r"\(([0-9.]+) s since its submission\): ([0-9.e+-]+) GB/s; the read rate now "
                  r"([0-9.e+-]+) GB/s", caplog.text)
    assert m, caplog.text
    nbytes, busy, since, gbs, now_rate = m.groups()
    assert int(nbytes) == full * ROW and float(busy) == pytest.approx(0.004, abs=1e-4)
    assert float(gbs) == pytest.approx(full * ROW / 0.004 / 1e9, rel=1e-2)
    assert float(now_rate) == pytest.approx(adv.read_rate(1) / 1e9, rel=1e-2)
    assert adv.read_rate(1) == pytest.approx(full * ROW / 0.004, rel=1e-6)
    c.close()


def test_a_read_batch_at_info_still_teaches_the_rate_and_logs_nothing(tmp_path, caplog,
                                                                     monkeypatch):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)
    c, _ = on_disk(tmp_path, adv, n_cpu=0, n_disk=1)
    full = c._full_batch_rows(1)
    calls = []
    monkeypatch.setattr(chain_mod.log, "debug", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(adv, "read_rate", lambda t: calls.append("read_rate"))
    with caplog.at_level(logging.INFO, logger="tiering"):
        synthetic_batch(c, full, full, 0.004, submitted=time.perf_counter())
    assert calls == []
    assert adv._read[1].value == pytest.approx(full * ROW / 0.004, rel=1e-6)
    c.close()


def test_a_read_batch_of_failed_rows_or_no_device_time_never_raises(tmp_path, caplog):
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)
    c, _ = on_disk(tmp_path, adv, n_cpu=0, n_disk=1)
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        t = time.perf_counter()
        synthetic_batch(c, 0, 4, 0.01, submitted=t)  # every row failed: 0 bytes
        assert adv.read_rate(1) is None  # nothing learned from no bytes
        assert "the read rate now unknown" in caplog.text
        caplog.clear()
        # a batch that ended before the last one did: no device time of its own
        c._reads_ended[0] = t + 10.0
        synthetic_batch(c, 4, 4, 0.01, submitted=t)
        assert adv.read_rate(1) is None and "read batch" not in caplog.text
        c._read_done(None, Completion("read", key(0), True))  # a calibration-less read
    c.close()


@pytest.mark.parametrize("announce", [0, 1, 2])
def test_a_loaded_run_logs_its_arrival_once_or_not_at_all(tmp_path, caplog, announce):
    adv = slow_engine()
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        before = time.perf_counter()
        c, req = loaded(tmp_path, adv, announce=announce)
        decided = req._loading[1]
        req.load_completed(now=decided + 0.25)
    line = next(r.getMessage() for r in caplog.records if "disk chunks" in r.getMessage())
    if announce:
        assert before <= req.arrived_at <= decided
        assert adv.waiting_requests == 0  # announced once, reached once
        waited = float(re.search(r", ([0-9.]+) s after its arrival\)", line).group(1))
        assert waited == pytest.approx(decided - req.arrived_at, abs=1e-4)
    else:
        assert req.arrived_at is None and "after its arrival" not in line
    assert "its first chunk decided the run" in line and "nan" not in line
    assert len(re.findall(GPU_LINE, caplog.text)) == 1
    c.close()


def test_load_completed_twice_or_without_a_load_is_quiet(tmp_path, caplog, monkeypatch):
    adv = slow_engine()
    seen = []
    real = adv.observe_load
    monkeypatch.setattr(adv, "observe_load", lambda *a: (seen.append(a), real(*a)))
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        c, req = loaded(tmp_path, adv)
        fresh = RequestScan(c, "never")
        fresh.load_completed()  # never decided anything
        decided = req._loading[1]
        req.load_completed(now=decided + 0.25)
        req.load_completed(now=decided + 5.0)
        req.load_completed()
    assert len(seen) == 1 and len(re.findall(GPU_LINE, caplog.text)) == 1
    assert "request never" not in caplog.text
    c.close()


@pytest.mark.parametrize("how", ["rate_unknown", "nothing_promoted"])
def test_a_load_that_cannot_be_priced_logs_and_learns_nothing(tmp_path, caplog, monkeypatch, how):
    adv = slow_engine()
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        c, req = loaded(tmp_path, adv)
        if how == "rate_unknown":
            adv._read[1].value = None
        else:
            req.promoted = 0
        req.load_completed(now=req._loading[1] + 0.25)
    assert not re.search(GPU_LINE, caplog.text)
    assert adv.measured_load_overhead(1) is None and req._loading is None
    c.close()


def test_the_gpu_line_splits_a_load_the_engine_outlasted(tmp_path, caplog):
    """The engine computed prompts past the load's arrival: nothing is beyond both, and the
    advisor learns an overhead of 0, as the line says; the rate named is the advisor's."""
    adv = slow_engine()
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        c, req = loaded(tmp_path, adv)
        decided = req._loading[1]
        adv.clock.busy_until = decided + 0.4
        req.load_completed(now=decided + 0.25)
    took, n, read_s, gbs, busy, rest = re.search(GPU_LINE, caplog.text).groups()
    assert (float(took), int(n)) == (pytest.approx(0.25, abs=1e-4), 6)
    assert float(busy) == pytest.approx(0.4, abs=1e-4) and float(rest) == 0.0
    assert float(read_s) == pytest.approx(6 * ROW / adv.read_rate(1), abs=1e-4)
    assert float(gbs) == pytest.approx(adv.read_rate(1) / 1e9, rel=1e-2)
    assert adv.measured_load_overhead(1) == 0.0
    c.close()


def test_a_run_decided_after_its_survey_does_not_claim_its_first_chunk_decided_it(tmp_path,
                                                                                 caplog):
    """The engine is measured, the disk's read rate is not: the first chunk cannot pay
    (``first_chunk_pays`` False), the run is surveyed and decided whole by ``decide`` at the
    next step — unpriced (NaN seconds: the tier is unmeasured, it is recomputed while the tier
    is calibrated). Its line must not say that its first chunk decided it."""
    adv = PromotionAdvisor(1, ROW, chunk_tokens=16, prefill_tokens_per_s=1.0)  # no read rate
    c, ks = on_disk(tmp_path, adv, n_cpu=0, n_disk=6)
    # the tier stays unmeasured: a calibration read ending between the two steps would price
    # the run (and load it), which is not the case under test
    c.calibrate = lambda *a, **k: False  # type: ignore[method-assign]
    req = RequestScan(c, "r")
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        req.arrived()
        assert scan(c, req, ks) is None and req.disk_run.state is RunState.SURVEY
        assert scan(c, req, ks) == 0 and req.disk_run.state is RunState.RECOMPUTE
    line = next(r.getMessage() for r in caplog.records if "disk chunks" in r.getMessage())
    assert "(unmeasured" in line and "nan" not in line
    assert "its first chunk decided the run" not in line, line
    c.wait_idle()
    c.close()
