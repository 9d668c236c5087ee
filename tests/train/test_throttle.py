"""The baseline's injected slow accelerator: DeepSpeed's compute instructions take F times as long from iteration N."""
from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
from deepspeed.runtime.pipe import schedule

from ds_recycle.train import throttle
from ds_recycle.train.throttle import THROTTLED, throttle_pipeline_engine


class _Engine:
    """DeepSpeed's dispatch: the handler of each instruction is looked up in ``self._INSTRUCTION_MAP``."""

    _INSTRUCTION_MAP: ClassVar[dict[type, Any]] = {}
    global_steps = 0

    def busy(self, **kwargs: Any) -> None:
        end = time.thread_time() + 0.05  # 50 ms of this thread's CPU: what the timer counts as device time
        while time.thread_time() < end:
            pass

    def quick(self, **kwargs: Any) -> None:
        pass


_Engine._INSTRUCTION_MAP = {**{kind: _Engine.busy for kind in THROTTLED}, schedule.LoadMicroBatch: _Engine.quick}


def test_compute_instructions_slow_down_from_the_given_iteration_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(throttle.time, "sleep", slept.append)
    engine = _Engine()
    throttle_pipeline_engine(engine, [(3, 1.0), (2, 3.0)])  # order given does not matter: sorted by iteration
    assert _Engine._INSTRUCTION_MAP[schedule.ForwardPass] is _Engine.busy  # the class's table is left alone
    engine._INSTRUCTION_MAP[schedule.ForwardPass](engine, buffer_id=0)
    assert slept == []  # iteration 0: full speed
    engine.global_steps = 2
    for kind in THROTTLED:
        engine._INSTRUCTION_MAP[kind](engine, buffer_id=0)
    assert len(slept) == 3 and all(0.09 <= s <= 0.5 for s in slept), slept  # twice the 50 ms of work
    assert engine._INSTRUCTION_MAP[schedule.LoadMicroBatch] is _Engine.quick  # data loading is not compute
    engine.global_steps = 3
    engine._INSTRUCTION_MAP[schedule.BackwardPass](engine, buffer_id=0)
    assert len(slept) == 3  # factor 1 from iteration 3: full speed again
