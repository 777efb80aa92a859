"""PromotionAdvisor: is reading a request's disk hits faster than computing those tokens again?

A disk hit only helps if loading its KV takes less time than the engine takes to recompute the
same tokens. Both costs are measured while serving:

* **read rate** of each file tier: bytes per second of each promotion (or calibration) batch,
  from the tier's own completion times (each read run reports the seconds since its batch was
  submitted; the batch's longest one is what a request waits for), smoothed. Until a tier has
  been read, the chain measures it with a calibration read no request waits for.
* **prefill cost** of the engine per *step*: ``c`` a step, ``a`` a prompt token, ``b`` a token
  per earlier token, fitted to the steps the engine ran (``tiering.prefill_model``).

* **load overhead** of each file tier: what a loaded run took from its decision until vLLM had
  its KV on the GPU, less its reads at the tier's rate and less the time the engine spent
  computing prompts meanwhile (``observe_load``, from the request's scan): the reads seen at a
  step end, the copy to the GPU, the request's next step. On an idle H200 it was 80-150 ms,
  while the fitted step cost ``c`` was 0. Under a 128-prompt batch the same load took 0.8-1.2
  s, waiting behind three full steps that a recomputed run waits for too: counted whole, that
  wait had every later run recomputed.

* **first-token tail**: what a request whose hits were loaded waited from the load's landing on
  the GPU to its first token, measured while it was the engine's only request and had less
  than a chunk left to compute (``observe_first_token``). vLLM launches a step's kernels
  before it takes the previous step's output, so the step that computes a loaded request's
  last tokens returns its token only after the next step's launch: in eager mode on an H100 (2026-12-06i) 79-122 ms for the 8B shape and
  185-270 ms for the 32B one, in vLLM's spec as in ours, while the fitted step cost ``c`` was
  4 ms. A recomputed prompt waits for the same launch, hidden behind its forward pass when that
  is longer (8k: 440 ms for a 433 ms forward; 2k: 97-167 ms for a 69 ms one). Unpriced, it had
  the restarted engine load an 8k disk hit (priced 0.355 s against 0.432 s of compute; it took
  484-518 ms against 447 recomputed). On an idle engine a load that reaches the prompt's end
  is priced with it, and its recompute at no less; on a busy one both wait behind the same
  steps, and behind a cold rest of the prompt both wait for its forward pass: left out.

The measurements are kept across restarts: each file tier saves its rate, its load overhead and
the prefill fit at shutdown (``tier_state``, the tier's ``advisor.json``) and a new engine starts
from them (``restore_tier``). Without that, a restarted H200 engine loaded its first 2k and 8k
disk hits (216 and 499 ms against 98 and 443 to recompute) while it measured nothing.

A read batch of fewer than ``rate_min_rows`` rows times latency more than a rate: it
gives a first rate only (on the H200's RAM disk a 4-row calibration read at 1.14 GB/s, a 32k
prompt's 2048 rows at 2.9 GB/s; with the small batch's rate the 32k disk hit was recomputed).

The decision is per request, for the whole run of chunks it would read from disk (after its
CPU hits). Loading costs the reads — the run's own bytes **plus the reads queued ahead of it on
the same tier** (under many requests the disk is a shared queue) — plus the tier's load
overhead (at least ``ADVISOR_LOAD_STEPS`` extra steps, ``c`` each); recomputing costs the
run's ``a`` and ``b`` terms **plus the compute already given to the engine in this step**
(requests decided, or missed, before this one), or **the compute of the requests waiting behind
it**, if more. So the disk takes runs while its queue is shorter than the engine's, and the two
work side by side: throughput approaches the engine's rate plus the disk's, and never falls
below the engine's alone. Alone (nothing queued, nobody waiting) this is the plain comparison
of the two costs to the first token: a load adds the first-token tail, and a recompute takes
no less than it.

The waiting requests (``engine_backlog_s``): vLLM's scheduler asks about a request only when it
is about to schedule it, with the step's token budget left, so at a decision the requests behind
it have not been seen; vLLM announces each one on arrival (``on_new_request``), without its
length. The backlog is their number times the compute of a recent request (the prompt tokens
it had computed when it finished, loaded ones not counted: a moving average of its per-token
and attention features, priced with the fit). A run loaded while the engine computes those
requests costs the engine nothing: without this, on the H200's disk-backed sweep (128 prompts
at once) the advisor saw only the step it was scheduling and loaded 5-10 of 128 runs, and the
disk added nothing. A loaded request waits for its reads up to what the last waiting one waits
for the engine anyway (less the payoff margin), and never more than
``ADVISOR_BACKLOG_HORIZON_S``: vLLM holds a loading request's GPU blocks from the decision on.

Reading costs the same per chunk wherever it is, computing costs more per chunk the further
into the prompt, so the request's total time is concave in the number of disk chunks it loads,
and its minimum is at one end: load the whole run or none of it. The request's scan
(``tiering.request_scan``) surveys the run first and asks ``decide`` once — unless its first
chunk alone pays (``first_chunk_pays``): then every longer run pays too, and loading starts at
once. Before the engine's prefill has been measured at all, a disk hit is loaded (there is
nothing to weigh it against); before a tier's read rate is known, its runs are recomputed while
a calibration read measures it. Every decision has an outcome and a reason (``Decision``), which
the scan counts on the run's first tier and logs at DEBUG.

All calls come from the scheduler thread; nothing here blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tiering.prefill_model import PrefillModel
from tiering.settings import (
    ADVISOR_BACKLOG_HORIZON_S,
    ADVISOR_BACKLOG_WEIGHT,
    ADVISOR_EWMA_WEIGHT,
    ADVISOR_LOAD_STEPS,
    ADVISOR_PAYOFF_MARGIN,
    ADVISOR_PROBE_HOLD_S,
    ADVISOR_RATE_MIN_BYTES,
    ADVISOR_RATE_MIN_ROWS,
    ADVISOR_RATE_MIN_RUNS,
    ADVISOR_REPROBE_AFTER,
)
from tiering.stats import LOAD_REASONS, RECOMPUTE_REASONS  # noqa: F401 (Decision.reason)
from tiering.step_clock import StepClock


def device_ahead(queued: int, own: int, writing: int) -> int:
    """Bytes the device moves before a read of ``own`` bytes is in: the reads ``queued`` ahead of
    it, plus, while the tier writes, as many bytes of writes again as the reads' (at most what
    is being written). Reads go first on the tier's I/O threads but share the device with the
    write runs in flight, about half each. On the H200's virtual disk a prefill batch of 128
    prompts, over a CPU tier of a quarter batch, loaded 13 runs at the idle read rate while the
    writer streamed the batch's stores: 0.76x the throughput of no offloading."""
    return queued + min(writing, queued + own)


def rate_min_rows(row_bytes: int) -> int:
    """Rows a read batch needs to time a tier's rate rather than its latency (settings:
    ADVISOR_RATE_MIN_BYTES of rows, within [ADVISOR_RATE_MIN_RUNS, ADVISOR_RATE_MIN_ROWS])."""
    return max(ADVISOR_RATE_MIN_RUNS,
               min(ADVISOR_RATE_MIN_ROWS, -(-ADVISOR_RATE_MIN_BYTES // max(1, row_bytes))))


class _Ewma:
    __slots__ = ("value", "weight")

    def __init__(self, weight: float = ADVISOR_EWMA_WEIGHT) -> None:
        self.value: float | None = None
        self.weight = weight

    def add(self, x: float) -> None:
        w = self.weight
        self.value = x if self.value is None else (1 - w) * self.value + w * x


@dataclass(frozen=True)
class Decision:
    """What the advisor decided for one disk run, and why (seconds as it priced them)."""

    load: bool
    reason: str  # LOAD_REASONS if load, else RECOMPUTE_REASONS
    load_s: float = math.nan  # reads (queue ahead included) + the load's extra steps
    # the run's compute + what the engine was given before it, or the waiting requests'
    # compute if more (what a load may take without costing the engine anything)
    recompute_s: float = math.nan

    @property
    def outcome(self) -> str:
        return "load" if self.load else "recompute"


class PromotionAdvisor:
    def __init__(self, n_file_tiers: int, row_bytes: int, chunk_tokens: int,
                 prefill_tokens_per_s: float | None = None, step_lag: int = 0,
                 step_outputs: bool = True, tokens_after_end: bool | None = None,
                 step_forward: bool = False) -> None:
        self.row_bytes, self.chunk_tokens = row_bytes, max(1, chunk_tokens)
        self.prefill = PrefillModel(prefill_tokens_per_s)
        self.clock = StepClock(self.prefill, step_lag, step_outputs, tokens_after_end,
                               step_forward)
        # per file tier, by the chain's tier id (1 = the first file tier; 0 is the CPU tier)
        self._read = {t: _Ewma() for t in range(1, n_file_tiers + 1)}  # bytes/s
        # a tier's rate is provisional while it comes from a batch of too few rows only
        self._provisional = dict.fromkeys(self._read, False)
        # seconds a load takes beyond its reads (measured: ``observe_load``), per file tier
        self._overhead = {t: _Ewma() for t in self._read}
        # seconds from a load's landing to the request's first token, the engine otherwise idle
        # (``observe_first_token``); engine-wide
        self._tail = _Ewma()
        self._declined = dict.fromkeys(self._read, 0)
        self._remeasure = dict.fromkeys(self._read, False)
        # tier -> when its probe (a load while its load overhead is unknown) was decided
        self._probe: dict[int, float] = {}
        self._queued_s = 0.0  # compute given to the engine in the step being scheduled
        # requests announced and not yet scheduled, and what a recent request computed (its
        # prompt tokens and their attention term): the engine's backlog (engine_backlog_s)
        self.waiting_requests = 0
        self._arrivals_counted = False  # has vLLM announced a request (``request_waiting``)?
        self._request_tokens = _Ewma(ADVISOR_BACKLOG_WEIGHT)
        self._request_attention = _Ewma(ADVISOR_BACKLOG_WEIGHT)

    # -- measurements ------------------------------------------------------------------------
    def observe_read_batch(self, tier: int, nbytes: int, seconds: float,
                           full: bool | None = None) -> None:
        """A promotion or calibration batch of file tier ``tier`` (the chain's tier id) finished:
        its bytes and its longest read's seconds since the batch was submitted. A batch of fewer than
        ``rate_min_rows`` rows times latency more than a rate: it gives a provisional
        first rate only (the tier is measured again as soon as it can be read in a full
        batch, which then replaces it), never one that moves a measured rate. ``full``: the
        caller's say (a tier too small to hold that many rows reads full batches of fewer)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = self._read[tier]
        if full is None:
            full = nbytes >= rate_min_rows(self.row_bytes) * self.row_bytes
        if full:
            if self._provisional[tier]:
                rate.value = None  # replaced, not averaged with
            rate.add(nbytes / seconds)
            self._provisional[tier] = False
        elif rate.value is None:
            rate.add(nbytes / seconds)
            self._provisional[tier] = True

    def observe_load(self, tier: int, read_s: float, seconds: float,
                     engine_s: float = 0.0) -> None:
        """A run of file tier ``tier`` decided LOAD with reads priced at ``read_s`` (its own and
        those queued ahead) reached the GPU ``seconds`` after the decision, and the engine
        computed prompts during the first ``engine_s`` of them (``engine_busy_s``): what is left
        beyond both is what a load costs beyond its reads. The wait behind the engine's steps is
        not such a cost: the reads ran beside them, and a recomputed run waits for them too (on
        the H200's 128-prompt sweep a 64 MiB read's load took 0.8-1.2 s, three steps of 0.4 s,
        and priced as its overhead it had every later run recomputed)."""
        if (0 <= read_s < math.inf and 0 < seconds < math.inf
                and 0 <= engine_s < math.inf):
            self._overhead[tier].add(max(0.0, seconds - max(read_s, engine_s)))

    def observe_first_token(self, seconds: float) -> None:
        """A request whose hits were loaded, the engine's only request, gave its first token
        ``seconds`` after its load landed on the GPU (``RequestScan.first_token``)."""
        if 0 < seconds < math.inf:
            self._tail.add(seconds)

    @property
    def first_token_tail_s(self) -> float:
        """The measured first-token tail, or 0 before any was measured."""
        return self._tail.value or 0.0

    def _idle_tail_s(self) -> float:
        """The first-token tail where a decision made now should price it: on an idle engine
        (nothing given to it in this step, nothing computed in its last step, nobody waiting);
        0 on a busy one, where a loaded request's tokens join steps the engine runs anyway."""
        if self._queued_s or self.engine_queue_s or self._backlog_term():
            return 0.0
        return self.first_token_tail_s

    def engine_busy_s(self, since: float) -> float:
        """How long after ``since`` the engine kept computing prompt tokens (the end of the last
        step interval that ran a prefill, ``StepClock.busy_until``), for ``observe_load``."""
        busy = self.clock.busy_until
        return max(0.0, busy - since) if busy is not None else 0.0

    def observe_prefill(self, first_token: int, end_token: int, seconds: float) -> None:
        """A step computed only tokens ``[first_token, end_token)`` of one request."""
        self.prefill.add(first_token, end_token, seconds)

    def computes(self, first_token: int, end_token: int) -> None:
        """The step being scheduled computes tokens ``[first_token, end_token)`` of a request
        (vLLM offered them for storing)."""
        self.clock.computes(first_token, end_token)

    def queue_compute(self, first_token: int, end_token: int) -> None:
        """A request was given tokens ``[first_token, end_token)`` to compute in this step (a
        recomputed run): later runs of the step wait behind them if they are recomputed too."""
        if self.prefill.known():
            self._queued_s += self.prefill.seconds(first_token, end_token)

    @property
    def engine_queue_s(self) -> float:
        """The engine's compute ahead of a run recomputed now: what it was given in this step
        so far, or — if more — what its last step computed (a busy engine fills every step to
        its token budget, with cold prompts too, which are only seen once offered: a run
        recomputed now finishes with the step it joins)."""
        tokens, attention = self.clock.last_step()
        last = self.prefill.a * tokens + self.prefill.b * attention
        if self._arrivals_counted:
            # vLLM announces arrivals: the step cannot hold more than what it was given and what
            # still waits (at a batch's end the last full step said 0.42 s while 7 prompts
            # waited: runs loaded then landed after the engine had finished, +25% makespan)
            last = min(last, self._queued_s + self.engine_backlog_s)
        return max(self._queued_s, last)

    def request_waiting(self) -> None:
        """A request arrived: the engine has it to compute, not yet scheduled."""
        self.waiting_requests += 1
        self._arrivals_counted = True

    def request_dequeued(self) -> None:
        """A waiting request left the queue: the scheduler reached it, or it finished first."""
        self.waiting_requests = max(0, self.waiting_requests - 1)

    def request_finished(self, tokens: float, attention: float) -> None:
        """A request ended having computed prompt tokens with these features (the sums of
        ``stretch_features`` over its steps; zeros for one that computed none)."""
        if 0 <= tokens < math.inf and 0 <= attention < math.inf:  # NaN fails both
            self._request_tokens.add(tokens)
            self._request_attention.add(attention)

    def recent_request(self) -> tuple[float | None, float | None]:
        """What a recent request computed: the moving averages of its prompt tokens and their
        attention term (None before any request finished)."""
        return self._request_tokens.value, self._request_attention.value

    @property
    def engine_backlog_s(self) -> float:
        """The compute of the requests waiting to be scheduled, priced as the recent ones: what
        the engine has to do while a run decided now loads."""
        tokens, attention = self.recent_request()
        if not self.waiting_requests or tokens is None or attention is None:
            return 0.0
        return self.waiting_requests * (self.prefill.a * tokens + self.prefill.b * attention)

    def _backlog_term(self) -> float:
        """The backlog as a decision may use it: at most ``ADVISOR_BACKLOG_HORIZON_S``."""
        return min(self.engine_backlog_s, ADVISOR_BACKLOG_HORIZON_S)

    def step_end(self, now: float) -> None:
        self.clock.step_end(now)
        self._queued_s = 0.0

    def step_output(self, now: float) -> None:
        """The engine took back the oldest scheduled step's output at ``now``
        (``StepClock.output``)."""
        self.clock.output(now)

    def forward_step(self) -> int | None:
        """A number for the step whose scheduling just ended, for the worker to time its
        forward pass under (``StepClock.forward_step``); None when not timed so."""
        return self.clock.forward_step()

    def forward_times(self, times: dict[int, float]) -> None:
        """The worker's forward-pass seconds by step number (``StepClock.forward_times``)."""
        self.clock.forward_times(times)

    # -- the decision --------------------------------------------------------------------------
    def read_rate(self, tier: int) -> float | None:
        return self._read[tier].value

    def needs_measuring(self, tier: int) -> bool:
        """Should the chain issue a calibration read of ``tier`` (the chain's tier id)? Its rate
        is unknown or provisional, or its runs were declined ``ADVISOR_REPROBE_AFTER`` times since it was
        last read."""
        return (self._read[tier].value is None or self._provisional[tier]
                or self._remeasure[tier])

    def rate_is_provisional(self, tier: int) -> bool:
        """Is ``tier``'s rate a first one from a batch of too few rows?"""
        return self._provisional[tier]

    def measuring(self, tier: int) -> None:
        """A calibration read of ``tier`` was issued."""
        self._remeasure[tier] = False
        self._declined[tier] = 0

    def load_overhead(self, tiers: Sequence[int] = ()) -> float:
        """What a load from ``tiers`` adds to its reads: ``ADVISOR_LOAD_STEPS`` times a step's
        fixed cost, or more if this engine's loads from those tiers were measured to take more
        (``observe_load``; on the H200 80-150 ms beyond the reads, where the fitted step cost
        was 0: the reads seen at a step end, the copy to the GPU, the request's next step)."""
        measured = [self._overhead[t].value for t in tiers if t in self._overhead]
        known = [m for m in measured if m is not None]
        return max([ADVISOR_LOAD_STEPS * self.prefill.c, *known])

    def first_chunk_pays(self, tier: int, first_token: int,
                         backlog_bytes: Mapping[int, int] | None = None,
                         writing_bytes: Mapping[int, int] | None = None) -> bool:
        """Would reading the chunk at ``first_token``, with a load's extra steps and the reads
        queued ahead on ``tier``, beat computing it there — and does each chunk read from the
        slowest measured file tier beat computing it alone? If so, loading pays for any run that
        starts with it, however long and wherever its later chunks are (each costs more to
        compute and no more to read, and the extra steps and the queue are paid once), so the
        run needs no survey. True while the engine is unmeasured (load, and so measure); False
        while ``tier`` is (survey: the decision will recompute while the tier is measured).
        ``writing_bytes``: as in ``decide``."""
        if not self.prefill.known():
            return True
        rate = self.read_rate(tier)
        if not rate:
            return False
        slowest = min(r.value for r in self._read.values() if r.value)
        compute = self.prefill.seconds(first_token, first_token + self.chunk_tokens)
        queued = (backlog_bytes or {}).get(tier, 0)
        ahead = device_ahead(queued, self.row_bytes, (writing_bytes or {}).get(tier, 0))
        m, tail = ADVISOR_PAYOFF_MARGIN, self._idle_tail_s()
        # against the run's own compute behind the step's only: a fixed amount of other work
        # (the last step's compute, the waiting requests) that pays for one chunk's reads does
        # not pay for a longer run's, whose reads grow by a chunk's per chunk: those runs are
        # surveyed, and ``decide`` prices them whole. The tail is paid once either way: where a
        # chunk pays with it, k chunks (k reads, one tail, k or more chunks' compute) pay too
        return (self.row_bytes / slowest <= m * compute
                and (ahead + self.row_bytes) / rate + self.load_overhead([tier]) + tail
                <= m * max(self._queued_s + compute, tail))

    def decide(self, tiers: Sequence[int], first_token: int, end_token: int | None = None,
               backlog_bytes: Mapping[int, int] | None = None,
               writing_bytes: Mapping[int, int] | None = None, count: bool = True,
               tail: bool = True) -> Decision:
        """Load one row from each of ``tiers`` (the file tier's id per row, in prompt order)
        covering tokens ``[first_token, end_token)`` (default: one chunk's tokens per row), or
        recompute them? ``backlog_bytes[t]``: the bytes of reads queued or in flight on tier
        ``t`` ahead of this run; ``writing_bytes[t]``: the bytes of writes admitted to tier
        ``t`` and not yet written, which the run's reads share the device with
        (``device_ahead``). ``count`` False: only price it (a decline is not counted towards
        measuring the tier again). ``tail`` False: the run does not reach the prompt's end, and
        the first-token tail is not priced (the cold rest's forward pass hides it either way)."""
        if not tiers:
            return Decision(True, "faster", 0.0, 0.0)
        if not self.prefill.known():
            return Decision(True, "unmeasured")  # nothing to weigh it against: load, measure
        rates = {t: self.read_rate(t) for t in set(tiers)}
        if not all(rates.values()):
            if count:
                self._count_decline(tiers)
            return Decision(False, "unmeasured")  # recomputed while the tier is measured
        own: dict[int, int] = {}
        for t in tiers:
            own[t] = own.get(t, 0) + self.row_bytes
        queued = {t: device_ahead((backlog_bytes or {}).get(t, 0), own[t],
                                   (writing_bytes or {}).get(t, 0)) for t in own}
        # tiers read in parallel: the run is in when the last of its tiers has read its part
        alone_read = max(own[t] / rates[t] for t in own)  # type: ignore[operator]
        read = max((queued[t] + own[t]) / rates[t] for t in own)  # type: ignore[operator]
        end = end_token if end_token is not None else first_token + len(tiers) * self.chunk_tokens
        compute = self.prefill.seconds(first_token, end)
        m, steps = ADVISOR_PAYOFF_MARGIN, self.load_overhead(list(own))
        tail_s = self._idle_tail_s() if tail else 0.0
        load_s = read + steps + tail_s
        recompute_s = max(compute + self._queued_s, self.engine_queue_s, self._backlog_term(),
                          tail_s)
        alone_pays = alone_read + steps + tail_s <= m * max(compute, tail_s)
        if load_s <= m * recompute_s:
            return Decision(True, "faster" if alone_pays else "engine_busy", load_s, recompute_s)
        if count:
            self._count_decline(tiers)
        return Decision(False, "disk_busy" if alone_pays else "faster", load_s, recompute_s)

    def loading_pays(self, tiers: Sequence[int], first_token: int,
                     end_token: int | None = None,
                     backlog_bytes: Mapping[int, int] | None = None) -> bool:
        """``decide(...).load``."""
        return self.decide(tiers, first_token, end_token, backlog_bytes).load

    def _count_decline(self, tiers: Sequence[int]) -> None:
        for t in set(tiers):
            self._declined[t] += 1
            if self._declined[t] >= ADVISOR_REPROBE_AFTER:
                self._declined[t] = 0
                self._remeasure[t] = True  # declined for long: measure the tier again

    def probing(self, tier: int, now: float) -> bool:
        """Is a probe of ``tier`` in flight: a run loaded from it while its load overhead is
        unmeasured, decided less than ``ADVISOR_PROBE_HOLD_S`` ago? Then another run would be
        priced with nothing known of what a load costs beyond its reads: it is recomputed."""
        started = self._probe.get(tier)
        if started is None or self._overhead[tier].value is not None:
            return False
        return now - started < ADVISOR_PROBE_HOLD_S

    def admit(self, d: Decision, tier: int, now: float) -> Decision:
        """``d`` as it stands for a run whose first chunk is on ``tier``, decided at ``now``:
        a LOAD while a probe of the tier is in flight becomes a recompute
        (``load_unmeasured``); a LOAD while the tier's load overhead is unmeasured is its probe.
        Every decision of a run passes here (``RequestScan``), whichever test made it."""
        if not d.load:
            return d
        if self.probing(tier, now):
            return Decision(False, "load_unmeasured", d.load_s, d.recompute_s)
        if self._overhead[tier].value is None:
            self._probe[tier] = now
        return d

    def probe_ended(self, tier: int) -> None:
        """The probe of ``tier`` read nothing after all (no CPU row). A probe that never
        reports (its request aborted) holds the tier until ``ADVISOR_PROBE_HOLD_S`` ran out."""
        self._probe.pop(tier, None)

    def measured_load_overhead(self, tier: int) -> float | None:
        """The measured part of ``load_overhead`` for ``tier``, or None if none was measured."""
        return self._overhead[tier].value

    # -- across restarts ---------------------------------------------------------------------
    def tier_state(self, tier: int) -> dict[str, object]:
        """What a restart of the engine should start from, kept by file tier ``tier``: its read
        rate and load overhead, and the engine's prefill fit (the namespace fixes the model and
        its layout, so the costs carry over; new samples replace them at the usual pace)."""
        return {"read_bytes_per_s": self._read[tier].value,
                "read_rate_provisional": self._provisional[tier],
                "load_overhead_s": self._overhead[tier].value,
                "first_token_tail_s": self._tail.value,
                "prefill": self.prefill.state() if self.prefill.samples else None}

    def restore_tier(self, tier: int, state: dict[str, object]) -> None:
        """Start from ``state`` (a ``tier_state`` of an earlier engine). ValueError naming
        the field, and nothing changed, if it is not one. The prefill fit is taken only while
        this engine has none."""
        if not isinstance(state, dict):
            raise ValueError("advisor state: expected an object")
        values: dict[str, float | None] = {}
        for name in ("read_bytes_per_s", "load_overhead_s", "first_token_tail_s"):
            v = state.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not 0 <= v < math.inf
                                  or (name == "read_bytes_per_s" and v == 0)):
                raise ValueError(f"advisor state: {name}: expected a number >= 0 or null")
            values[name] = None if v is None else float(v)
        provisional = state.get("read_rate_provisional", False)
        if not isinstance(provisional, bool):
            raise ValueError("advisor state: read_rate_provisional: expected true or false")
        prefill = state.get("prefill")
        if prefill is not None and not isinstance(prefill, dict):
            raise ValueError("advisor state: prefill: expected an object or null")
        if prefill is not None and not self.prefill.samples:
            self.prefill.restore(prefill)
        self._read[tier].value = values["read_bytes_per_s"]
        self._provisional[tier] = provisional and values["read_bytes_per_s"] is not None
        self._overhead[tier].value = values["load_overhead_s"]
        if self._tail.value is None:  # engine-wide: the first tier's saved tail, as the fit
            self._tail.value = values["first_token_tail_s"]

    def describe(self) -> dict[str, float | None]:
        known = self.prefill.known()
        return {"step_s": self.prefill.c if known else None,
                "prefill_s_per_token": self.prefill.a if known else None,
                "prefill_s_per_token_per_context_token": self.prefill.b if known else None,
                "engine_queue_s": self.engine_queue_s,
                "engine_backlog_s": self.engine_backlog_s,
                "waiting_requests": self.waiting_requests,
                "first_token_tail_s": self._tail.value,
                **{f"read_bytes_per_s[{i}]": r.value for i, r in self._read.items()},
                **{f"load_overhead_s[{i}]": o.value for i, o in self._overhead.items()}}
