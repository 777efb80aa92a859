"""PromotionAdvisor: is reading a request's disk hits faster than computing those tokens again?

A disk hit only helps if loading its KV takes less time than the engine takes to recompute the
same tokens. Both costs are measured while serving:

* **read rate** of each file tier: bytes per second of each promotion batch, submit to last
  completion (a batch's reads run in parallel on the tier's I/O threads, so this is the rate a
  request's promotion actually gets), smoothed. (The write rate is no stand-in: measured on the
  build machine's virtual disk it was tens of times below the read rate.)
* **prefill cost** of the engine, as a function of *where* in the prompt the tokens are: a token
  at position ``p`` costs ``a + b * p`` seconds (``a``: the per-token layers; ``b``: attention
  over the ``p`` tokens before it). Computing tokens ``[k, n)`` with ``k`` of them cached costs
  ``a (n - k) + b (n^2 - k^2) / 2``. ``a`` and ``b`` are fitted by least squares, with
  exponential forgetting, to the requests computed without any tier hit: the tokens of the
  chunks vLLM offered to store (it offers a chunk right after computing it; vLLM 0.33 also says
  where in the prompt each chunk ends) and the time from the request's first lookup to its last
  store. Queueing behind other requests makes that an overestimate of cost, which errs towards
  loading. A fixed ``prefill_tokens_per_s`` in the config replaces the measurement (``b = 0``).

One rate for all prompt lengths was wrong on the H200: fitted on 2k-token prompts, it declined
the disk hits of a 32k-token prompt that read in 3.6-3.9 s and took 4.55 s to recompute, since
the tail of a long prompt costs several times more per token than a short prompt does.

The decision is per request, for the whole run of chunks it would read from disk (after its
CPU hits): reading costs the same per chunk wherever it is, computing costs more per chunk the
further into the prompt, so the request's total time is concave in the number of disk chunks
it loads, and its minimum is at one end: load the whole run or none of it. The chain surveys the
run first (``tiering.request_lookups``) and asks ``loading_pays`` once — unless its first chunk
alone pays (``first_chunk_pays``): then every longer run pays too, and loading starts at once. Until both costs have
been seen, disk hits are loaded (that is also how the read rate gets measured), and a tier that
keeps being declined is probed again now and then. A declined run is a miss (counted per chunk as
``promotions_declined`` on its tier): vLLM recomputes it.

All calls come from the scheduler thread; nothing here blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tiering.settings import (
    ADVISOR_EWMA_WEIGHT,
    ADVISOR_MODEL_WEIGHT,
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


class PrefillModel:
    """Seconds to compute prompt tokens ``[k, n)``: ``a (n - k) + b (n^2 - k^2) / 2``.

    Fitted to samples by least squares with exponential forgetting (each new sample weighs
    ``ADVISOR_MODEL_WEIGHT`` against the decayed history). With samples of one prompt length
    only, ``a`` and ``b`` cannot be told apart: the model is then per-token only (``b = 0``)
    until other lengths come. Both coefficients are kept non-negative."""

    def __init__(self, tokens_per_s: float | None = None) -> None:
        self.fixed = tokens_per_s
        # decayed sums of x1 x1, x1 x2, x2 x2, x1 t, x2 t (x1 = n - k, x2 = (n^2 - k^2) / 2)
        self._s = [0.0] * 5
        self.samples = 0
        self.a = 1.0 / tokens_per_s if tokens_per_s else 0.0
        self.b = 0.0

    @staticmethod
    def _features(k: int, n: int) -> tuple[float, float]:
        return float(n - k), (float(n) * n - float(k) * k) / 2.0

    def add(self, k: int, n: int, seconds: float) -> None:
        """Tokens ``[k, n)`` were computed in ``seconds``."""
        if self.fixed or not 0 <= k < n or not 0 < seconds < math.inf:
            return  # no usable sample (a negative k could zero the attention term: x2 = 0)
        x1, x2 = self._features(k, n)
        keep = 1.0 - ADVISOR_MODEL_WEIGHT if self.samples else 0.0
        s = self._s
        for i, v in enumerate((x1 * x1, x1 * x2, x2 * x2, x1 * seconds, x2 * seconds)):
            s[i] = keep * s[i] + v
        self.samples += 1
        self._solve()

    def _solve(self) -> None:
        s11, s12, s22, s1t, s2t = self._s
        a_only, b_only = s1t / s11, s2t / s22
        det = s11 * s22 - s12 * s12
        if det <= 1e-6 * s11 * s22:  # one prompt length so far: cannot tell a from b
            self.a, self.b = a_only, 0.0
            return
        a = (s1t * s22 - s2t * s12) / det
        b = (s2t * s11 - s1t * s12) / det
        if a < 0 or b < 0:  # noise: the better of the two single-term fits
            a, b = ((a_only, 0.0) if self._sq_error(a_only, 0.0) <= self._sq_error(0.0, b_only)
                    else (0.0, b_only))
        self.a, self.b = a, b

    def _sq_error(self, a: float, b: float) -> float:
        s11, s12, s22, s1t, s2t = self._s
        # sum (t - a x1 - b x2)^2 without the constant sum t^2
        return a * a * s11 + 2 * a * b * s12 + b * b * s22 - 2 * a * s1t - 2 * b * s2t

    def known(self) -> bool:
        return bool(self.fixed) or self.samples > 0

    def seconds(self, k: int, n: int) -> float:
        """Predicted seconds to compute tokens ``[k, n)`` with the first ``k`` cached."""
        x1, x2 = self._features(k, n)
        return self.a * x1 + self.b * x2


class PromotionAdvisor:
    def __init__(self, n_file_tiers: int, row_bytes: int, chunk_tokens: int,
                 prefill_tokens_per_s: float | None = None) -> None:
        self.row_bytes, self.chunk_tokens = row_bytes, max(1, chunk_tokens)
        self.prefill = PrefillModel(prefill_tokens_per_s)
        self._read = [_Ewma() for _ in range(n_file_tiers)]  # bytes/s per file tier
        self._declined = [0] * n_file_tiers

    # -- measurements ------------------------------------------------------------------------
    def observe_read_batch(self, tier: int, nbytes: int, seconds: float) -> None:
        """A promotion batch of file tier ``tier`` (0-based) finished."""
        if nbytes > 0 and seconds > 0:
            self._read[tier].add(nbytes / seconds)

    def observe_prefill(self, first_token: int, end_token: int, seconds: float) -> None:
        """A request without tier hits computed tokens ``[first_token, end_token)`` in
        ``seconds`` (the chain times stretches of at least ``ADVISOR_MIN_SAMPLE_TOKENS``)."""
        self.prefill.add(first_token, end_token, seconds)

    # -- the decision --------------------------------------------------------------------------
    def read_rate(self, tier: int) -> float | None:
        return self._read[tier].value

    def first_chunk_pays(self, tier: int, first_token: int) -> bool:
        """Would reading the chunk at ``first_token`` beat computing it there, even from the
        slowest measured file tier? If so, loading pays for any run that starts with it, however
        long and wherever its later chunks are (each costs more to compute and no more to read),
        so the run needs no survey. (From ``tier``'s own rate alone that holds for one tier
        only: a run going on on a slower tier was loaded at once.) True while ``tier`` is
        unmeasured (load, and so measure)."""
        if not self.read_rate(tier) or not self.prefill.known():
            return True
        slowest = min(r.value for r in self._read if r.value)
        compute = self.prefill.seconds(first_token, first_token + self.chunk_tokens)
        return self.row_bytes / slowest <= ADVISOR_PAYOFF_MARGIN * compute

    def loading_pays(self, tiers: Sequence[int], first_token: int) -> bool:
        """Is reading one chunk from each of ``tiers`` (0-based file tier per chunk, in prompt
        order, starting at token ``first_token``) faster than computing those tokens?"""
        if not tiers:
            return True
        rates = [self.read_rate(t) for t in tiers]
        if not all(rates) or not self.prefill.known():
            return True  # not measured yet: load (and measure)
        read_s = sum(self.row_bytes / r for r in rates)
        end = first_token + len(tiers) * self.chunk_tokens
        if read_s <= ADVISOR_PAYOFF_MARGIN * self.prefill.seconds(first_token, end):
            return True
        probe = False
        for t in set(tiers):
            self._declined[t] += 1
            if self._declined[t] >= ADVISOR_REPROBE_AFTER:
                self._declined[t] = 0
                probe = True  # declined for long: load this run to measure the tier again
        return probe

    def describe(self) -> dict[str, float | None]:
        return {"prefill_s_per_token": self.prefill.a if self.prefill.known() else None,
                "prefill_s_per_token_per_context_token": (
                    self.prefill.b if self.prefill.known() else None),
                **{f"read_bytes_per_s[{i}]": r.value for i, r in enumerate(self._read)}}
