"""PromotionAdvisor: is reading a chunk from a file tier faster than computing it again?

A disk hit only helps if loading the chunk's KV takes less time than the engine takes to
recompute the chunk's tokens. Both rates are measured while serving:

* **read rate** of each file tier: bytes per second of each promotion batch, submit to last
  completion (a batch's reads run in parallel on the tier's I/O threads, so this is the rate a
  request's promotion actually gets), smoothed;
* **prefill rate** of the engine: tokens of the chunks vLLM offers to store per second of
  busy scheduler time (vLLM offers a chunk right after computing it), measured over steps that
  follow each other closely (an idle gap is not compute time), smoothed. A fixed
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
    ADVISOR_MAX_STEP_GAP_S,
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
        self._step_tokens = 0
        self._last_step_end: float | None = None

    # -- measurements ------------------------------------------------------------------------
    def observe_read_batch(self, tier: int, nbytes: int, seconds: float) -> None:
        """A promotion batch of file tier ``tier`` (0-based) finished."""
        if nbytes > 0 and seconds > 0:
            self._read[tier].add(nbytes / seconds)

    def observe_stored_chunks(self, n: int) -> None:
        """vLLM offered ``n`` newly computed chunks for storing in this step."""
        self._step_tokens += n * self.chunk_tokens

    def observe_step_end(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        last, self._last_step_end = self._last_step_end, now
        tokens, self._step_tokens = self._step_tokens, 0
        if last is not None and tokens and 0 < now - last <= ADVISOR_MAX_STEP_GAP_S:
            self._prefill.add(tokens / (now - last))

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
