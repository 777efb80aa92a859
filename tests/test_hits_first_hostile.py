"""Hostile tests of hits first (tiering/vllm/hits_first.py), the load gate's per-step limit
(``LoadGate.per_step`` / ``slots_free``) and the manager's ``resident`` / ``load_slots_free``.

The probe alone, on plain objects, against a reference model of what it should do (random
queues, random free slots, faults midway); the gate's ``slots_free`` against a model of its
counters; then vLLM 0.33's real scheduler (tests/vllm_harness.py) driven by seeded random
sequences of hits, partial hits, new, duplicate and short prompts, aborts, connector and GPU
prefix-cache resets and preemptions, with every reorder checked against the reference and the
engine's state checked after every step; the priority policy; faults inside schedule(); and the
starvation case this file found (a stream of hits passing one request without bound, fixed by
the barrier of HITS_FIRST_MAX_PASSES: see the last test)."""

from __future__ import annotations

import logging
import random
from collections import deque
from types import SimpleNamespace

import pytest

# vLLM's scheduler with our spec: the same helpers as the feature's own tests
from test_vllm_hits_first import _extra, _vllm, prompt  # noqa: E402

from tiering.stats import TierStats
from tiering.vllm.hits_first import HitProbe
from tiering.vllm.load_gate import LoadGate

WAITING, RUNNING, PREEMPTED, REMOTE = "waiting", "running", "preempted", "remote"
HPC = 2  # block hashes per chunk in the plain-object tests


# -- the probe on plain objects ------------------------------------------------------------------

class _Manager:
    def __init__(self, resident: set[bytes], free: int | None, fail_at: int | None = None,
                 free_fails: bool = False) -> None:
        self.keys, self.free, self.fail_at, self.free_fails = resident, free, fail_at, free_fails
        self.calls = 0

    def resident(self, key: bytes) -> bool:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("resident fault")
        return key in self.keys

    def load_slots_free(self) -> int | None:
        if self.free_fails:
            raise RuntimeError("slots fault")
        return self.free


def _key(h: bytes, g: int) -> bytes:
    return h + b"|" + str(g).encode()


def _random_queue(rng: random.Random, n: int) -> tuple[deque, set[bytes]]:
    q, resident = deque(), set()
    for i in range(n):
        name = f"q{i}"
        status = rng.choice([WAITING] * 6 + [RUNNING, PREEMPTED, REMOTE])
        computed = rng.choice([0] * 5 + [1, 64, 512])
        nh = rng.choice([0, 1, HPC, HPC + 1, 3 * HPC])  # 0, 1: less than a chunk of hashes
        req = SimpleNamespace(request_id=name, num_computed_tokens=computed, status=status,
                              block_hashes=[f"{name}-{j}".encode() for j in range(nh)])
        if rng.random() < 0.15:
            req.skip_reading_prefix_cache = True
        if rng.random() < 0.1 and q:  # a duplicate prompt: the same hashes as another request
            req.block_hashes = list(rng.choice(list(q)).block_hashes)
        q.append(req)
        if len(req.block_hashes) >= HPC and rng.random() < 0.5:
            resident.add(_key(req.block_hashes[HPC - 1], 0))
        if rng.random() < 0.05:  # the key of another group, which must not count
            resident.add(_key(f"{name}-{HPC - 1}".encode(), 1))
    return q, resident


def _fresh(r) -> bool:
    return r.status == WAITING and not r.num_computed_tokens


def _reference(queue: list, resident: set[bytes], free: int | None, scan_max: int,
               passes: dict[str, int] | None = None, max_passes: int = 2,
               first_key=None) -> list:
    """What hits first promises: scanning from the head, up to ``scan_max`` requests and the
    first barrier (a request that is not a new waiting one, or one passed ``max_passes`` times
    already), the first ``free`` prefix-reading requests whose first chunk is resident, in their
    order, then every other request in its order; the queue as it is where free is 0 or it has
    fewer than 2."""
    if len(queue) < 2 or free == 0:
        return list(queue)
    passes = passes or {}

    def key(r):
        if first_key is not None:
            return first_key(r)
        return _key(r.block_hashes[HPC - 1], 0) if len(r.block_hashes) >= HPC else None

    hits = []
    for i, r in enumerate(queue):
        if i >= scan_max or (free is not None and len(hits) >= free) or not _fresh(r):
            break
        k = None if getattr(r, "skip_reading_prefix_cache", False) else key(r)
        if k is not None and k in resident:
            hits.append(r)
        elif passes.get(r.request_id, 0) >= max_passes:
            break
    chosen = {id(r) for r in hits}
    return hits + [r for r in queue if id(r) not in chosen]


def _ids(q) -> list[int]:
    return [id(r) for r in q]


@pytest.mark.parametrize("seed", range(4))
def test_reorder_matches_the_reference_on_random_queues(seed):
    """Random queues (statuses, computed tokens, short hash lists, skip flags, duplicates,
    other groups' keys), random free slots and scan bounds: the probe's queue is the
    reference's, no request is lost or doubled, the count it returns is the number of hits not
    already in place, and a second pass moves nothing."""
    rng = random.Random(seed)
    for _ in range(150):
        q, resident = _random_queue(rng, rng.randrange(0, 14))
        free = rng.choice([None, None, 0, 1, 2, 3, 5, 100])
        scan_max = rng.choice([1, 2, 3, 5, 4096])
        before = list(q)
        probe = HitProbe(_Manager(resident, free), HPC, 0, _key, WAITING, scan_max=scan_max)
        moved = probe.reorder(q)
        want = _reference(before, resident, free, scan_max)
        assert _ids(q) == _ids(want), ([r.request_id for r in before], [r.request_id for r in q],
                                       [r.request_id for r in want], free, scan_max)
        assert sorted(_ids(q)) == sorted(_ids(before)) and len(set(_ids(q))) == len(q)
        pos = {id(r): i for i, r in enumerate(before)}
        ahead = [r for i, r in enumerate(q) if i < pos[id(r)]]  # hits at the head stay put
        for r in ahead:  # only fresh waiting requests ever go ahead of others
            assert r.status == WAITING and not r.num_computed_tokens, r
        assert moved == len(ahead) == probe.moved and (free is None or moved <= free)
        assert (moved > 0) == (_ids(q) != _ids(before))
        assert probe.reorder(q) == 0 and _ids(q) == _ids(want)  # idempotent


@pytest.mark.parametrize("seed", range(3))
def test_a_fault_midway_leaves_the_queue_as_it_was(seed):
    """The manager raises at the k-th residency question (or when asked for slots): the
    exception comes out of ``reorder`` (HitsFirst turns it off) and the queue is untouched:
    no request dropped or reordered by a half-done pass."""
    rng = random.Random(100 + seed)
    for _ in range(100):
        q, resident = _random_queue(rng, rng.randrange(2, 12))
        before = _ids(q)
        mgr = _Manager(resident, rng.choice([None, 1, 3]), fail_at=rng.randrange(1, 6),
                       free_fails=rng.random() < 0.2)
        probe = HitProbe(mgr, HPC, 0, _key, WAITING)
        try:
            probe.reorder(q)
        except RuntimeError:
            assert _ids(q) == before
            assert probe.moved == 0
        else:  # fewer questions than the fault's position: a normal pass
            assert sorted(_ids(q)) == sorted(before)


def test_a_request_with_less_than_a_chunk_of_hashes_is_never_asked_about():
    asked: list[bytes] = []

    class Mgr(_Manager):
        def resident(self, key: bytes) -> bool:
            asked.append(key)
            return True

    q = deque(SimpleNamespace(request_id=n, num_computed_tokens=0, status=WAITING,
                              block_hashes=[f"{n}-{j}".encode() for j in range(k)])
              for n, k in (("a", 0), ("b", 1), ("c", HPC - 1), ("d", HPC)))
    probe = HitProbe(Mgr(set(), None), HPC, 0, _key, WAITING)
    assert probe.reorder(q) == 1 and [r.request_id for r in q] == ["d", "a", "b", "c"]
    assert asked == [_key(b"d-1", 0)]
    with pytest.raises(ValueError):
        HitProbe(Mgr(set(), None), 0, 0, _key, WAITING)


# -- the load gate's free slots --------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_slots_free_follows_a_model_of_the_gate(seed):
    """Random started/ended/forget/end_step/reset sequences (loads started past the cap too, as
    the gate lets hits through while prompts compute): ``slots_free`` is never negative, is
    None without limits, and equals min(cap - loading, per_step - started this step)."""
    rng = random.Random(seed)
    for cap, per_step in [(0, 0), (1, 0), (0, 1), (2, 1), (3, 2), (1, 3), (4, 0), (0, 3)]:
        gate = LoadGate(cap, TierStats(), per_step)
        loading: dict[str, int] = {}
        started = 0
        for _ in range(300):
            rid = f"r{rng.randrange(6)}"
            op = rng.random()
            if op < 0.35:
                gate.started(rid)
                loading[rid] = loading.get(rid, 0) + 1
                started += 1
            elif op < 0.6:
                gate.ended(rid)
                if loading.get(rid, 0) <= 1:
                    loading.pop(rid, None)
                else:
                    loading[rid] -= 1
            elif op < 0.7:
                gate.forget(rid)
                loading.pop(rid, None)
            elif op < 0.9:
                gate.end_step()
                started = 0
            else:
                gate.reset()
                loading.clear()
            limits = ([cap - len(loading)] if cap else []) + ([per_step - started]
                                                              if per_step else [])
            want = max(0, min(limits)) if limits else None
            assert gate.slots_free() == want, (cap, per_step, loading, started)
            assert gate.loading() == len(loading)
            assert gate.limits == bool(cap or per_step)


# -- inside vLLM 0.33's scheduler ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm")
    from benchmarks.tiny_model import build

    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


def _drain(h, steps: int = 3000) -> None:
    """Every request finished and every job the harness holds completed (the harness's last
    step can issue a store job of a request that just finished: stepped until it is done)."""
    h.run(steps)
    for _ in range(20):
        if not h._pending and not h.scheduler.requests:
            break
        h.step()
    assert not h._pending and not h.scheduler.requests
    h.manager.chain.wait_idle()


class _Checked:
    """Wraps the scheduler's probe: every reorder is compared with the reference (over vLLM's
    real requests and our CPU tier), and the loads started while no prompt computes are counted
    against the free slots the probe was given."""

    def __init__(self, h) -> None:
        from vllm.v1.request import RequestStatus

        self.h, self.W = h, RequestStatus.WAITING
        self.probe = probe = h.scheduler._tiering_hits
        assert probe is not None
        self.mgr = mgr = h.manager
        self.last_moved: list[str] = []
        self.free: int | None = None
        self.gated_starts = 0  # loads started this step while the gate did not let all through
        self.reorders = self.keys_compared = 0
        self.errors: list[AssertionError] = []
        orig = probe.reorder

        def checked(queue):
            try:
                return check(queue)
            except AssertionError as exc:  # HitsFirst would swallow it (and turn itself off)
                self.errors.append(exc)
                raise

        def check(queue):
            before = list(queue)
            passes = {r.request_id: probe.passes(r.request_id) for r in before}
            self.free = free = self._free()
            assert mgr.load_slots_free() == free, (mgr.load_slots_free(), free)
            moved = orig(queue)
            self.reorders += 1
            after = list(queue)
            assert sorted(map(id, after)) == sorted(map(id, before)), "requests lost or added"
            assert len(set(map(id, after))) == len(after), "a request twice in the queue"
            # the module's contract: hits move up to the first barrier (see _reference)
            want = self._reference(before, free, passes)
            assert _ids(after) == _ids(want), ([r.request_id for r in before],
                                               [r.request_id for r in after],
                                               [r.request_id for r in want], free)
            pos = {id(r): i for i, r in enumerate(before)}
            ahead = [r for i, r in enumerate(after) if i < pos[id(r)]]
            for r in ahead:  # preempted, loading, computed, skipping: never ahead
                assert r.status == self.W and r.num_computed_tokens == 0, r
                assert not getattr(r, "skip_reading_prefix_cache", False)
                assert mgr.resident(self.probe.first_key(r))
            assert moved == len(ahead) and (free is None or moved <= free), (moved, free)
            self._check_keys(before)
            self.last_moved = [r.request_id for r in ahead]
            self.gated_starts = 0
            return moved

        probe.reorder = checked
        prepare_load = mgr.prepare_load

        def counted(keys, req_context):
            gate = mgr.load_gate
            if not (gate.computing or gate._offered):
                self.gated_starts += 1
            return prepare_load(keys, req_context)

        mgr.prepare_load = counted

    def verify(self) -> None:
        """After a step: no reorder broke an invariant, and hits first is still on."""
        if self.errors:
            raise self.errors[0]
        assert self.h.scheduler._tiering_hits is self.probe, "hits first turned itself off"

    def _free(self) -> int | None:
        """The load gate's free slots, from its own counters: the cap less the requests
        loading, and the limit per step less the loads started since the last step's end."""
        gate = self.mgr.load_gate
        limits = ([gate.cap - gate.loading()] if gate.cap else []) + (
            [gate.per_step - gate._started_now] if gate.per_step else [])
        return max(0, min(limits)) if limits else None

    def _check_keys(self, queue: list) -> None:
        """The probe's first key is the one vLLM's connector looks up first (its own record,
        where it has looked the request up already)."""
        states = self.h.scheduler.connector.connector_scheduler._req_status
        for r in queue:
            st = states.get(r.request_id)
            keys = st.group_states[self.probe.group_idx].offload_keys if st else None
            if keys:
                assert self.probe.first_key(r) == keys[0], r.request_id
                self.keys_compared += 1

    def _reference(self, queue: list, free: int | None, passes: dict[str, int]) -> list:
        probe = self.probe
        resident = {k for k in map(probe.first_key, queue)
                    if k is not None and self.mgr.resident(k)}
        fresh = [r if r.status != self.W else SimpleNamespace(
            request_id=r.request_id, status=WAITING, num_computed_tokens=r.num_computed_tokens,
            skip_reading_prefix_cache=getattr(r, "skip_reading_prefix_cache", False),
            block_hashes=r.block_hashes, orig=r) for r in queue]
        want = _reference(fresh, resident, free, probe.scan_max, passes, probe.max_passes,
                          lambda r: probe.first_key(getattr(r, "orig", r)))
        return [getattr(r, "orig", r) for r in want]


def _random_run(model, seed: int, cls) -> dict:
    from vllm.v1.request import RequestStatus

    _, Harness = _vllm()
    rng = random.Random(seed)
    cap = rng.choice([0, 1, 2, 3])
    per_step = rng.choice([0, 0, 1, 2])
    rows = rng.choice([5, 9, 256])  # 5, 9: hits are evicted between their arrival and lookup
    h = Harness(model, _extra(rows, cap, per_step), gpu_tokens=rng.choice([2048, 4096, 8192]),
                delay=rng.choice([0, 1, 2, 3]), max_num_seqs=rng.choice([2, 4, 8]),
                batched_tokens=rng.choice([256 + 64, 512 + 64, 1024]),
                prefix_caching=rng.random() < 0.5, scheduler_cls=cls)
    sched, mgr = h.scheduler, h.manager
    chk = _Checked(h)
    probe = chk.probe
    # vLLM 0.32's connector asserts (build_connector_meta: "assert ...is_store") when every
    # running request is preempted by a prefix-cache reset with a load job still in flight,
    # hits first on or off: the forced preemption is exercised on 0.33 only
    import vllm

    preempt_all = tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 33)
    stored: list[list[int]] = []  # prompts served to the end (their chunks stored)
    live: dict[str, list[int]] = {}
    added: dict[str, list[int]] = {}
    aborted: set[str] = set()
    hit_at_add: dict[str, bool] = {}  # first chunk READY in the CPU tier when it arrived
    reset_after: set[str] = set()  # a connector reset came after its arrival
    n = 0

    def toks(k: int) -> list[int]:
        return [rng.randrange(4, 500) for _ in range(k)]

    for _step in range(rng.randrange(25, 45)):
        for _ in range(rng.choice([0, 1, 1, 2, 3, 5])):
            kind = rng.choice(["hit", "hit", "hit", "partial", "new", "dup", "short", "chunk"])
            if kind == "hit" and stored:
                p = list(rng.choice(stored))
            elif kind == "partial" and stored:
                p = rng.choice(stored)[:rng.choice([128, 200, 256])] + toks(rng.randrange(1, 300))
            elif kind == "dup" and live:
                p = list(rng.choice(list(live.values())))
            elif kind == "short":
                p = toks(rng.randrange(1, 128))  # less than one chunk: never a hit
            elif kind == "chunk":
                p = toks(rng.choice([128, 129, 256]))
            else:
                p = toks(rng.randrange(130, 900))
            rid = f"r{n}"
            n += 1
            h.add(rid, p, max_tokens=rng.choice([1, 1, 2, 4]))
            added[rid] = live[rid] = p
            k = probe.first_key(sched.requests[rid])
            hit_at_add[rid] = k is not None and mgr.resident(k)
            if len(p) < 128:
                assert k is None
        op = rng.random()
        if op < 0.12 and sched.requests:  # abort, preferably one just moved ahead or loading
            moved = [r for r in chk.last_moved if r in sched.requests]
            loading = [r.request_id for r in sched.requests.values()
                       if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
            victim = rng.choice(moved or loading or list(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        elif op < 0.17:
            assert sched.reset_connector_cache()
            reset_after.update(added)
            stored.clear()
        elif op < 0.22:
            sched.reset_prefix_cache()  # may refuse while blocks are held: either is fine
        elif (op < 0.32 and preempt_all and sched.running and not sched.kv_holding_waiting
              and all(r.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                      for r in sched.requests.values())):
            try:  # preempts every running request, then resets the GPU prefix cache
                sched.reset_prefix_cache(reset_running_requests=True)
            except RuntimeError:  # blocks an aborted load still holds: preempted, not reset
                pass
        h.step()
        chk.verify()
        mgr.chain.check()
        if chk.free is not None:  # loads the gate admitted beyond its free slots
            assert chk.gated_starts <= chk.free, (chk.gated_starts, chk.free)
        for rid in list(live):
            if rid not in sched.requests:
                if rid not in aborted and rid in h.cached:
                    stored.append(live[rid])
                del live[rid]
    _drain(h)
    chk.verify()
    mgr.chain.check()
    lost = [rid for rid in added if rid not in aborted and rid not in h.cached]
    assert not lost, f"requests never scheduled: {lost}"
    assert mgr.chain.usage()["pinned"] == 0, mgr.chain.usage()
    assert mgr.load_gate.loading() == 0 and mgr.live_requests() == 0
    if rows == 256:  # nothing evicted: a hit stays resident until a connector reset
        missed = [rid for rid in added if hit_at_add[rid] and rid not in reset_after
                  and rid not in aborted and len(added[rid]) > 128 and h.cached[rid] == 0]
        assert not missed, f"CPU hits computed instead of loaded: {missed}"
    info = {"moved": probe.moved, "reorders": chk.reorders, "requests": n,
            "keys": chk.keys_compared}
    mgr.shutdown()
    return info


@pytest.mark.parametrize("cls_name", ["TieringSyncScheduler", "TieringAsyncScheduler"])
def test_random_sequences_keep_every_request_and_every_hit(model, cls_name):
    """Seeded random sequences in vLLM's scheduler (caps 0-3, 0-2 load starts a step, CPU tiers
    of 5, 9 and 256 chunks, small and large step budgets, prefix caching on and off): every
    reorder is the reference's, loads started while nothing computes stay within the free slots,
    the chain is consistent after every step, no request is lost, nothing stays pinned or
    loading, and where nothing is evicted every CPU hit is served from the CPU tier."""
    sched_mod, _ = _vllm()
    cls = getattr(sched_mod, cls_name)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    moved = keys = 0  # 400 seeds of each class passed when this was written
    for seed in range(16):
        info = _random_run(model, seed, cls)
        moved, keys = moved + info["moved"], keys + info["keys"]
    assert moved > 50 and keys > 50, (moved, keys)  # exercised, not merely switched on


def test_priority_policy_keeps_its_order(model):
    """Under vLLM's priority policy hits first stays off: four urgent new prompts (priority 0,
    a step's budget each) arriving after eight CPU hits of priority 5 are scheduled first, and
    the hits load only after them, as vLLM's own priority order says."""
    sched_mod, Harness = _vllm()
    from vllm import SamplingParams
    from vllm.v1.core.sched.request_queue import SchedulingPolicy
    from vllm.v1.request import Request

    class Priority(sched_mod.TieringSyncScheduler):
        def __init__(self, vllm_config, *args, **kw):
            vllm_config.scheduler_config.policy = "priority"
            super().__init__(vllm_config, *args, **kw)

    h = Harness(model, _extra(64, cap=8), gpu_tokens=24 * 512 + 1024, delay=1, max_num_seqs=24,
                batched_tokens=512 + 64, prefix_caching=False, scheduler_cls=Priority)
    assert h.scheduler.policy == SchedulingPolicy.PRIORITY and h.scheduler._tiering_hits is None
    seen = [prompt(200 + i) for i in range(8)]
    for i, p in enumerate(seen):
        h.add(f"fill{i}", p, max_tokens=1)
        h.run()

    def add(rid: str, tokens: list[int], priority: int) -> None:
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        h.scheduler.add_request(Request(request_id=rid, prompt_token_ids=tokens,
                                        sampling_params=sp, pooling_params=None,
                                        priority=priority, block_hasher=h._hasher))

    for i in range(8):
        add(f"hit{i}", seen[i], 5)
    for j in range(4):
        add(f"new{j}", prompt(300 + j), 0)
    first: dict[str, int] = {}
    loads: dict[str, int] = {}
    schedule = h.scheduler.schedule

    def recording(*a, **kw):
        out = schedule(*a, **kw)
        k = h.step_no
        for j in out.kv_connector_metadata.load_jobs.values():
            loads.setdefault(j.req_id, k)
        for rid in out.num_scheduled_tokens:
            first.setdefault(rid, k)
        return out

    h.scheduler.schedule = recording
    _drain(h)
    assert len(loads) == 8, loads
    assert min(loads.values()) >= max(first[f"new{j}"] for j in range(4)), (loads, first)
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(8)), h.cached
    h.manager.shutdown()


@pytest.mark.parametrize("fault", ["slots", "resident", "make_key"])
def test_a_fault_anywhere_in_the_probe_stays_out_of_schedule(model, fault, caplog):
    """The manager's free slots, its residency answer, or vLLM's key function raise inside
    schedule(): schedule() still returns, hits first turns itself off with one error logged,
    every request is served in vLLM's order (the hit from the CPU tier), nothing stays pinned."""
    sched_mod, Harness = _vllm()
    h = Harness(model, _extra(32, cap=2), delay=1, max_num_seqs=8, batched_tokens=512 + 64,
                prefix_caching=False, scheduler_cls=sched_mod.TieringAsyncScheduler)
    a, b = prompt(41), prompt(42)
    h.add("a1", a, max_tokens=1)
    _drain(h)
    probe = h.scheduler._tiering_hits
    assert probe is not None

    def boom(*_a, **_k):
        raise RuntimeError(f"{fault} fault")

    if fault == "slots":
        h.manager.load_slots_free = boom
    elif fault == "resident":
        h.manager.resident = boom
    else:
        probe.make_key = boom
    h.add("b1", b, max_tokens=1)
    h.add("a2", a, max_tokens=1)
    with caplog.at_level(logging.ERROR, logger="tiering.vllm.hits_first"):
        _drain(h)
    assert h.scheduler._tiering_hits is None
    assert len([r for r in caplog.records if "reordering failed" in r.message]) == 1
    assert h.cached["a2"] >= 384 and h.cached["b1"] == 0, h.cached
    assert h.manager.chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
    h.manager.shutdown()


def test_a_prompt_of_one_chunk_or_less_is_never_moved_and_still_served(model):
    """Prompts of 1..127 tokens have no full chunk (no key: never moved); one of exactly 128
    tokens stored before is a hit of 127 tokens (vLLM recomputes the last one). Queued behind a
    new prompt, only the 128- and 129-token hits go ahead; all are served."""
    sched_mod, Harness = _vllm()
    h = Harness(model, _extra(64), delay=1, max_num_seqs=8, batched_tokens=512 + 64,
                prefix_caching=False, scheduler_cls=sched_mod.TieringSyncScheduler)
    chk = _Checked(h)
    ps = {n: prompt(500 + n, n) for n in (1, 64, 127, 128, 129)}
    for n, p in ps.items():
        h.add(f"s{n}", p, max_tokens=1)
        _drain(h)
    h.add("new", prompt(600), max_tokens=1)
    for n, p in ps.items():
        h.add(f"t{n}", p, max_tokens=1)
    h.step()
    chk.verify()
    assert sorted(chk.last_moved) == ["t128", "t129"], chk.last_moved
    _drain(h)
    chk.verify()
    assert h.cached["t128"] == 127 and h.cached["t129"] == 128, h.cached
    assert all(h.cached[f"t{n}"] == 0 for n in (1, 64, 127)), h.cached
    assert h.manager.chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
    h.manager.shutdown()


# Found by this file (it failed before the fix): hits first starved a waiting request that
# computes (or a preempted one) for as long as CPU hits kept arriving. Where the GPU KV cache
# binds, every step's new hits were moved ahead of it, their loads took the blocks it needed,
# vLLM's FCFS scan stopped at it (allocation fails -> break), and the next step's hits passed it
# again: it was not scheduled at all in 40 steps. vLLM's own FCFS order schedules it at once
# (fresh) or after the hit it let through first (preempted). Reproduction: gpu_tokens 2048 (128
# blocks of 16), a new 1536-token prompt, then one 512-token CPU hit (max_tokens 8) a step for
# 40 steps; with or without a cap. Fixed by the barrier: a request passed HITS_FIRST_MAX_PASSES
# times, or one that is not new (preempted), is passed no more.
@pytest.mark.parametrize("case", ["fresh", "preempted"])
@pytest.mark.parametrize("cap", [0, 1])
def test_a_stream_of_hits_does_not_starve_a_request_that_computes(model, case, cap):
    from vllm.v1.request import RequestStatus

    sched_mod, Harness = _vllm()
    started: dict[bool, int | None] = {}
    for hits_first in (False, True):
        h = Harness(model, _extra(64, cap=cap, hits_first=hits_first), gpu_tokens=2048,
                    delay=1, max_num_seqs=8, batched_tokens=512 + 64, prefix_caching=False,
                    scheduler_cls=sched_mod.TieringSyncScheduler)
        assert (h.scheduler._tiering_hits is not None) == hits_first
        seen = [prompt(200 + i) for i in range(4)]
        for i, p in enumerate(seen):
            h.add(f"fill{i}", p, max_tokens=1)
            _drain(h)
        h.add("big", prompt(999, 1536), max_tokens=1)
        if case == "preempted":
            h.step()
            h.step()
            big = h.scheduler.requests["big"]
            assert big.status == RequestStatus.RUNNING and big.num_computed_tokens > 0
            assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
            assert big.status == RequestStatus.PREEMPTED
        started[hits_first] = None
        for k in range(40):
            h.add(f"hit{k}", seen[k % 4], max_tokens=8)
            h.step()
            big = h.scheduler.requests.get("big")
            if started[hits_first] is None and (big is None or big.status in (
                    RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)):
                started[hits_first] = k
        _drain(h)
        h.manager.shutdown()
    assert started[False] is not None and started[False] <= 15, started  # vLLM's order
    assert started[True] is not None and started[True] <= 20, (
        f"'big' not scheduled in 40 steps of a stream of hits (vLLM's order: step "
        f"{started[False]}): {started}")
