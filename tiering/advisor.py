"""PromotionAdvisor: is reading a request's disk hits faster than computing those tokens again?

A disk hit only helps if loading its KV takes less time than the engine takes to recompute the
same tokens. Both costs are measured while serving:

* **read rate** of each file tier: bytes per second of each promotion batch, submit to last
  completion (a batch's reads run in parallel on the tier's I/O threads, so this is the rate a
  request's promotion actually gets), smoothed. (The write rate is no stand-in: measured on the
  build machine's virtual disk it was tens of times below the read rate.)
* **prefill cost** of the engine, as a function of *where* in the prompt the tokens are: a token
  at position ``p`` costs ``a + b * p`` seconds (``a``: the per-token layers; ``b``: attention
  over the ``p`` tokens before it), and a step costs ``c`` whatever it computes. Computing tokens
  ``[k, n)`` with ``k`` of them cached takes ``c + a (n - k) + b (n^2 - k^2) / 2``. The three are
  fitted by least squares, non-negative, with exponential forgetting (``PrefillModel``), to the
  requests computed without any tier hit: the tokens between two of a request's store
  completions (vLLM completes a store after the forward pass that computed its chunks, and says
  where in the prompt each chunk ends) and the time between them (the first from the request's
  first lookup). Queueing behind other requests makes that an overestimate of cost, which errs
  towards loading. A fixed ``prefill_tokens_per_s`` in the config replaces the measurement.

One rate for all prompt lengths was wrong on the H200: fitted on 2k-token prompts, it declined
the disk hits of a 32k-token prompt that read in 3.6-3.9 s and took 4.55 s to recompute, since
the tail of a long prompt costs several times more per token than a short prompt does.

The decision is per request, for the whole run of chunks it would read from disk (after its
CPU hits): loading costs the reads plus ``ADVISOR_LOAD_STEPS`` extra steps (``c`` each), and
saves the run's ``a`` and ``b`` terms. Reading costs the same per chunk wherever it is,
computing costs more per chunk the further into the prompt, so the request's total time is
concave in the number of disk chunks it loads, and its minimum is at one end: load the whole
run or none of it. The chain surveys the
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

import numpy as np

from tiering.settings import (
    ADVISOR_EWMA_WEIGHT,
    ADVISOR_LOAD_STEPS,
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
    """Seconds a step takes to compute prompt tokens ``[k, n)``:
    ``c + a (n - k) + b (n^2 - k^2) / 2``.

    ``c`` is what a step costs whatever it computes (scheduling, launches, the store copy):
    loading does not save it (the request still needs a step for its last tokens) and pays it
    again for each extra step a load takes. ``a`` and ``b`` are the per-token and attention
    costs that loading saves. Fitted to samples by least squares with exponential forgetting
    (each new sample weighs ``ADVISOR_MODEL_WEIGHT`` against the decayed history), every
    coefficient non-negative: of the fits on a subset of the three terms, the best one, the
    richer subsets preferred on a tie (samples of one length fit a per-token cost alone exactly,
    and a constant alone too: the per-token reading is the one that lets a disk hit pay)."""

    # term subsets, preferred first on equal error: (c, a, b) flags
    _SUBSETS = ((1, 1, 1), (0, 1, 1), (1, 1, 0), (0, 1, 0), (1, 0, 1), (0, 0, 1), (1, 0, 0))

    def __init__(self, tokens_per_s: float | None = None) -> None:
        self.fixed = tokens_per_s
        self._s = np.zeros((3, 3))  # decayed sum of f f^T, f = (1, n - k, (n^2 - k^2) / 2)
        self._r = np.zeros(3)  # decayed sum of f t
        self._tt = 0.0  # decayed sum of t^2
        self.samples = 0
        self.c, self.a, self.b = 0.0, (1.0 / tokens_per_s if tokens_per_s else 0.0), 0.0

    @staticmethod
    def _features(k: int, n: int) -> np.ndarray:
        return np.array([1.0, float(n - k), (float(n) * n - float(k) * k) / 2.0])

    def add(self, k: int, n: int, seconds: float) -> None:
        """A step computed tokens ``[k, n)`` in ``seconds``."""
        if self.fixed or not 0 <= k < n or not 0 < seconds < math.inf:
            return  # no usable sample (a negative k could zero the attention term: x2 = 0)
        f = self._features(k, n)
        keep = 1.0 - ADVISOR_MODEL_WEIGHT if self.samples else 0.0
        self._s = keep * self._s + np.outer(f, f)
        self._r = keep * self._r + f * seconds
        self._tt = keep * self._tt + seconds * seconds
        self.samples += 1
        self._solve()

    def _solve(self) -> None:
        # scale the columns to comparable sizes so the small systems stay well conditioned
        scale = np.sqrt(np.maximum(np.diag(self._s), 1e-300))
        s = self._s / np.outer(scale, scale)
        r = self._r / scale
        best, best_err = None, math.inf
        for flags in self._SUBSETS:
            idx = [i for i in range(3) if flags[i]]
            sub = s[np.ix_(idx, idx)]
            if np.linalg.cond(sub) > 1e8:  # these terms cannot be told apart by the samples
                continue
            beta = np.linalg.solve(sub, r[idx])
            if np.any(beta < 0):
                continue
            err = float(self._tt / (self._tt or 1.0) - (2 * beta @ r[idx] - beta @ sub @ beta)
                        / (self._tt or 1.0))
            if best is None or err < best_err - 1e-9:
                best, best_err = (idx, beta), err
        if best is None:
            return  # nothing fits: keep the last model
        coef = np.zeros(3)
        coef[best[0]] = best[1]
        coef /= scale
        self.c, self.a, self.b = (float(x) for x in coef)

    def known(self) -> bool:
        return bool(self.fixed) or self.samples > 0

    def seconds(self, k: int, n: int) -> float:
        """Predicted seconds of the tokens ``[k, n)`` alone (the per-token and attention terms:
        what computing them adds to a step, and so what loading them saves)."""
        _, x1, x2 = self._features(k, n)
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

    def _load_overhead(self) -> float:
        """What a load adds in steps (``ADVISOR_LOAD_STEPS`` times a step's fixed cost)."""
        return ADVISOR_LOAD_STEPS * self.prefill.c

    def first_chunk_pays(self, tier: int, first_token: int) -> bool:
        """Would reading the chunk at ``first_token``, with a load's extra steps, beat computing
        it there, even from the slowest measured file tier? If so, loading pays for any run that
        starts with it, however long and wherever its later chunks are (each costs more to
        compute and no more to read, and the extra steps are paid once), so the run needs no
        survey. (From ``tier``'s own rate alone that holds for one tier only: a run going on on
        a slower tier was loaded at once.) True while ``tier`` is unmeasured (load, and so
        measure)."""
        if not self.read_rate(tier) or not self.prefill.known():
            return True
        slowest = min(r.value for r in self._read if r.value)
        compute = self.prefill.seconds(first_token, first_token + self.chunk_tokens)
        return (self.row_bytes / slowest + self._load_overhead()
                <= ADVISOR_PAYOFF_MARGIN * compute)

    def loading_pays(self, tiers: Sequence[int], first_token: int,
                     end_token: int | None = None) -> bool:
        """Is reading one row from each of ``tiers`` (0-based file tier per row, in prompt
        order), plus a load's extra steps, faster than computing the tokens from
        ``first_token`` to ``end_token`` (default: one chunk's tokens per row)?"""
        if not tiers:
            return True
        rates = [self.read_rate(t) for t in tiers]
        if not all(rates) or not self.prefill.known():
            return True  # not measured yet: load (and measure)
        read_s = sum(self.row_bytes / r for r in rates) + self._load_overhead()
        end = end_token if end_token is not None else first_token + len(tiers) * self.chunk_tokens
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
        known = self.prefill.known()
        return {"step_s": self.prefill.c if known else None,
                "prefill_s_per_token": self.prefill.a if known else None,
                "prefill_s_per_token_per_context_token": self.prefill.b if known else None,
                **{f"read_bytes_per_s[{i}]": r.value for i, r in enumerate(self._read)}}
