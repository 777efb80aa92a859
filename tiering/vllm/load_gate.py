"""LoadGate: at most so many requests with a load to the GPU in flight at once, and, where
asked, at most so many loads started in one scheduler step.

Why: before vLLM (0.32, 0.33) admits a request whose KV loads asynchronously, its scheduler sums
the blocks still needed by every request that is prefilling or loading
(``Scheduler._inflight_prefill_reserved_blocks``, one ``get_num_blocks_to_allocate`` walk per
request). Loading requests are bounded only by the GPU KV cache, not by ``max_num_seqs``, so a
burst of N cache hits admitted together costs N(N-1)/2 walks: at N=256 the largest single cost
of the scheduler thread (docs/benchmarks.md, "The CPU-tier load path, per block"). The fix
belongs upstream (keep that reservation as a running total); within the connector interface the
spec can only keep the in-flight set small. Our ``TieringScheduler`` makes that sum linear, so
under it the default is no cap (``scheduler_sums_linearly``; tiering.settings says what it
measured); a cap named in the spec's config is kept.

How: the manager tracks the requests between ``prepare_load`` and ``complete_load`` (vLLM loads
a request's hits in one job). While ``cap`` of them are in flight, a request that would start
a load (its scan finds a chunk READY in the CPU tier) is told to wait: ``RETRY`` for the first
chunk each KV group asks about and ``MISS`` for the rest of that step's scan, so vLLM's scan
stops after one call per group and returns "ask again" (None); the scheduler keeps the request
waiting, in its queue order, and asks again next step. Nothing is counted or pinned for a
deferred scan. While prompts compute (the step before offered chunks for storing, which vLLM
does for the chunks it schedules, or a request's scan in this step missed at its first chunk:
vLLM computes it from its first token now), the gate lets every hit through: its load
runs beside that compute, as under vLLM's own spec, instead of in waves after it (the prefill
sweep at 80% hits on the H200: 1.55 s a batch against vLLM's 1.33 at the 8B shape). The cap
binds when the hits come alone, where the sums above are the step's whole cost. A request is
never deferred forever: every in-flight load ends with
``complete_load`` (vLLM reports every job, failed ones too), ``on_request_finished`` or a cache
reset, and each step's first requests in the queue take the slots that freed.

Why a limit per step (``max_load_starts_per_step``, off by default): the step that admits a burst
of hits runs every admission and every job's copy submission before the copy engine moves the
first byte of any of them (on the H200, ~0.25 s of a 256-prompt 8B hit batch's 0.59 s, with the
copies ~0.35 s after it). Admitting at most ``per_step`` loads a step while nothing computes lets
the first jobs copy while the next steps admit and submit the rest. A limit of 16 was tried on
the H200 before kernels were warmed for the batch shapes it makes, and each paced step then took
~140 ms (docs/benchmarks.md, "A limit on loads started per step"); it is measured again with
the warm-up in place before it is anyone's default.

Contract: every method is called by the manager on vLLM's scheduler thread, never blocks and
never raises into it. The gate only answers for a request; the manager counts.
"""

from __future__ import annotations

from collections.abc import Callable

from tiering.settings import MAX_LOADING_REQUESTS, MAX_LOADING_REQUESTS_UNDER_OUR_SCHEDULER
from tiering.stats import TierStats
from tiering.vllm.compat import LookupResult

# vLLM's offload key is the block hash followed by the KV group index in 4 bytes
# (vllm.v1.kv_offload.base.make_offload_key).
_GROUP_BYTES = 4


class LoadGate:
    def __init__(self, cap: int | None, stats: TierStats, per_step: int = 0) -> None:
        """``cap``: the most requests with a load in flight at once; 0: no cap; None: the
        default (``MAX_LOADING_REQUESTS``, until ``scheduler_sums_linearly``). ``per_step``:
        the most loads started in one step while nothing computes; 0: no limit. ``stats``: the
        CPU tier's counters (``loads_deferred``)."""
        if cap is not None and cap < 0:
            raise ValueError(f"max_loading_requests: expected an integer >= 0, got {cap}")
        if per_step < 0:
            raise ValueError(f"max_load_starts_per_step: expected an integer >= 0, got "
                             f"{per_step}")
        self.cap_is_default = cap is None  # the user did not choose one
        self.cap = MAX_LOADING_REQUESTS if cap is None else cap
        self.per_step = per_step
        self._started_now = 0  # loads started (prepare_load) since the last step's end
        self._stats = stats
        self._loading: dict[str, int] = {}  # request -> its load jobs in flight
        # requests told to wait in this step -> the KV groups already answered RETRY
        self._deferred: dict[str, set[bytes]] = {}
        # True while the cap is reached or a scan was deferred this step: the manager asks
        # ``check`` only then (one attribute read per lookup otherwise)
        self.closed = False
        # prompts compute in this step (see the module doc): no hit waits for the cap
        self.computing = False
        # chunks were offered for storing since the last step's end: that step computes them.
        # vLLM 0.33 offers before ``on_schedule_end`` (``end_step`` carries it into
        # ``computing``), 0.32 after it (still set at the next step's lookups)
        self._offered = False

    def scheduler_sums_linearly(self, linear: bool = True) -> bool:
        """Our ``TieringScheduler`` keeps vLLM's in-flight sum linear, the cost the cap bounds
        (module doc): the default cap becomes ``MAX_LOADING_REQUESTS_UNDER_OUR_SCHEDULER``
        (tiering.settings says why); with ``linear`` False (it fell back to vLLM's quadratic
        sum after a fault) the default comes back. A cap the user chose stays either way.
        Called on the scheduler thread; returns whether the cap changed."""
        want = MAX_LOADING_REQUESTS_UNDER_OUR_SCHEDULER if linear else MAX_LOADING_REQUESTS
        if not self.cap_is_default or self.cap == want:
            return False
        self.cap = want
        self._update()
        return True

    @property
    def limits(self) -> bool:
        """The gate can defer a load at all (a cap or a limit per step)."""
        return bool(self.cap or self.per_step)

    def slots_free(self) -> int | None:
        """How many more requests may start a load in this step, or None without limits."""
        free = [self.cap - len(self._loading)] if self.cap else []
        if self.per_step:
            free.append(self.per_step - self._started_now)
        return max(0, min(free)) if free else None

    def loading(self) -> int:
        """Requests with a load in flight."""
        return len(self._loading)

    def check(self, req_id: str, key: bytes,
              resident: Callable[[bytes], bool]) -> LookupResult | None:
        """The answer for ``key`` if the gate defers the request's scan, else None (look it up
        as usual). ``resident(key)``: would the lookup hit the CPU tier now?"""
        groups = self._deferred.get(req_id)
        if groups is None:
            if (self.computing or self._offered or not self._full() or req_id in self._loading
                    or not resident(key)):
                return None
            groups = self._deferred[req_id] = set()
            self._stats.add("loads_deferred")
        group = key[-_GROUP_BYTES:]
        if group in groups:
            return LookupResult.MISS  # ends this group's scan: the answer is already "retry"
        groups.add(group)
        return LookupResult.RETRY

    def prompt_computes(self) -> None:
        """A request's scan of this step missed at its first chunk: vLLM computes it now, so
        the loads this step admits run beside that compute (let through until the step ends)."""
        self.computing = True

    def chunks_offered(self) -> None:
        """vLLM offered chunks for storing in this step (``prepare_store``): it schedules
        their compute now, and a prefill that runs over several steps goes on in the next one
        (its running chunks are not scanned), so the next step lets hits through."""
        self._offered = True

    def _full(self) -> bool:
        """No load may start now: the cap is reached, or this step's share of starts."""
        return self.slots_free() == 0

    def _update(self) -> None:
        self.closed = bool(self._deferred) or self._full()

    def started(self, req_id: str) -> None:
        """vLLM asked to load the request's hits (``prepare_load``)."""
        self._loading[req_id] = self._loading.get(req_id, 0) + 1
        self._started_now += 1
        self._update()

    def ended(self, req_id: str) -> None:
        """One load job of the request completed (``complete_load``)."""
        n = self._loading.get(req_id, 0)
        if n <= 1:
            self._loading.pop(req_id, None)
        else:
            self._loading[req_id] = n - 1
        self._update()

    def forget(self, req_id: str) -> None:
        """The request finished: none of its loads holds a slot any more."""
        self._loading.pop(req_id, None)
        self._deferred.pop(req_id, None)
        self._update()

    def end_step(self) -> None:
        """The scheduler's step ended: deferred requests are asked about afresh next step."""
        self._deferred.clear()
        self._started_now = 0
        self.computing, self._offered = self._offered, False
        self._update()

    def reset(self) -> None:
        """vLLM dropped its in-flight jobs (a cache reset): their completions never come."""
        self._loading.clear()
        self._deferred.clear()
        self._update()
