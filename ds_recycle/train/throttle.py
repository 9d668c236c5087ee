"""An injected slow accelerator in DeepSpeed's own ``PipelineEngine``: the baseline side of a fail-slow run.

``--slow P:S@N*F`` makes worker (pipeline P, stage S) of a ds_recycle job follow each of its forward, backward and
optimizer-step instructions with ``F - 1`` times that instruction's own duration of sleep, from iteration N on
(:mod:`ds_recycle.resilience.injection`). :func:`throttle_pipeline_engine` does the same to a vanilla DeepSpeed
engine, so that both systems meet the same slow worker: DeepSpeed's ``ForwardPass``, ``BackwardPass`` (forward
and fused backward: its F and B+W) and ``OptimizerStep``, timed on the training thread as ds_recycle times its own
(:class:`~ds_recycle.engine.op_clock.DeviceTimer`). The engine's instruction table is replaced on the instance
only: DeepSpeed looks each instruction's handler up through ``self._INSTRUCTION_MAP``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from deepspeed.runtime.pipe import schedule

from ds_recycle.engine.op_clock import DeviceTimer

__all__ = ["THROTTLED", "throttle_pipeline_engine"]

THROTTLED = (schedule.ForwardPass, schedule.BackwardPass, schedule.OptimizerStep)
"""DeepSpeed's instructions a slow accelerator slows: its compute."""


def throttle_pipeline_engine(engine: Any, slowdowns: Sequence[tuple[int, float]]) -> None:
    """Slow ``engine`` down by ``factor`` from iteration ``it`` on, for each ``(it, factor)`` of ``slowdowns``
    (a later one replaces an earlier one; factor 1 is full speed again). The iteration is the engine's
    ``global_steps`` as the instruction runs: the number of optimizer steps taken."""
    if not slowdowns:
        return
    steps = sorted(slowdowns)
    timer = DeviceTimer()

    def factor() -> float:
        now = 1.0
        for iteration, value in steps:
            if engine.global_steps >= iteration:
                now = value
        return now

    def slowed(handler: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = timer.now()
            result = handler(self, *args, **kwargs)
            extra = factor() - 1.0
            if extra > 0:
                time.sleep(max(0.0, timer.now() - start) * extra)
            return result
        return run

    table = dict(engine._INSTRUCTION_MAP)
    for kind in THROTTLED:
        table[kind] = slowed(table[kind])
    engine._INSTRUCTION_MAP = table
