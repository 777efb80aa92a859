"""Hostile tests of the defaults changed on 2026-12-06 (2884d7b): the load cap left to a
default that ``TieringScheduler`` lifts (tiering.vllm.load_gate, tiering.vllm.scheduler,
``TieredManager.of_scheduler``), ``max_loading_requests`` validation (tiering.config), and the
interpreter switch interval lowered for the copy feeder (tiering.switch_interval,
``TieredOffloadingSpec.get_worker``).

The tests inside a real scheduler need vLLM 0.33's (``_vllm()`` skips under 0.32); the rest run
under both venvs."""

from __future__ import annotations

import logging
import re
import sys
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

# the existing harness helpers (tests/test_vllm_hits_first.py)
from test_vllm_hits_first import _extra, _mixed_batch, _most_loading, _vllm  # noqa: E402

from tiering.settings import (  # noqa: E402
    MAX_LOADING_REQUESTS,
    MAX_LOADING_REQUESTS_UNDER_OUR_SCHEDULER,
)
from tiering.stats import TierStats  # noqa: E402
from tiering.vllm.compat import LookupResult  # noqa: E402
from tiering.vllm.load_gate import LoadGate  # noqa: E402
from tiering.vllm.manager import TieredManager  # noqa: E402

G0 = (0).to_bytes(4, "little")  # a KV group suffix of an offload key


def _key(name: str) -> bytes:
    return name.encode() + G0


def _gate(cap, per_step: int = 0) -> LoadGate:
    return LoadGate(cap, TierStats(), per_step)


def _resident(key: bytes) -> bool:
    return True


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model of tests/test_vllm_hits_first.py."""
    from benchmarks.tiny_model import build

    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


# -- the gate alone -------------------------------------------------------------------------------

def test_the_constants_say_what_the_change_says():
    assert MAX_LOADING_REQUESTS == 256
    assert MAX_LOADING_REQUESTS_UNDER_OUR_SCHEDULER == 0


@pytest.mark.parametrize("cap", [0, 1, 7, 256, MAX_LOADING_REQUESTS + 1])
def test_a_named_cap_is_never_lifted(cap):
    gate = _gate(cap)
    assert gate.cap == cap and gate.cap_is_default is False
    assert gate.scheduler_sums_linearly() is False
    assert gate.cap == cap
    assert gate.slots_free() == (cap or None)
    assert gate.limits is bool(cap)


def test_the_default_cap_is_256_until_lifted_then_none_and_lifting_is_idempotent():
    gate = _gate(None)
    assert gate.cap_is_default is True and gate.cap == MAX_LOADING_REQUESTS
    assert gate.slots_free() == MAX_LOADING_REQUESTS and gate.limits
    assert gate.scheduler_sums_linearly() is True
    assert gate.cap == 0 and gate.slots_free() is None and not gate.limits
    assert gate.cap_is_default is True  # still the user's non-choice
    assert gate.scheduler_sums_linearly() is False  # once only
    gate.reset()  # a cache reset does not bring the cap back
    assert gate.cap == 0 and gate.slots_free() is None


@pytest.mark.parametrize("cap, per_step", [(-1, 0), (None, -1), (-256, 0)])
def test_negative_limits_are_refused_with_the_keys_name(cap, per_step):
    key = "max_loading_requests" if cap is not None and cap < 0 else "max_load_starts_per_step"
    with pytest.raises(ValueError, match=key):
        _gate(cap, per_step)


def test_lifting_the_cap_of_a_full_gate_opens_it_for_new_requests_at_once():
    """The default cap reached (256 requests loading), one request deferred in this step: once
    lifted, a request not yet asked about is let through in the same step; the one already
    told to wait keeps its answer until the step ends (its group answered RETRY, the rest MISS),
    then nothing is deferred any more, not even with the 256 loads still in flight."""
    gate = _gate(None)
    for i in range(MAX_LOADING_REQUESTS):
        gate.started(f"r{i}")
    assert gate.closed and gate.slots_free() == 0
    resident = _resident
    assert gate.check("late", _key("a"), resident) is LookupResult.RETRY
    assert gate.check("late", _key("b"), resident) is LookupResult.MISS
    assert gate.scheduler_sums_linearly() is True
    assert gate.slots_free() is None
    assert gate.closed  # "late" is still deferred within this step
    assert gate.check("other", _key("c"), resident) is None  # not deferred: no cap now
    assert gate.check("late", _key("d"), resident) is LookupResult.MISS
    gate.end_step()
    assert not gate.closed
    assert gate.check("late", _key("a"), resident) is None
    gate.started("more")
    assert not gate.closed and gate.loading() == MAX_LOADING_REQUESTS + 1


def test_lifting_the_cap_of_a_full_gate_with_nothing_deferred_opens_it_at_once():
    """``closed`` is what the manager reads on every lookup: once the cap is gone and nothing
    was deferred, it must read False straight away (not only after the step ends)."""
    gate = _gate(None)
    for i in range(MAX_LOADING_REQUESTS):
        gate.started(f"r{i}")
    assert gate.closed
    assert gate.scheduler_sums_linearly() is True
    assert not gate.closed


def test_a_lifted_default_cap_keeps_a_named_per_step_limit():
    gate = _gate(None, per_step=2)
    assert gate.scheduler_sums_linearly() is True
    assert gate.limits and gate.slots_free() == 2
    gate.started("a")
    gate.started("b")
    assert gate.closed and gate.slots_free() == 0
    assert gate.check("c", _key("c"), _resident) is LookupResult.RETRY
    gate.end_step()
    assert not gate.closed and gate.slots_free() == 2


# -- max_loading_requests in the spec's config -----------------------------------------------------

@pytest.mark.parametrize("value", [True, False, "8", "", "0", -1, -256, 8.0, 0.0, 2.5,
                                   float("inf"), float("nan"), [8], {"n": 8}])
def test_a_max_loading_requests_of_the_wrong_kind_is_one_value_error_naming_it(value):
    from tiering.config import parse

    with pytest.raises(ValueError) as err:
        parse({"cpu_bytes_to_use": "1GiB", "max_loading_requests": value})
    assert str(err.value).startswith("max_loading_requests: expected an integer >= 0, got ")
    assert type(err.value) is ValueError


def test_an_explicit_null_max_loading_requests_is_the_default_or_a_clear_error():
    """JSON null for the key: either the default (as for switch_interval_ms) or a ValueError
    naming the key; never a TypeError from inside, never a cap of None that counts as named."""
    from tiering.config import parse

    try:
        cfg = parse({"cpu_bytes_to_use": "1GiB", "max_loading_requests": None})
    except ValueError as exc:
        assert str(exc).startswith("max_loading_requests:"), exc
    else:
        assert cfg.max_loading_requests is None


@pytest.mark.parametrize("value", [0, 1, 256, 10**6])
def test_a_valid_max_loading_requests_is_kept_exactly(value):
    from tiering.config import parse

    got = parse({"cpu_bytes_to_use": "1GiB", "max_loading_requests": value}).max_loading_requests
    assert got == value and type(got) is int


def test_the_spec_hands_the_named_or_default_cap_to_the_manager(tmp_path, monkeypatch):
    """Through TieredOffloadingSpec (no scheduler): a default stays the default (256, marked as
    such) and a named cap, 256 included, is marked as chosen."""
    import tiering.backends.staging as staging
    from tiering.vllm import TieredOffloadingSpec

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")
    for i, (named, cap, default) in enumerate([(None, 256, True), (256, 256, False),
                                               (0, 0, False), (1, 1, False)]):
        extra = _spec_extra() if named is None else _spec_extra(max_loading_requests=named)
        m = TieredOffloadingSpec(_spec_config(extra, f"cap{i}")).get_manager()
        try:
            assert (m.load_gate.cap, m.load_gate.cap_is_default) == (cap, default), named
        finally:
            m.shutdown()


# -- the switch interval ----------------------------------------------------------------------------

@pytest.fixture
def interval():
    """Python's switch interval, 5 ms during the test and restored after (it is the process's)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("start, ms, want", [
    (0.005, 1, 0.001),
    (0.005, 0.5, 0.0005),
    (0.005, 0, 0.005),          # 0: leave it
    (0.005, 5, 0.005),          # equal: nothing to do
    (0.005, 100, 0.005),        # never raised
    (0.0002, 0.5, 0.0002),      # someone lowered it further: kept
    (0.005, -1, 0.005),         # nonsense: left alone, no exception
    (0.005, float("nan"), 0.005),
    (0.005, float("inf"), 0.005),
])
def test_shorten_switch_interval_only_ever_lowers(interval, start, ms, want):
    from tiering.switch_interval import shorten_switch_interval

    sys.setswitchinterval(start)
    shorten_switch_interval(ms)
    assert sys.getswitchinterval() == pytest.approx(want)
    shorten_switch_interval(ms, "a reason")  # twice: the same
    assert sys.getswitchinterval() == pytest.approx(want)


def test_shorten_switch_interval_logs_why_only_when_it_changes(interval, caplog):
    from tiering.switch_interval import shorten_switch_interval

    with caplog.at_level(logging.INFO, logger="tiering.switch_interval"):
        shorten_switch_interval(1, "the feeder needs it")
        shorten_switch_interval(2, "never shown")  # would raise it: nothing logged
        shorten_switch_interval(0, "never shown either")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "the feeder needs it" in msgs[0] and "was 5 ms" in msgs[0], msgs


class _FakeCopier:
    name = "fake"

    def __init__(self, *args, load_queue_bytes: int = 0, load_direct: bool = False,
                 load_waves: bool = False, load_wave_streams: int = 1, **kw) -> None:
        self.load_queue_bytes, self.load_direct = load_queue_bytes, load_direct
        self.load_waves, self.load_wave_streams = load_waves, load_wave_streams


@pytest.mark.parametrize("extra, want", [
    ({}, 0.0005),                                          # default feeder, default interval
    ({"switch_interval_ms": 2}, 0.002),
    ({"switch_interval_ms": 0}, 0.005),                    # 0 leaves it
    ({"switch_interval_ms": 50}, 0.005),                   # never raised
    ({"load_queue_bytes": 0}, 0.005),                      # no feeder: left alone
    ({"load_queue_bytes": "0"}, 0.005),
    ({"load_queue_bytes": "64MiB", "switch_interval_ms": 1}, 0.001),
    ({"load_direct": False}, 0.0005),                      # the thread takes every load
    ({"load_waves": False}, 0.0005),                       # a sliding queue, as before 07g
    ({"load_wave_streams": 2}, 0.0005),                    # waves over two load streams
])
def test_a_cuda_worker_with_the_feeder_lowers_the_switch_interval(tmp_path, monkeypatch,
                                                                  interval, extra, want):
    """get_worker's CUDA branch (copier, layout and worker stood in for: no GPU here): the
    feeder (load_queue_bytes, 256 MiB by default) lowers the interval to switch_interval_ms,
    never raises it, and leaves it where the feeder is off."""
    import tiering.backends.cuda_copy as cuda_copy
    import tiering.backends.staging as staging
    import tiering.vllm.spec as spec_mod

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")
    made = {}

    def worker(layout, copier, region, reported):
        made["copier"], made["region"] = copier, region
        return SimpleNamespace(shutdown=lambda: None)

    monkeypatch.setattr(cuda_copy, "CudaCopier", _FakeCopier)
    monkeypatch.setattr(spec_mod, "make_layout", lambda *a, **k: None)
    monkeypatch.setattr(spec_mod, "TieredWorker", worker)
    spec = spec_mod.TieredOffloadingSpec(_spec_config(_spec_extra(**extra),
                                                      f"sw{abs(hash(str(extra)))}"))
    cuda = SimpleNamespace(tensor=SimpleNamespace(device=SimpleNamespace(type="cuda")))
    try:
        spec.get_worker(SimpleNamespace(tensors=[cuda, cuda]))
        assert made["copier"].load_queue_bytes == spec.cfg.load_queue_bytes
        assert made["copier"].load_direct is spec.cfg.load_direct is extra.get("load_direct",
                                                                                True)
        assert made["copier"].load_waves is spec.cfg.load_waves is extra.get("load_waves", True)
        assert (made["copier"].load_wave_streams == spec.cfg.load_wave_streams
                == extra.get("load_wave_streams", 1))
        assert sys.getswitchinterval() == pytest.approx(want)
    finally:
        if "region" in made:
            made["region"].close(unlink=True)


@pytest.mark.parametrize("key", ["load_direct", "load_waves"])
@pytest.mark.parametrize("value", ["yes", 1, None, "true"])
def test_load_switches_must_be_true_or_false(key, value):
    """``load_direct`` and ``load_waves`` are JSON booleans: anything else is refused with its
    name, before a tier is made."""
    from tiering.config import parse

    with pytest.raises(ValueError, match=f"{key}: expected true or false, got {value!r}"):
        parse({"cpu_bytes_to_use": 1 << 30, key: value})


def test_load_waves_is_on_by_default_and_can_be_turned_off():
    """The default is tiering.settings' LOAD_WAVES (on), and false is taken as given."""
    from tiering.config import parse
    from tiering.settings import LOAD_WAVES

    assert LOAD_WAVES is True
    assert parse({"cpu_bytes_to_use": 1 << 30}).load_waves is True
    assert parse({"cpu_bytes_to_use": 1 << 30, "load_waves": False}).load_waves is False


def test_load_wave_streams_is_one_by_default_two_with_waves_only():
    """The default is tiering.settings' LOAD_WAVE_STREAMS (1: not yet run in vLLM on a GPU);
    2 is taken with waves (the default), refused with ``load_waves`` false, naming both keys;
    without waves the default stays 1."""
    from tiering.config import parse
    from tiering.settings import LOAD_WAVE_STREAMS

    base = {"cpu_bytes_to_use": 1 << 30}
    assert LOAD_WAVE_STREAMS == 1
    assert parse(base).load_wave_streams == 1
    assert parse({**base, "load_wave_streams": 2}).load_wave_streams == 2
    assert parse({**base, "load_wave_streams": 1, "load_waves": False}).load_wave_streams == 1
    assert parse({**base, "load_waves": False}).load_wave_streams == 1
    with pytest.raises(ValueError, match="load_wave_streams: 2 .*needs load_waves true"):
        parse({**base, "load_wave_streams": 2, "load_waves": False})


@pytest.mark.parametrize("value", [0, 3, -1, "2", 2.0, True, None, [2]])
def test_load_wave_streams_must_be_the_integer_1_or_2(value):
    """A JSON integer 1 or 2; anything else (a string, a float, a boolean) is refused with the
    key's name and what was expected, before a tier is made."""
    from tiering.config import parse

    with pytest.raises(ValueError, match=f"load_wave_streams: expected 1 or 2, got "
                                         f"{re.escape(repr(value))}"):
        parse({"cpu_bytes_to_use": 1 << 30, "load_wave_streams": value})


def test_a_cpu_worker_leaves_the_switch_interval(tmp_path, monkeypatch, interval):
    """The feeder runs on CUDA only: a host worker (MemcpyCopier) with the 256 MiB default
    starts no feeder thread and leaves the interval alone."""
    torch = pytest.importorskip("torch")
    import tiering.backends.staging as staging
    from tiering.vllm import TieredOffloadingSpec

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")
    spec = TieredOffloadingSpec(_spec_config(_spec_extra(), "cpuworker"))
    assert spec.cfg.load_queue_bytes == 256 << 20
    w = spec.get_worker(_one_tensor_kv(torch.zeros((4, BLOCK), dtype=torch.int8)))
    try:
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        w.shutdown()


# -- TieredManager.of_scheduler ---------------------------------------------------------------------

class _NoAttrs:
    def __getattr__(self, name):
        raise AttributeError(name)


class _RaisingConnectorProp:
    @property
    def connector(self):
        raise AttributeError("worker side: no connector here")


def _bare_manager(cls=TieredManager):
    return cls.__new__(cls)  # an instance, nothing run


class _OurSubclass(TieredManager):
    pass


@pytest.mark.parametrize("scheduler", [
    None, 0, "scheduler", object(), _NoAttrs(), _RaisingConnectorProp(),
    SimpleNamespace(), SimpleNamespace(connector=None),
    SimpleNamespace(connector=object()),
    SimpleNamespace(connector=SimpleNamespace(connector_scheduler=None)),
    SimpleNamespace(connector=SimpleNamespace(connector_scheduler=SimpleNamespace())),
    SimpleNamespace(connector=SimpleNamespace(connector_scheduler=SimpleNamespace(manager=None))),
    SimpleNamespace(connector=SimpleNamespace(connector_scheduler=SimpleNamespace(
        manager=mock.MagicMock()))),
    SimpleNamespace(connector=SimpleNamespace(connector_scheduler=SimpleNamespace(
        manager=TieredManager))),  # the class, not an instance
    SimpleNamespace(connector=SimpleNamespace(_connectors=[SimpleNamespace(
        connector_scheduler=SimpleNamespace(manager=_bare_manager()))])),  # a MultiConnector
    mock.MagicMock(), mock.Mock(),
], ids=lambda s: type(s).__name__)
def test_of_scheduler_is_none_for_anything_not_our_spec(scheduler):
    assert TieredManager.of_scheduler(scheduler) is None


def test_of_scheduler_finds_our_manager_and_its_subclasses():
    for m in (_bare_manager(), _bare_manager(_OurSubclass)):
        s = SimpleNamespace(connector=SimpleNamespace(connector_scheduler=SimpleNamespace(
            manager=m)))
        assert TieredManager.of_scheduler(s) is m


# -- inside vLLM's scheduler -------------------------------------------------------------------------

def test_vllms_own_scheduler_keeps_the_default_cap(model):
    """Under vLLM's Scheduler (0.32 and 0.33) nothing lifts the default cap."""
    from vllm_harness import Harness

    h = Harness(model, _extra(16, hits_first=False))
    try:
        assert h.manager.load_gate.cap == MAX_LOADING_REQUESTS
        assert h.manager.load_gate.cap_is_default is True
    finally:
        h.manager.shutdown()


@pytest.mark.parametrize("cap", [0, 1, 256])
@pytest.mark.parametrize("which", ["TieringSyncScheduler", "TieringAsyncScheduler"])
def test_a_named_cap_is_kept_under_tiering_scheduler(model, which, cap):
    sched_mod, Harness = _vllm()
    h = Harness(model, _extra(16, cap=cap, hits_first=False),
                scheduler_cls=getattr(sched_mod, which))
    try:
        gate = h.manager.load_gate
        assert h.scheduler._tiering_groups is not None  # the plain layout: the lift was offered
        assert (gate.cap, gate.cap_is_default) == (cap, False)
        assert h.manager.load_slots_free() == (cap or None)
    finally:
        h.manager.shutdown()


@pytest.mark.parametrize("which", ["TieringSyncScheduler", "TieringAsyncScheduler"])
def test_the_default_cap_is_lifted_under_both_tiering_schedulers(model, which, caplog):
    sched_mod, Harness = _vllm()
    with caplog.at_level(logging.INFO, logger="tiering.vllm.scheduler"):
        h = Harness(model, _extra(16, hits_first=False), scheduler_cls=getattr(sched_mod, which))
    try:
        assert h.manager.load_gate.cap == 0 and h.manager.load_slots_free() is None
        lifted = [r for r in caplog.records if "no cap on requests loading" in r.getMessage()]
        assert len(lifted) == 1 and which in lifted[0].getMessage()
    finally:
        h.manager.shutdown()


def test_a_named_cap_of_one_binds_a_burst_under_tiering_scheduler(model):
    """Behaviour, not only the attribute: six hits at once under a named cap of 1 load one at
    a time (scans deferred); a named 0 lets all six load together."""
    sched_mod, _ = _vllm()
    ours = sched_mod.TieringSyncScheduler
    most, deferred = _most_loading(model, ours, _extra(32, cap=1, hits_first=False))
    assert most == 1 and deferred > 0
    assert _most_loading(model, ours, _extra(32, cap=0, hits_first=False)) == (6, 0)


def _sliding_window_harness(monkeypatch, sched_mod):
    """The harness with every layer in a sliding-window KV group (not plain full attention)."""
    import vllm_harness
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    monkeypatch.setattr(vllm_harness, "FullAttentionSpec",
                        lambda **kw: SlidingWindowSpec(sliding_window=4096, **kw))
    return vllm_harness.Harness


def test_a_layout_that_is_not_full_attention_keeps_the_default_cap(model, monkeypatch):
    """TieringScheduler sums as vLLM does (quadratically) for any other layout: the cap that
    bounds that sum must stay."""
    sched_mod, _ = _vllm()
    Harness = _sliding_window_harness(monkeypatch, sched_mod)
    h = Harness(model, _extra(16, hits_first=False),
                scheduler_cls=sched_mod.TieringSyncScheduler)
    try:
        assert h.scheduler._tiering_groups is None
        gate = h.manager.load_gate
        assert (gate.cap, gate.cap_is_default) == (MAX_LOADING_REQUESTS, True)
        assert h.manager.load_slots_free() == MAX_LOADING_REQUESTS
    finally:
        h.manager.shutdown()


@pytest.mark.parametrize("which", ["TieringSyncScheduler", "Scheduler"])
def test_a_layout_that_is_not_full_attention_still_caps_a_burst(model, monkeypatch, which):
    """Behaviour under that layout: the kept default (lowered to 2 here) binds a burst of six
    hits, under TieringScheduler and under vLLM's own scheduler (as it does, with full
    attention, under vLLM's: test_vllm_hits_first.py)."""
    # Regression (a bug older than the cap's new default): under a sliding-window KV group
    # vLLM's connector asks about a request's chunks from its last one backwards; the last
    # chunk (the prompt's tail, never stored) misses, and TieredManager.lookup took a miss at
    # the first-asked key as "the prompt computes" (gate.prompt_computes()), so every step of a
    # hit burst let every hit through: 6 of 6 loaded at once with the cap at 2.
    sched_mod, _ = _vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    import tiering.vllm.load_gate as load_gate

    cls = Scheduler if which == "Scheduler" else getattr(sched_mod, which)
    _sliding_window_harness(monkeypatch, sched_mod)
    monkeypatch.setattr(load_gate, "MAX_LOADING_REQUESTS", 2)
    most, deferred = _most_loading(model, cls, _extra(32, hits_first=False))
    assert (most, deferred > 0) == (2, True), (most, deferred)


def test_a_layout_the_memo_does_not_take_keeps_the_default_cap(model):
    """The same through the class's own test of the layout (a subclass that finds no plain
    full-attention groups, as for a release that keeps them elsewhere)."""
    sched_mod, Harness = _vllm()

    class Other(sched_mod.TieringSyncScheduler):
        def _full_attention_groups(self):
            return None

    h = Harness(model, _extra(16, hits_first=False), scheduler_cls=Other)
    try:
        assert (h.manager.load_gate.cap, h.manager.load_gate.cap_is_default) == (
            MAX_LOADING_REQUESTS, True)
    finally:
        h.manager.shutdown()


@pytest.mark.parametrize("connector", ["none", "vllm-cpu"])
def test_tiering_scheduler_without_our_spec_builds_and_runs(model, connector):
    """No connector, or vLLM's own CPU spec: of_scheduler finds nothing, nothing raises, and
    requests are served."""
    sched_mod, Harness = _vllm()
    from test_vllm_hits_first import prompt

    ex = None if connector == "none" else {
        "spec_name": "CPUOffloadingSpec", "block_size": 128, "cpu_bytes_to_use": 8 * (256 << 10)}
    h = Harness(model, ex, delay=1, scheduler_cls=sched_mod.TieringSyncScheduler)
    assert TieredManager.of_scheduler(h.scheduler) is None
    assert h.scheduler._tiering_hits is None
    h.add("a", prompt(1), max_tokens=2)
    h.run()
    assert "a" in h.cached


def test_two_engines_in_one_process_each_get_their_own_gate(model):
    """Four schedulers built one after another in one process (as two or more engines would
    be): each manager has its own gate with its own cap, and lifting or loading in one does
    not reach another."""
    sched_mod, Harness = _vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    ours = sched_mod.TieringSyncScheduler
    hs = [Harness(model, _extra(16, hits_first=False), scheduler_cls=Scheduler),
          Harness(model, _extra(16, hits_first=False), scheduler_cls=ours),
          Harness(model, _extra(16, cap=3, hits_first=False), scheduler_cls=ours),
          Harness(model, _extra(16, hits_first=False), scheduler_cls=ours),
          Harness(model, _extra(16, hits_first=False), scheduler_cls=Scheduler)]
    try:
        gates = [h.manager.load_gate for h in hs]
        assert len({id(g) for g in gates}) == len(gates)
        assert len({id(h.manager) for h in hs}) == len(hs)
        assert [TieredManager.of_scheduler(h.scheduler) for h in hs] == [h.manager for h in hs]
        assert [g.cap for g in gates] == [MAX_LOADING_REQUESTS, 0, 3, 0, MAX_LOADING_REQUESTS]
        gates[2].started("x")
        gates[2].started("y")
        gates[2].started("z")
        assert gates[2].closed and [g.loading() for g in gates] == [0, 0, 3, 0, 0]
        assert not any(g.closed for i, g in enumerate(gates) if i != 2)
    finally:
        for h in hs:
            h.manager.shutdown()


def test_hits_first_with_no_cap_moves_every_hit_in_the_first_step(model, monkeypatch):
    """Hits first under the lifted default (load_slots_free() None): every hit of the batch is
    moved and loads in the first step, even where the default would have bound (lowered to 2
    here), and every request is served as it would be."""
    sched_mod, _ = _vllm()
    import tiering.vllm.load_gate as load_gate

    monkeypatch.setattr(load_gate, "MAX_LOADING_REQUESTS", 2)
    h, steps = _mixed_batch(model, sched_mod.TieringSyncScheduler, _extra(64))
    try:
        assert h.manager.load_slots_free() is None
        first = {rid: k for k, (rids, _) in enumerate(steps) for rid in rids}
        assert len(first) == 8 and set(first.values()) == {0}, first
        assert h.scheduler._tiering_hits.moved == 8
        assert all(h.cached[f"hit{i}"] >= 384 for i in range(8)), h.cached
        assert all(h.cached[f"new{j}"] == 0 for j in range(4)), h.cached
        assert h.manager.load_gate.loading() == 0 and h.manager.chain.usage()["pinned"] == 0
        assert h.manager.chain.cpu.stats["loads_deferred"] == 0
    finally:
        h.manager.shutdown()


def test_when_the_memo_falls_back_to_vllms_sum_the_default_cap_comes_back(model, monkeypatch):
    """The cap was lifted because TieringScheduler's sum is linear. When the memo fails (an
    error, or a mismatch under TIERING_SCHEDULER_CHECK) the scheduler sums as vLLM does again,
    quadratically in the requests loading, so the default cap that bounds that sum should be in
    force again."""
    # Regression: the fallback to vLLM's quadratic sum left the lifted cap at 0.
    sched_mod, Harness = _vllm()
    h = Harness(model, _extra(16, hits_first=False), scheduler_cls=sched_mod.TieringSyncScheduler)
    try:
        assert h.manager.load_gate.cap == 0

        def broken():
            raise RuntimeError("memo fault")

        monkeypatch.setattr(h.scheduler, "_remembered_total", broken)
        assert h.scheduler._inflight_prefill_reserved_blocks() == 0  # vLLM's sum, no raise
        assert h.scheduler._tiering_failed is True
        assert h.manager.load_gate.cap == MAX_LOADING_REQUESTS, (
            "the scheduler sums quadratically again, with no load cap")
    finally:
        h.manager.shutdown()


# -- helpers: the spec without a scheduler (as tests/test_vllm_spec.py builds it) -------------------

BLOCK = 1 << 16  # worker KV bytes per block


def _spec_extra(**over) -> dict:
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "cpu_bytes_to_use": 8 * BLOCK, "tiers": [{"medium": "cpu"}]}
    extra.update(over)
    return extra


def _spec_config(extra: dict, engine: str):
    """tests/test_vllm_spec.py's config (one group, two layers, 16-token blocks)."""
    from test_vllm_spec import config

    return config(extra, engine)


def _one_tensor_kv(t):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    return CanonicalKVCaches([CanonicalKVCacheTensor(t, BLOCK)], [[CanonicalKVCacheRef(0, BLOCK)]])
