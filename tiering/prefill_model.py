"""The engine's prefill cost, fitted from the steps it runs: what loading a disk run saves.

A step costs ``c`` whatever it computes, and a prompt token at position ``p`` costs
``a + b * p`` (``a``: the per-token layers; ``b``: attention over the ``p`` tokens before it). A
step that computes tokens ``[k, n)`` of one request takes ``c + a (n - k) + b (n^2 - k^2) / 2``;
of several, the sums. The three are fitted by least squares, non-negative, with exponential
forgetting over the last steps, a stalled step left out (``PrefillModel``), to the steps the
engine ran, as the step clock times them (``tiering.step_clock``: each step's forward pass on
the worker by default, else its output or the scheduler's step ends). A fixed
``prefill_tokens_per_s`` in the config replaces the fit. Each sample is logged at DEBUG with the
fit it gave.

Why per step: timed by store *completions* (as before), every sample was one step late, since
vLLM submits a step's stores at the start of the next step and reports them after it. On the
H200 a 32k-token prompt's second half then took one decode step (25 ms) and its first half both
halves' time; the fit became one per-token cost of 116 µs (true: 24 µs plus attention), which
put a 2k prompt at 0.24 s (true 0.07 s) and loaded the 2k and 8k disk hits that recomputing
beat by 4x and 2x (``tests/test_advisor_replay.py``).

The promotion advisor (``tiering.advisor``) owns one model and its clock. Scheduler thread only;
nothing here blocks.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import numpy as np

from tiering.settings import (
    ADVISOR_MODEL_WEIGHT,
    ADVISOR_MODEL_WINDOW,
    ADVISOR_OUTLIER_MIN_S,
    ADVISOR_OUTLIER_RATIO,
    ADVISOR_OUTLIER_ROUNDS,
)

log = logging.getLogger(__name__)


def stretch_features(k: int, n: int) -> tuple[float, float]:
    """The per-token and attention features of computing prompt tokens ``[k, n)``."""
    return float(n - k), (float(n) * n - float(k) * k) / 2.0


class PrefillModel:
    """Seconds a step takes: ``c + a * x1 + b * x2``, where ``x1`` is the prompt tokens it
    computes and ``x2`` their attention term (``(n^2 - k^2) / 2`` for tokens ``[k, n)`` of a
    request, summed over the step's requests).

    ``c`` is what a step costs whatever it computes (scheduling, launches, the store copy):
    loading does not save it (the request still needs a step for its last tokens) and pays it
    again for each extra step a load takes. ``a`` and ``b`` are the per-token and attention
    costs that loading saves.

    The fit: weighted least squares over the last ``ADVISOR_MODEL_WINDOW`` steps, each step's
    weight ``(1 - ADVISOR_MODEL_WEIGHT)`` times the next one's (exponential forgetting), every
    coefficient non-negative. Of the fits on a subset of the three terms the best one wins,
    the richer subsets preferred on a tie (samples of one length fit a per-token cost alone
    exactly, and a constant alone too: the per-token reading is the one that lets a disk hit
    pay). Two rules keep one bad step from owning the fit:

    * ``c`` is at most the shortest kept step's time: every term is non-negative, so no step
      takes less than ``c``. Without it, the H200's 2k and 8k steps (35-60 and 370-400 ms) and
      one first step of 64 tokens that took 1.7 s (kernels compiled) fitted ``c`` = 0.27 s with
      no per-token cost: a load was priced at two such steps and recomputing a 32k prompt at
      3.2 s instead of 4.5, and the first engine recomputed the 32k disk hit its restart loaded
      in 2.9 s.
    * a step that took more than ``ADVISOR_OUTLIER_RATIO`` times what the other kept steps
      predict for it (and ``ADVISOR_OUTLIER_MIN_S`` more) is left out, the worst first, and
      the rest fitted again, for up to ``ADVISOR_OUTLIER_ROUNDS`` rounds; never more than
      half of them."""

    # term subsets, preferred first on equal error: (c, a, b) flags
    _SUBSETS = ((1, 1, 1), (0, 1, 1), (1, 1, 0), (0, 1, 0), (1, 0, 1), (0, 0, 1), (1, 0, 0))

    def __init__(self, tokens_per_s: float | None = None, label: str = "prefill") -> None:
        self.fixed = tokens_per_s
        self.label = label  # in its DEBUG lines
        # the kept samples, oldest first: (tokens, attention, seconds, steps); a sample is one
        # step or a run of consecutive steps (StepClock)
        self._steps: deque[tuple[float, float, float, float]] = deque(maxlen=ADVISOR_MODEL_WINDOW)
        self.samples = 0  # steps added since the model began (restores included)
        self.outliers = 0  # kept steps the last fit left out
        self.c, self.a, self.b = 0.0, (1.0 / tokens_per_s if tokens_per_s else 0.0), 0.0
        # where set, ``c`` is this (at most the fastest kept step) and only ``a`` and ``b`` are
        # fitted: the step cost as another clock measured it (``StepClock``, timed by outputs)
        self.step_cost: float | None = None

    def add(self, k: int, n: int, seconds: float) -> None:
        """A step computed tokens ``[k, n)`` of one request in ``seconds``."""
        if not 0 <= k < n:
            return  # no usable sample (a negative k could zero the attention term: x2 = 0)
        self.add_step(*stretch_features(k, n), seconds)

    def add_step(self, tokens: float, attention: float, seconds: float, steps: int = 1) -> None:
        """``steps`` consecutive steps computed ``tokens`` prompt tokens with attention term
        ``attention`` (sums over their requests) in ``seconds``."""
        if (self.fixed or not 0 < tokens < math.inf or not 0 < attention < math.inf
                or not 0 < seconds < math.inf or not 1 <= steps <= ADVISOR_MODEL_WINDOW
                or steps != math.floor(steps)):  # what restore refuses, never kept
            return
        self._steps.append((float(tokens), float(attention), float(seconds), float(steps)))
        self.samples += 1
        self._solve()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s sample: %d tokens, attention %.4g, %.4f s, %d steps; fit c %.4g a %.4g"
                      " b %.4g (%d of %d samples left out)", self.label, tokens, attention,
                      seconds, steps, self.c, self.a, self.b, self.outliers, len(self._steps))

    def _solve(self) -> None:
        steps = np.array(self._steps)
        x = np.column_stack([steps[:, 3], steps[:, 0], steps[:, 1]])
        t = steps[:, 2]
        w = (1.0 - ADVISOR_MODEL_WEIGHT) ** np.arange(len(steps) - 1, -1, -1.0)
        coef = self._fit(x, t, w, step_cost=self.step_cost)
        if coef is None:
            return  # nothing fits: keep the last model
        # Each step is judged against what the others predict for it (its leave-one-out
        # prediction: a lone stalled step of few tokens, such as the restarted H200 engine's
        # 64-token first step of 0.15 s, fits itself as c when it is in the fit); the worst
        # stall is left out, then the next is looked for among the rest, a few rounds. The
        # floor of ADVISOR_OUTLIER_MIN_S keeps a step cost below it from being judged.
        out = np.zeros(len(t), dtype=bool)
        self.outliers = 0
        for _ in range(ADVISOR_OUTLIER_ROUNDS):
            keep = ~out
            if 2 * (int(out.sum()) + 1) > len(t):
                break  # never more than half: a slower engine is learned, not rejected
            others = np.full(len(t), np.nan)
            others[keep] = _leave_one_out(x[keep], t[keep], w[keep])
            others = np.maximum(others, 0.0)
            stalled = (keep & np.isfinite(others) & (t > ADVISOR_OUTLIER_RATIO * others)
                       & (t > others + ADVISOR_OUTLIER_MIN_S))
            if not stalled.any():
                break
            worst = int(np.argmax(np.where(stalled, t - others, -np.inf)))
            out[worst] = True
            refit = self._fit(x[~out], t[~out], w[~out], step_cost=self.step_cost)
            if refit is None:
                out[worst] = False
                break
            coef, self.outliers = refit, int(out.sum())
        self.c, self.a, self.b = (float(v) for v in coef)

    @classmethod
    def _fit(cls, x: np.ndarray, t: np.ndarray, w: np.ndarray, with_step: bool = True,
             step_cost: float | None = None) -> np.ndarray | None:
        """The best non-negative fit of ``t ~ x @ (c, a, b)`` with weights ``w`` and ``c`` at
        most ``min(t / x[:, 0])`` (a sample's time a step: ``x[:, 0]`` counts its steps; ``c``
        = 0 unless ``with_step``; ``c`` = ``step_cost`` where given, capped the same way), over
        the term subsets; None if no subset fits."""
        cap = float((t / x[:, 0]).min())
        if step_cost is not None:
            cap = min(cap, max(0.0, step_cost))
        # scale the columns to comparable sizes so the small systems stay well conditioned
        scale = np.sqrt(np.maximum(w @ (x * x), 1e-300))
        xs = x / scale
        s = xs.T @ (w[:, None] * xs)
        r = xs.T @ (w * t)
        norm = float(w @ (t * t)) or 1.0
        best, best_err = None, math.inf
        for flags in cls._SUBSETS:
            if (flags[0] and not with_step) or (not flags[0] and step_cost is not None):
                continue
            idx = [i for i in range(3) if flags[i]]
            coef = np.zeros(3)
            given = bool(flags[0]) and step_cost is not None
            if not given:
                sub = s[np.ix_(idx, idx)]
                if np.linalg.cond(sub) > 1e8:  # these terms cannot be told apart by the samples
                    continue
                coef[idx] = np.linalg.solve(sub, r[idx])
            if flags[0] and (given or coef[0] / scale[0] > cap):
                # no step is faster than c: fix it at the fastest step, fit the rest to what
                # is left of each step
                coef[:] = 0.0
                coef[0] = cap * scale[0]
                rest = idx[1:]
                if rest:
                    left = t - cap * x[:, 0]
                    sub_rest = s[np.ix_(rest, rest)]
                    if np.linalg.cond(sub_rest) > 1e8:
                        continue
                    coef[rest] = np.linalg.solve(sub_rest, xs[:, rest].T @ (w * left))
            if np.any(coef < 0):
                continue
            resid = t - xs @ coef
            err = float(w @ (resid * resid)) / norm
            if best is None or err < best_err - 1e-9:
                best, best_err = coef, err
        return None if best is None else best / scale

    def known(self) -> bool:
        return bool(self.fixed) or self.samples > 0

    def state(self) -> dict[str, object]:
        """The kept samples and the fit, as JSON values (``restore`` takes them)."""
        return {"steps": [list(step) for step in self._steps], "samples": self.samples,
                "coef": [self.c, self.a, self.b], "step_cost": self.step_cost}

    def restore(self, state: dict[str, object]) -> None:
        """Continue the fit from ``state`` (a ``state()`` of an earlier engine); ValueError,
        and nothing changed, if it is not one. A fixed rate keeps its fixed model. (The fit's
        decayed sums that versions before the kept steps saved are not one: that engine's fit
        starts afresh.)"""
        try:
            steps = np.array(state["steps"], dtype=float)
            if not steps.size:
                steps = steps.reshape(0, 4)
            if steps.ndim == 2 and steps.shape[1] == 3:  # saved before runs of steps: one each
                steps = np.column_stack([steps, np.ones(len(steps))])
            samples = state["samples"]
            coef = np.array(state["coef"], dtype=float)
            step_cost = state.get("step_cost")  # absent in states saved before 2026-12-06e
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"prefill model: expected steps, samples, coef ({exc})") from None
        if (steps.ndim != 2 or steps.shape[1] != 4 or len(steps) > ADVISOR_MODEL_WINDOW
                or coef.shape != (3,)
                or not isinstance(samples, int) or isinstance(samples, bool)
                or samples < len(steps) or not np.isfinite(coef).all() or (coef < 0).any()
                or not ((steps > 0) & (steps < math.inf)).all()
                or not ((steps[:, 3] >= 1) & (steps[:, 3] <= ADVISOR_MODEL_WINDOW)
                        & (steps[:, 3] == np.floor(steps[:, 3]))).all()
                or not (step_cost is None or (isinstance(step_cost, int | float)
                                              and not isinstance(step_cost, bool)
                                              and 0 <= step_cost < math.inf))):
            raise ValueError(f"prefill model: expected at most {ADVISOR_MODEL_WINDOW} samples of "
                             "3 numbers > 0 (and a whole count of steps from 1 to "
                             f"{ADVISOR_MODEL_WINDOW}), 3 coefficients >= 0, a sample count >= "
                             "the samples and a step cost >= 0 or null")
        if self.fixed:
            return
        if self.step_cost is None and step_cost is not None:
            self.step_cost = float(step_cost)  # until this engine's step ends give their own
        self._steps = deque((tuple(float(v) for v in step) for step in steps),  # type: ignore[misc]
                            maxlen=ADVISOR_MODEL_WINDOW)
        self.samples = samples
        if self._steps:
            self._solve()
        else:
            self.c, self.a, self.b = (float(v) for v in coef)

    def seconds(self, k: int, n: int) -> float:
        """Predicted seconds of the tokens ``[k, n)`` alone (the per-token and attention terms:
        what computing them adds to a step, and so what loading them saves)."""
        x1, x2 = stretch_features(k, n)
        return self.a * x1 + self.b * x2


def _leave_one_out(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each sample's prediction by the weighted least-squares fit of all the others (the
    three terms, unconstrained: a judge of stalls, not the model), from the fit of all of them
    and its leverages; NaN where the others do not determine it."""
    scale = np.sqrt(np.maximum(w @ (x * x), 1e-300))
    xs = x / scale
    inv = np.linalg.pinv(xs.T @ (w[:, None] * xs))
    residual = t - xs @ (inv @ (xs.T @ (w * t)))
    leverage = w * ((xs @ inv) * xs).sum(axis=1)
    others: np.ndarray
    with np.errstate(divide="ignore", invalid="ignore"):
        others = t - residual / (1.0 - leverage)
    others[~np.isfinite(others) | (leverage > 1.0 - 1e-6)] = np.nan
    return others
