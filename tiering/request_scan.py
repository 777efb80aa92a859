"""RequestScan: one request's lookups across vLLM's repeated scans, and what is decided about them.

vLLM's scheduler asks for a request's chunks in prompt order, every step, until a miss, and asks
again next step while any answer was pending. Everything the tiers do for one request is owned
here, in one object per live request (the vLLM adapter keeps them by request id):

* **count once** — ``counted`` holds the chunks whose lookup was counted, so that hit ratios
  stay per chunk however often vLLM asks.
* **protect the request's own prefix** — the same set: a promotion for this request never
  evicts them (vLLM loads a request's hits in one job; a prefix larger than the CPU tier would
  otherwise evict its own head to promote its tail, forever).
* **survey a run of disk chunks** — ``disk_run``: the chunks after the CPU hits that only a file
  tier holds. A state machine with asserted transitions:

      SURVEY --(scan came back to the run)--> LOAD       promotions start, vLLM loads them
            \\                             \\-> RECOMPUTE  the run's first chunk is a miss
             LOAD --(its first chunk found no CPU row)--> RECOMPUTE

  On the first scan each disk chunk is only noted (answer: pending, nothing read). On the next
  scan the whole run is known and the promotion advisor decides once for all of it (``decide``:
  its reads behind the tier's queued reads against its compute behind what the engine was given
  in this step). If reading the run's first chunk already pays, the run is loaded at once:
  every later chunk costs more to compute and no more to read. If neither one chunk nor the
  longest run the prompt allows would pay (the caller knows where the prompt ends), no run
  between them does, and the run is recomputed at once (``_longest_run_declined``).
* **decide** — the decision (``tiering.advisor.Decision``) is counted by outcome and reason on
  the run's first tier (``disk_runs_loaded``/``disk_runs_recomputed``; ``promotions_declined``
  per chunk) and logged at DEBUG, one line per decision. A LOAD counts when its first chunk's
  promotion gets a CPU row; one that finds every row pinned is a miss, which vLLM computes,
  and counts as recomputed (``no_cpu_row``). Either way the run ends where a promotion found
  no row (``DiskRun.cut``): vLLM asks again while the request waits, and a read started then
  would end at a time no decision priced (on the H200's disk-backed sweep, after the GPU had
  computed the rest of the batch). A run recomputed because its tier's
  read rate is unknown has the chain calibrate the tier with the run's chunks.
* **time the prefill** — ``offered``: vLLM offers a step's chunks for storing when it schedules
  their compute, so the chunks a request offers in a step are the prompt tokens that step
  computes for it; the advisor's step clock times the step (``tiering.advisor.StepClock``).
* **wait in the engine's queue** — ``arrived`` (vLLM announced the request) until the
  scheduler reached it (``reached``: its first lookup or offer, or vLLM's report that it
  scheduled it): the advisor counts it among the requests waiting behind a decision
  (``engine_backlog_s``); at ``finished`` it learns what the request computed, if it ran.

The chain (``tiering.chain``) does the routing: ``find_cpu``, ``find_file``, ``promote``,
``read_backlog_bytes``, ``calibrate``. Scheduler thread only.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiering.advisor import Decision, device_ahead
from tiering.prefill_model import stretch_features
from tiering.tier import Lookup

if TYPE_CHECKING:
    from tiering.chain import TierChain

log = logging.getLogger(__name__)


class RunState(enum.Enum):
    SURVEY = "survey"
    LOAD = "load"
    RECOMPUTE = "recompute"


class IllegalRunTransition(AssertionError):
    pass


class QueueState(enum.Enum):
    """Where the request stands in the engine's queue, as the advisor's backlog counts it."""

    UNANNOUNCED = "unannounced"  # scanned without vLLM's announcement (tools, tests)
    WAITING = "waiting"  # announced, not reached by the scheduler yet: counted in the backlog
    REACHED = "reached"  # looked up, offered or scheduled at least once
    GONE = "gone"  # finished


_QUEUE_MOVES = {QueueState.UNANNOUNCED: {QueueState.WAITING, QueueState.REACHED, QueueState.GONE},
                QueueState.WAITING: {QueueState.REACHED, QueueState.GONE},
                QueueState.REACHED: {QueueState.GONE},
                QueueState.GONE: set()}


_ALLOWED = {(RunState.SURVEY, RunState.LOAD), (RunState.SURVEY, RunState.RECOMPUTE),
            (RunState.LOAD, RunState.RECOMPUTE)}


@dataclass
class DiskRun:
    """The request's chunks that only a file tier holds, in prompt order."""

    state: RunState = RunState.SURVEY
    keys: list[bytes] = field(default_factory=list)
    tiers: list[int] = field(default_factory=list)  # file tier (1-based chain index) per key
    first_token: int | None = None  # where the run starts in the prompt, when known
    starts: list[int | None] = field(default_factory=list)  # each key's first token, if known
    # a LOAD whose promotion found no CPU row: loaded up to there (what was promoted), computed
    # from there on; no later scan reads more of it
    cut: bool = False
    _index: dict[bytes, int] = field(default_factory=dict, repr=False)

    def note(self, key: bytes, tier: int, first_token: int | None) -> None:
        assert self.state is RunState.SURVEY, self.state
        assert key not in self._index, "a chunk noted twice"
        if not self.keys:
            self.first_token = first_token
        self._index[key] = len(self.keys)
        self.keys.append(key)
        self.tiers.append(tier)
        self.starts.append(first_token)

    def token_span(self, j: int, chunk_tokens: int) -> tuple[int, int]:
        """The prompt tokens the keys from index ``j`` on cover. A model with several KV groups
        has one key per group for each chunk: positions, where known, count each chunk once."""
        starts = self.starts[j:]
        known = [t for t in starts if t is not None]
        if starts and len(known) == len(starts):
            return min(known), max(known) + chunk_tokens
        first = (self.first_token or 0) + j * chunk_tokens
        return first, first + (len(self.keys) - j) * chunk_tokens

    def position(self, key: bytes) -> int | None:
        """Index of ``key`` in the run, or None if it was not noted."""
        return self._index.get(key)

    def move(self, to: RunState) -> None:
        if (self.state, to) not in _ALLOWED:
            raise IllegalRunTransition(f"disk run: {self.state.value} -> {to.value}")
        self.state = to

    def cut_short(self, promoted: int) -> None:
        """A LOAD's promotion found no CPU row after ``promoted`` of its chunks: the run ends
        there, and with none promoted it is recomputed."""
        assert self.state is RunState.LOAD, self.state
        self.cut = True
        if not promoted:
            self.move(RunState.RECOMPUTE)


class RequestScan:
    """One live request: its lookups, its disk run and its decision, its computed tokens."""

    def __init__(self, chain: TierChain, req_id: str = "") -> None:
        self.chain = chain
        self.req_id = req_id
        self.counted: set[bytes] = set()
        # chunk -> the store tier that answered RETRY for it (a remote tier still asking): the
        # tiers above it counted this lookup then, so the re-asks count there no more
        self.retried: dict[bytes, int] = {}
        self.disk_run = DiskRun()
        self.decision: Decision | None = None
        self.computed_to: int | None = None  # prompt tokens computed so far (offered chunks)
        # where vLLM's lookups began: it asks from where its GPU prefix cache ends (None: not
        # asked yet; -1: asked, position unknown)
        self.first_lookup: int | None = None
        self.last_offer_step: int | None = None  # the chain's step of its last offer
        # a run decided LOAD, until its load reaches the GPU: (its first file tier's id;
        # when it was decided; the bytes of reads queued on that tier then, and of writes)
        self._loading: tuple[int, float, int, int] | None = None
        self.promoted = 0  # chunks this request had promoted from a file tier
        # when its last load landed on the GPU, until its first token (``first_token``), and
        # whether it was the engine's only request then
        self.landed_at: float | None = None
        self.landed_alone = False
        self.computed_at_landing = 0.0  # ``computed_tokens`` when it landed
        self._uncounted_load: str | None = None  # a LOAD's reason until its first promotion
        self.queue = QueueState.UNANNOUNCED
        self.arrived_at: float | None = None  # perf_counter when vLLM announced it (DEBUG lines)
        # the prompt tokens it computed and their attention term (``offered``)
        self.computed_tokens = 0.0
        self.computed_attention = 0.0

    # -- the engine's queue ------------------------------------------------------------------
    def arrived(self) -> None:
        """vLLM announced the request (it waits to be scheduled)."""
        if self.chain.advisor is not None and self.queue is QueueState.UNANNOUNCED:
            self.arrived_at = time.perf_counter()
            self._queue_move(QueueState.WAITING)
            self.chain.advisor.request_waiting()

    def reached(self) -> None:
        """The scheduler reached the request: its first lookup or offer, or vLLM's report that
        it scheduled it (a prompt without a full chunk is neither looked up nor offered)."""
        if self.queue is not QueueState.REACHED:
            self._queue_move(QueueState.REACHED)

    def finished(self) -> None:
        """vLLM finished the request: it waits no more, and the advisor learns what it computed
        — if the scheduler ever reached it: one aborted while waiting, or never tracked,
        computed nothing because it never ran, which says nothing of what requests compute."""
        ran = self.queue is QueueState.REACHED
        self._queue_move(QueueState.GONE)
        if ran and self.chain.advisor is not None:
            self.chain.advisor.request_finished(self.computed_tokens, self.computed_attention)

    def _queue_move(self, to: QueueState) -> None:
        if to not in _QUEUE_MOVES[self.queue]:
            raise AssertionError(f"request queue state: {self.queue.value} -> {to.value}")
        if self.queue is QueueState.WAITING:  # it leaves the backlog
            assert self.chain.advisor is not None
            self.chain.advisor.request_dequeued()
        self.queue = to

    # -- lookups -----------------------------------------------------------------------------
    def lookup(self, key: bytes, first_token: int | None = None,
               prompt_end: Callable[[], int | None] | None = None) -> Lookup:
        """vLLM's lookup of ``key``, which starts at ``first_token`` in the prompt when the
        caller knows. HIT, PENDING (ask again next step), RETRY (a remote tier is still asking:
        ask again next step) or MISS (vLLM computes from here). ``prompt_end``, when the caller
        can tell: where the request's last chunk ends (asked only when a disk run starts)."""
        self.reached()
        if self.first_lookup is None:
            self.first_lookup = first_token if first_token is not None else -1
        chain = self.chain
        count = key not in self.counted
        # a re-ask after a remote tier's RETRY: the tiers above it counted this lookup already
        retry_at = self.retried.get(key, 0)
        found = chain.find_cpu(key, count and not retry_at, per_request=True)
        if found is not Lookup.MISS:
            if found is Lookup.HIT:
                self.counted.add(key)
            return found
        found, at = chain.find_file(key, count, retry_at)
        if found is Lookup.RETRY:  # a remote tier is still asking: ask again next step
            self.retried[key] = at
            return Lookup.RETRY
        i: int | None = at if found is Lookup.HIT else None
        if i is not None and chain.advisor is not None:
            state = self._disk_decision(key, i, first_token, prompt_end)
            if state is None:  # surveyed: decided when vLLM asks again next step
                return Lookup.PENDING
            if state is RunState.RECOMPUTE:
                i = None  # recomputing is faster than reading it
        # counted once, whatever comes of it: vLLM asks again while the request waits (no CPU
        # row now, or the read fails and the chunk is a miss after all)
        self.counted.add(key)
        if i is None or self.disk_run.cut:
            return Lookup.MISS
        found = chain.promote(key, i, self.counted)
        if found is Lookup.PENDING:
            self.promoted += 1
        elif found is Lookup.MISS and self.disk_run.state is RunState.LOAD:
            self.disk_run.cut_short(self.promoted)
        if self._uncounted_load is not None:
            self._count_load(found, i)
        return found

    def _count_load(self, first: Lookup, i: int) -> None:
        """Count the run decided LOAD by what its first promotion got (``first``, from file tier
        ``i``): loaded if a read started, else recomputed for want of a CPU row (vLLM computes
        from a miss). Counting at the decision would report loads that never read: on the H200's
        disk-backed sweep most LOADs of the 100% batch found every CPU row pinned."""
        reason, self._uncounted_load = self._uncounted_load, None
        stats = self.chain.tiers[i].stats
        if first is Lookup.PENDING:
            stats.add(f"disk_runs_loaded:{reason}")
            return
        stats.add("disk_runs_recomputed:no_cpu_row")
        self._loading = None  # nothing is read: no load to learn from
        assert self.chain.advisor is not None
        self.chain.advisor.probe_ended(i)
        log.debug("request %s: the disk run decided LOAD (%s) found no CPU row; recomputed",
                  self.req_id, reason)

    def _disk_decision(self, key: bytes, i: int, first_token: int | None,
                       prompt_end: Callable[[], int | None] | None) -> RunState | None:
        """Load the request's run of disk hits, or recompute it? None: still surveying."""
        chain, run = self.chain, self.disk_run
        advisor = chain.advisor
        assert advisor is not None
        if run.state is not RunState.SURVEY:
            return run.state
        j = run.position(key)
        if j is None:  # first scan: note it, answer pending, read nothing yet
            first = not run.keys
            if first and first_token is None:  # position unknown: count chunks
                first_token = len(self.counted) * advisor.chunk_tokens
            run.note(key, i, first_token)
            if first and first_token is not None and advisor.first_chunk_pays(
                    i, first_token, chain.read_backlog_bytes(), chain.write_backlog_bytes()):
                # pays at its start, so for any length (or the engine is not measured yet)
                self._decided(Decision(True, "faster" if advisor.prefill.known()
                                       else "unmeasured"), 0, by_first_chunk=True)
                return run.state
            if first and first_token is not None and prompt_end is not None:
                longest = self._longest_run_declined(i, first_token, prompt_end())
                if longest is not None:
                    self._decided(longest[0], 0, span=longest[1])
                    return run.state
            self.counted.add(key)
            return None
        start, end = run.token_span(j, advisor.chunk_tokens)
        # the first-token tail is the load's own only where nothing is computed after the run
        # (a cold rest of the prompt hides it behind its forward pass, loaded or recomputed)
        last = prompt_end() if prompt_end is not None else None
        to_end = last is None or last - end < advisor.chunk_tokens
        self._decided(advisor.decide(run.tiers[j:], start, end, chain.read_backlog_bytes(),
                                     chain.write_backlog_bytes(), tail=to_end), j)
        return run.state

    def _longest_run_declined(self, i: int, first_token: int, prompt_end: int | None
                              ) -> tuple[Decision, tuple[int, int]] | None:
        """The decision for the longest run the prompt allows from ``first_token`` on (every
        chunk to the prompt's last one on tier ``i``), and its tokens, if it is to recompute;
        else None (survey: the run may be shorter, and a shorter run could differ).

        Why a declined longest run settles every shorter one: a chunk costs more to compute the
        further into the prompt it lies (attention over the tokens before it) and no more to
        read, and a run's fixed costs (the load's extra steps, the reads queued ahead, the
        engine's queue) are paid once, so what loading saves over recomputing is convex in the
        run's length; below zero at one chunk and at the longest run, it is below zero for
        every length between (checked against the advisor by ``tests/test_advisor.py``).

        Without this, a request whose prompt starts with a disk run waits one step for a
        decision that cannot load. (That wait was suspected for the H200 disk-backed sweep's
        slow 100% batch, 0.64-0.69x no offloading; with this in place the batch ran at 0.68x all
        the same: docs/benchmarks.md, fifth run.) Only with one file tier: a run spread over tiers read in parallel could read
        faster than all of it on tier ``i``. A model with several KV groups reads one row per
        group and chunk: counting one row per chunk prices the load low, so a decline stays
        sound."""
        chain, advisor = self.chain, self.chain.advisor
        assert advisor is not None
        if (len(chain.file_tiers) != 1 or prompt_end is None or prompt_end <= first_token
                or not advisor.read_rate(i)):  # unmeasured: the survey's rows calibrate it
            return None
        reads, writes = chain.read_backlog_bytes(), chain.write_backlog_bytes()
        # one chunk, priced alone: first_chunk_pays also asks each chunk to pay on its own, so
        # its no does not say that a one-chunk run would be recomputed
        # both priced without the first-token tail, which only a run to the prompt's end pays:
        # so what loading saves stays convex in the run's length, and a longest run declined
        # without it is declined with it too
        if advisor.decide([i], first_token, None, reads, writes, count=False, tail=False).load:
            return None
        chunks = -(-(prompt_end - first_token) // advisor.chunk_tokens)
        d = advisor.decide([i] * chunks, first_token, prompt_end, reads, writes, tail=False)
        if d.load:
            return None
        return d, (first_token, prompt_end)

    def _decided(self, d: Decision, j: int, span: tuple[int, int] | None = None,
                 by_first_chunk: bool = False) -> None:
        """Apply and account decision ``d`` for the run from its ``j``-th chunk on (``span``:
        the tokens it was priced for, when not the noted chunks'; ``by_first_chunk``: its first
        chunk decided it, unpriced, before the run was surveyed)."""
        chain, run = self.chain, self.disk_run
        advisor = chain.advisor
        assert advisor is not None
        now = time.perf_counter()
        d = advisor.admit(d, run.tiers[j], now)  # one load at a time while its cost is unknown
        self.decision = d
        run.move(RunState.LOAD if d.load else RunState.RECOMPUTE)
        first_tier = chain.tiers[run.tiers[j]]
        start, end = span if span is not None else run.token_span(j, advisor.chunk_tokens)
        if d.load:
            self._uncounted_load = d.reason  # counted by its first promotion (_count_load)
            t = run.tiers[j]
            self._loading = (t, now, chain.read_backlog_bytes()[t],
                             chain.write_backlog_bytes()[t])
        else:
            first_tier.stats.add(f"disk_runs_recomputed:{d.reason}")
            for t in run.tiers[j:]:
                chain.tiers[t].stats.add("promotions_declined")
            advisor.queue_compute(start, end)  # the engine computes it in this step
            if d.reason == "unmeasured":
                for t in sorted(set(run.tiers[j:])):
                    chain.calibrate(t, [k for k, tt in zip(run.keys[j:], run.tiers[j:],
                                                           strict=True) if tt == t])
        if log.isEnabledFor(logging.DEBUG):
            waited = ("" if self.arrived_at is None
                      else f", {now - self.arrived_at:.4f} s after its arrival")
            # a run loaded at its first chunk was not priced whole (that chunk paid alone, or
            # the engine is unmeasured): it loads whatever its length; an unmeasured tier's
            # run is recomputed unpriced while the tier is measured
            if by_first_chunk:
                priced = "its first chunk decided the run"
            elif math.isnan(d.load_s) or math.isnan(d.recompute_s):
                priced = "not priced"
            else:
                priced = f"load {d.load_s:.4f} s vs recompute {d.recompute_s:.4f} s"
            log.debug("request %s: %s %d disk chunks, tokens %d-%d (%s%s): %s; read backlog "
                      "%s B, writes %s B; %s", self.req_id, d.outcome, len(run.keys) - j, start,
                      end, d.reason, waited, priced, chain.read_backlog_bytes(),
                      chain.write_backlog_bytes(), advisor.describe())

    def load_completed(self, now: float | None = None, alone: bool = False) -> None:
        """vLLM finished loading the request's hits to the GPU (``alone``: the engine's only
        request): its first token is timed from now (``first_token``). If a disk run was loaded,
        the advisor learns what the load cost beyond its reads (its promoted bytes and the reads
        queued ahead of them and the writes they shared the device with, at the tier's read rate
        now) and beyond the engine's steps that computed prompts meanwhile."""
        now = time.perf_counter() if now is None else now
        self.landed_at, self.landed_alone = now, alone
        self.computed_at_landing = self.computed_tokens
        advisor = self.chain.advisor
        if self._loading is None or advisor is None:
            return
        tier, decided, backlog, writing = self._loading
        self._loading = None
        rate = advisor.read_rate(tier)
        if rate and self.promoted:
            own = self.promoted * self.chain.row_bytes
            read_s = (device_ahead(backlog, own, writing) + own) / rate
            took, busy = now - decided, advisor.engine_busy_s(decided)
            advisor.observe_load(tier, read_s, took, busy)
            self.chain.offer_advisor_state()
            # where a disk hit's time went, beside its decision line: reads (at the rate this
            # load left), the engine's prompt steps meanwhile, and the rest
            log.debug("request %s: its disk run reached the GPU %.4f s after its decision: "
                      "%d chunks read, priced %.4f s at %.3g GB/s now; the engine computed "
                      "prompts for %.4f s of it; %.4f s beyond both", self.req_id, took,
                      self.promoted, read_s, rate / 1e9, busy, max(0.0, took - max(read_s, busy)))

    def first_token(self, now: float | None = None, alone: bool = False) -> None:
        """vLLM returned the request's first token (our connector saw it; ``alone``: the
        engine's only request). If its hits had landed, it was alone from then on and it
        computed less than a chunk after the landing (its load reached the prompt's end), the
        advisor learns the first-token tail: what a loaded request waits beyond its load on an
        otherwise idle engine (``PromotionAdvisor.observe_first_token``). Once per landing."""
        landed, self.landed_at = self.landed_at, None
        advisor = self.chain.advisor
        if landed is None or advisor is None:
            return
        took = (time.perf_counter() if now is None else now) - landed
        if not (self.landed_alone and alone):
            return  # other requests' steps in it: a batch's wait, which a recompute pays too
        if self.computed_tokens - self.computed_at_landing >= advisor.chunk_tokens:
            return  # the prompt's cold rest (or a failed load's recompute) was computed in it
        advisor.observe_first_token(took)
        self.chain.offer_advisor_state()
        log.debug("request %s: its first token came %.4f s after its load landed on the GPU, "
                  "the engine otherwise idle; first-token tail now %.4f s", self.req_id, took,
                  advisor.first_token_tail_s)

    # -- computed tokens ---------------------------------------------------------------------
    def offered(self, ends: Sequence[int]) -> None:
        """vLLM offered, in the step being scheduled, the chunks of this request that end at
        prompt positions ``ends`` (one per chunk; several KV groups give the same end): the step
        computes them. A request's first offer, or one right after its offer of the previous
        step, is prefill; an offer after steps without any is a chunk completed by decoding
        (one token a step): no prefill sample."""
        advisor = self.chain.advisor
        if advisor is None or not ends:
            return
        self.reached()
        step, n = self.chain.steps, max(ends)
        k = min(ends) - advisor.chunk_tokens
        if self.computed_to is None:
            # vLLM offers a request's chunks from its first, those its GPU prefix cache held
            # too, but looks up only from where that cache ends, and not at all with less
            # than a chunk left: the step computes from the first lookup on (on the H200 a
            # 32k prompt cached on the GPU was otherwise timed as 32,768 tokens in 36 ms)
            if self.first_lookup is None:
                k = n
            elif self.first_lookup > 0:
                k = max(k, self.first_lookup)
        else:
            if self.last_offer_step is not None and self.last_offer_step < step - 1:
                k = n  # decoding
            else:
                # from where it got to: a chunk vLLM did not offer was computed all the same,
                # and one it offers again was not. vLLM offers a request's chunks from the
                # first again after a connector reset, and after a preemption, when the
                # resumed request loads them from the CPU tier it stored them in (vLLM 0.33):
                # neither is compute. (A preempted request whose chunks were lost recomputes
                # them uncounted: the rarer case, and a sample too small, not a wrong one.)
                k = max(k, self.computed_to)
        advisor.computes(k, n)
        if 0 <= k < n:
            tokens, attention = stretch_features(k, n)
            self.computed_tokens += tokens
            self.computed_attention += attention
        self.computed_to = max(n, self.computed_to or 0)
        self.last_offer_step = step
