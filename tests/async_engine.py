"""A model of vLLM's engine core under asynchronous scheduling, for driving the advisor's step
clock as the GPU machine does (``tests/test_advisor.py``, ``tests/test_advisor_replay.py``);
``serve_recorded`` records each step and may have the worker time the forward passes
(``tests/test_step_runs_hostile.py``, ``tests/test_forward_timing.py``).

vLLM's ``step_with_batch_queue`` (batch queue of two): schedule step s (the connector's
``on_schedule_end``), launch its kernels on the scheduler thread itself, and — while the queue
has room and there is more to schedule — schedule the next; otherwise wait for the oldest step's
output and apply it (``update_from_output``, where vLLM asks the connector for its stats). A
launch returns after ``launch_s`` of CPU time, or later where the launch queue fills: then once
only ``queued_share`` of the step's GPU time is left to run. The GPU runs the steps in order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiering.prefill_model import stretch_features

Stretch = tuple[int, int]  # prompt tokens [k, n) of one request

# What the engine models of the step-clock tests share: a step's token budget (vLLM's
# max_num_batched_tokens), the H100's 32B costs (eager: c, a, b; tests/test_advisor.py), the
# launches (launch_s, queued_share: the 32B launch holds the thread half a step, or returns at
# once), and vLLM's orders ((tokens_after_end, asynchronous): 0.32's order or later,
# synchronous or not; the spec's lag is int(asynchronous) - int(tokens_after_end))
BUDGET = 16384
E32 = (0.12, 4e-5, 2.74e-8)
BLOCKING = (0.12, 0.5)
FREE = (0.0005, 1.0)
LAUNCHES = {"blocking": BLOCKING, "free": FREE}
ORDERS = {"sync-0.32": (True, False), "async-0.32": (True, True),
          "sync": (False, False), "async": (False, True)}


def packed_step(rng: random.Random) -> list[Stretch]:
    """One step of one to three whole short prompts (512 to 4096 tokens) within ``BUDGET``."""
    packed, used = [], 0
    for _ in range(rng.randint(1, 3)):
        n = rng.choice((512, 2048, 4096))
        if used + n <= BUDGET:
            packed.append((0, n))
            used += n
    return packed


def gpu_costs(c: float, a: float, b: float) -> Callable[[Sequence[Stretch]], float]:
    """A step's GPU seconds: ``c`` plus ``a`` a prompt token plus ``b`` its attention term."""
    def gpu_s(stretches: Sequence[Stretch]) -> float:
        return c + sum(a * (n - k) + b * (n * n - k * k) / 2 for k, n in stretches if 0 <= k < n)
    return gpu_s


def run_async_engine(adv, steps: Sequence[Sequence[Stretch]], gpu_s: Callable[[Sequence[Stretch]],
                     float], launch_s: float, queued_share: float, outputs: bool = True,
                     start: float = 0.0, schedule_s: float = 0.001,
                     linger: bool = False) -> float:
    """Run ``steps`` (each: the stretches it computes; empty for a decode step) back to back
    from an idle engine at ``start``; ``gpu_s`` prices a step on the GPU. With ``outputs``
    the advisor is told of each output (``step_output``), else only of the step ends. Returns
    when the last output was applied. ``linger``: an empty step is still queued when the first
    step is scheduled (the previous request's last step, scheduled before its end was known);
    its output is taken after the first step's launch."""
    if linger:
        steps = [[], *steps]
    now = gpu_free = start
    queue: list[float] = []  # GPU end of each step in flight, oldest first
    i = 0
    while i < len(steps) or queue:
        if i < len(steps):
            for k, n in steps[i]:
                adv.computes(k, n)
            now += schedule_s
            adv.step_end(now)
            g = 0.0 if linger and i == 0 else gpu_s(steps[i])
            gpu_end = max(now, gpu_free) + g
            gpu_free = gpu_end
            now = max(now + launch_s, gpu_end - queued_share * g)  # the launch returns
            queue.append(gpu_end)
            i += 1
            if len(queue) < 2 and i < len(steps):
                continue
        now = max(now, queue.pop(0)) + schedule_s
        if outputs:
            adv.step_output(now)
    return now


@dataclass
class Rec:
    """One step as the engine ran it."""
    stretches: list
    tokens: float = 0.0
    attention: float = 0.0
    sched: float = math.nan  # its schedule end (the clock's step_end)
    gstart: float = math.nan
    gend: float = math.nan
    g: float = 0.0
    out: float = math.nan  # when its output was taken (the clock's output)
    ahead: bool = False  # the next step was scheduled before this one's output was taken
    number: int | None = None  # the advisor's number for it (forward timing), if any
    # the forward-pass seconds, by number, the worker reported in this step's output
    report: dict = field(default_factory=dict)


def serve_recorded(adv, steps, gpu_s, launch_s: float, queued_share: float, *, depth: int = 2,
                   after_end: bool = False, start: float = 0.0, schedule_s: float = 0.001,
                   hold: float = 0.0, rng: random.Random | None = None,
                   worker: list[Rec] | None = None) -> tuple[list[Rec], float]:
    """``run_async_engine`` generalised and recorded: a batch queue of ``depth`` steps (1:
    synchronous scheduling), the step's chunks offered before its step end or after it
    (``after_end``: vLLM 0.32), and with probability ``hold`` the scheduler has nothing to
    schedule ahead yet (it takes the oldest output first). Given a ``worker`` (the steps it has
    timed and not yet reported; the same list from call to call, as the worker keeps its
    timer), the worker times the forward passes as ``TieredOffloadingConnector`` does: each
    step numbered once scheduled (``forward_step``), its GPU span reported in the output of the
    first step launched after it ended on the GPU (the worker's metadata is built once the
    step's launch returned), the times handed to the advisor before that output is taken.
    Returns the steps' records and when the last output was taken."""
    recs = []
    for st in steps:
        r = Rec(list(st))
        for k, n in st:
            if 0 <= k < n:
                x1, x2 = stretch_features(k, n)
                r.tokens += x1
                r.attention += x2
        recs.append(r)
    now = gpu_free = start
    queue: list[int] = []
    i = 0
    while i < len(recs) or queue:
        if i < len(recs):
            r = recs[i]
            if not after_end:
                for k, n in r.stretches:
                    adv.computes(k, n)
            now += schedule_s
            adv.step_end(now)
            r.sched = now
            if after_end:
                for k, n in r.stretches:
                    adv.computes(k, n)
            if worker is not None:
                r.number = adv.forward_step()
            if queue and queue[-1] == i - 1:
                recs[i - 1].ahead = True
            r.g = gpu_s(r.stretches)
            r.gstart = max(now, gpu_free)
            r.gend = gpu_free = r.gstart + r.g
            now = max(now + launch_s, r.gend - queued_share * r.g)  # the launch returns
            if worker is not None and r.number is not None:
                worker.append(r)
                while worker and worker[0].gend <= now:  # done by now, in step order
                    done = worker.pop(0)
                    r.report[done.number] = done.g
            queue.append(i)
            i += 1
            if (len(queue) < depth and i < len(recs)
                    and not (rng is not None and rng.random() < hold)):
                continue
        j = queue.pop(0)
        now = max(now, recs[j].gend) + schedule_s
        recs[j].out = now
        if recs[j].report:
            adv.forward_times(recs[j].report)
        adv.step_output(now)
    return recs, now
