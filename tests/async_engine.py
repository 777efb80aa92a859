"""A model of vLLM's engine core under asynchronous scheduling, for driving the advisor's step
clock as the GPU machine does (``tests/test_advisor.py``, ``tests/test_advisor_replay.py``).

vLLM's ``step_with_batch_queue`` (batch queue of two): schedule step s (the connector's
``on_schedule_end``), launch its kernels on the scheduler thread itself, and — while the queue
has room and there is more to schedule — schedule the next; otherwise wait for the oldest step's
output and apply it (``update_from_output``, where vLLM asks the connector for its stats). A
launch returns after ``launch_s`` of CPU time, or later where the launch queue fills: then once
only ``queued_share`` of the step's GPU time is left to run. The GPU runs the steps in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Stretch = tuple[int, int]  # prompt tokens [k, n) of one request


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
