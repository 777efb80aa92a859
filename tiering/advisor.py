"""PromotionAdvisor: is reading a chunk from a file tier faster than computing it again?

A disk hit only helps if loading the chunk's KV takes less time than the engine takes to
recompute the chunk's tokens. Both rates are measured while serving:

* **read rate** of each file tier: bytes per second of each promotion batch, submit to last
  completion (a batch's reads run in parallel on the tier's I/O threads, so this is the rate a
  request's promotion actually gets), smoothed. (The write rate is no stand-in: measured on the
  build machine's virtual disk it was tens of times below the read rate, and it declined disk
  hits that were ten times faster than recomputing.)
* **prefill rate** of the engine: for each request that was computed from scratch (no CPU or
  disk hit), the tokens of the chunks vLLM offered to store (it offers a chunk right after
  computing it) per second from its first lookup to its last store, smoothed. Queueing behind
  other requests makes it an underestimate, which errs towards loading. A fixed
  ``prefill_tokens_per_s`` in the config replaces the measurement.

The decision is per chunk and the same for every chunk of a tier: with both costs linear in the
number of chunks, a prefix either pays as a whole or not at all. Until both rates have been seen,
disk hits are always loaded (that is also how the read rate gets measured), and a declining tier
is probed again now and then. A chunk that does not
pay is a miss (counted as ``promotions_declined`` on its tier): vLLM recomputes it.

All calls come from the scheduler thread; nothing here blocks.
"""

from __future__ import annotations

import time

from tiering.settings import (
    ADVISOR_EWMA_WEIGHT,
    ADVISOR_MIN_SAMPLE_TOKENS,
    ADVISOR_PAYOFF_MARGIN,
    ADVISOR_REPROBE_AFTER,
)


class _Ewma:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        w = ADVISOR_EWMA_WEIGHT
        self.value = x if self.value is None else (1 - w) * self.value + w * x


class PromotionAdvisor:
    def __init__(self, n_file_tiers: int, row_bytes: int, chunk_tokens: int,
                 prefill_tokens_per_s: float | None = None) -> None:
        self.row_bytes, self.chunk_tokens = row_bytes, max(1, chunk_tokens)
        self.fixed_prefill = prefill_tokens_per_s
        self._read = [_Ewma() for _ in range(n_file_tiers)]  # bytes/s per file tier
        self._declined = [0] * n_file_tiers
        self._prefill = _Ewma()  # tokens/s
        # request id -> [first lookup time, tokens stored, last store time, had a hit]
        self._requests: dict[str, list] = {}

    # -- measurements ------------------------------------------------------------------------
    def observe_read_batch(self, tier: int, nbytes: int, seconds: float) -> None:
        """A promotion batch of file tier ``tier`` (0-based) finished."""
        if nbytes > 0 and seconds > 0:
            self._read[tier].add(nbytes / seconds)

    def request_lookup(self, req_id: str, hit: bool, now: float | None = None) -> None:
        """A counted lookup of request ``req_id`` (its first one starts the clock)."""
        state = self._requests.get(req_id)
        if state is None:
            now = time.perf_counter() if now is None else now
            state = self._requests[req_id] = [now, 0, now, False]
        state[3] |= hit

    def request_stored(self, req_id: str, chunks: int, now: float | None = None) -> None:
        """vLLM offered ``chunks`` newly computed chunks of ``req_id`` for storing."""
        state = self._requests.get(req_id)
        if state is not None and chunks:
            state[1] += chunks * self.chunk_tokens
            state[2] = time.perf_counter() if now is None else now

    def request_finished(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        started, tokens, last, had_hit = state
        if not had_hit and tokens >= ADVISOR_MIN_SAMPLE_TOKENS and last > started:
            self._prefill.add(tokens / (last - started))

    # -- the decision --------------------------------------------------------------------------
    def read_rate(self, tier: int) -> float | None:
        return self._read[tier].value

    def prefill_rate(self) -> float | None:
        return self.fixed_prefill or self._prefill.value

    def pays(self, tier: int) -> bool:
        """Is loading one chunk from file tier ``tier`` (0-based) faster than recomputing it?"""
        read, prefill = self.read_rate(tier), self.prefill_rate()
        if not read or not prefill:
            return True  # not measured yet: load (and measure)
        if self.row_bytes / read <= ADVISOR_PAYOFF_MARGIN * self.chunk_tokens / prefill:
            return True
        self._declined[tier] += 1
        if self._declined[tier] >= ADVISOR_REPROBE_AFTER:
            self._declined[tier] = 0
            return True
        return False

    def describe(self) -> dict[str, float | None]:
        return {"prefill_tokens_per_s": self.prefill_rate(),
                **{f"read_bytes_per_s[{i}]": r.value for i, r in enumerate(self._read)}}
