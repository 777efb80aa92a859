"""RequestLookups: what the tier chain remembers about one request between vLLM's lookups.

vLLM's scheduler asks for a request's chunks in prompt order, every step, until a miss, and asks
again next step while any answer was pending. The chain needs three things to stay across those
repeated scans, and this record owns them:

* ``counted`` — chunks whose lookup was counted, so that hit ratios stay per chunk however often
  vLLM asks. They are also protected: a promotion for this request never evicts them (vLLM
  loads a request's hits in one job; a prefix larger than the CPU tier would otherwise evict its
  own head to promote its tail, forever).
* ``disk_run`` — the chunks after the CPU hits that only a file tier holds, and what was decided
  about them. A state machine with asserted transitions:

      SURVEY --(scan came back to the run)--> LOAD       promotions start, vLLM loads them
            \\                             \\-> RECOMPUTE  the run's first chunk is a miss

  On the first scan the chain only notes each disk chunk (answer: pending, nothing read). On the
  next scan the whole run is known and the promotion advisor decides once for all of it. (If
  reading the run's first chunk, even from the slowest file tier, already beats computing it,
  the run is loaded at once: every later chunk costs more to compute and no more to read.)
* the **prefill clock** — when the request's current stretch of computed tokens started, for the
  advisor's prefill model (only while the request had no tier hit). vLLM completes a store
  after the forward pass that computed its chunks, so store completions time the prefill; a
  finished request's record stays until its last store completes.

Owned by the vLLM adapter (one per live request), passed to ``TierChain.lookup`` and
``TierChain.stored``; dropped when the request has finished and its stores completed.
Scheduler thread only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RunState(enum.Enum):
    SURVEY = "survey"
    LOAD = "load"
    RECOMPUTE = "recompute"


class IllegalRunTransition(AssertionError):
    pass


_ALLOWED = {(RunState.SURVEY, RunState.LOAD), (RunState.SURVEY, RunState.RECOMPUTE)}


@dataclass
class DiskRun:
    """The request's chunks that only a file tier holds, in prompt order."""

    state: RunState = RunState.SURVEY
    keys: list[bytes] = field(default_factory=list)
    tiers: list[int] = field(default_factory=list)  # file tier (1-based chain index) per key
    first_token: int | None = None  # where the run starts in the prompt, when known
    starts: list[int | None] = field(default_factory=list)  # each key's first token, if known
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
        if starts and all(t is not None for t in starts):
            return min(starts), max(starts) + chunk_tokens
        first = (self.first_token or 0) + j * chunk_tokens
        return first, first + (len(self.keys) - j) * chunk_tokens

    def position(self, key: bytes) -> int | None:
        """Index of ``key`` in the run, or None if it was not noted."""
        return self._index.get(key)

    def move(self, to: RunState) -> None:
        if (self.state, to) not in _ALLOWED:
            raise IllegalRunTransition(f"disk run: {self.state.value} -> {to.value}")
        self.state = to


@dataclass
class RequestLookups:
    req_id: str = ""
    counted: set[bytes] = field(default_factory=set)
    disk_run: DiskRun = field(default_factory=DiskRun)
    # chunk -> the tier that answered RETRY for it (a remote tier still asking): the tiers above
    # it already counted this lookup, so the re-asks count there no more
    retried: dict[bytes, int] = field(default_factory=dict)
    had_tier_hit: bool = False  # a CPU or disk hit: its timing is no prefill sample
    stores_in_flight: int = 0  # chunks offered for storing, not completed yet
    finished: bool = False  # vLLM reported it finished (kept until its stores complete)
    # the prefill clock: tokens computed since ``segment_token``, timed from ``segment_start``
    segment_token: int | None = None
    segment_start: float | None = None
    segment_step: int = 0  # the chain's step count when the segment started

    def start_clock(self, now: float | None = None) -> None:
        """The request's first lookup: its computation cannot have started before."""
        if self.segment_start is None:
            self.segment_start = time.perf_counter() if now is None else now
