"""The per-worker clock of F, B, W, O and receives, and the costs per stage made from every worker's figures."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.op_clock import EVENT_ITERATIONS, KINDS, DeviceTimer, OpClock, stage_costs, timed_kind


def test_medians_over_the_window_and_the_repaired_iteration_left_out() -> None:
    clock = OpClock(window=2)
    for f, seconds in [(9.0, 90.0), (1.0, 10.0), (3.0, None)]:
        clock.record("F", f)
        clock.record("F", f + 1)
        clock.end_iteration(seconds)
    assert clock.medians() == {"F": 2.5}, "only the last two iterations' four forwards"
    assert clock.iteration_median() == 50.0, "the repaired iteration's time (None) is not an iteration's"


def test_stage_costs_average_replicas_and_split_a_fused_backward() -> None:
    rows = torch.zeros(2, len(KINDS), 2, dtype=torch.float64)
    first, second = OpClock(), OpClock()
    for kind, value in (("F", 1.0), ("B", 2.0), ("W", 3.0), ("O", 4.0)):
        first.record(kind, value)
    second.record("F", 2.0)
    second.record("BW", 6.0)
    for seconds in [0.5] + [3.0] * 9:  # the quickest tenth of receives: the transfer; the rest waited for a sender
        second.record("R", seconds)
    first.end_iteration(1.0)
    second.end_iteration(1.0)
    rows[0] += first.as_row()
    rows[0] += first.as_row()  # two replicas of stage 0 measured the same
    rows[1] += second.as_row()
    costs = stage_costs(rows)
    assert costs is not None
    assert (costs.F, costs.B, costs.W, costs.O, costs.comm) == ((1.0, 2.0), (2.0, 3.0), (3.0, 3.0), (4.0, 0.0), 0.5)


def test_a_stage_without_a_forward_gives_no_costs() -> None:
    rows = torch.zeros(2, len(KINDS), 2, dtype=torch.float64)
    clock = OpClock()
    clock.record("F", 1.0)
    clock.end_iteration(1.0)
    rows[0] += clock.as_row()
    assert stage_costs(rows) is None
    with pytest.raises(ValueError, match="window=0"):
        OpClock(window=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue waits are read from Linux's procfs")
def test_device_timer_counts_sleeps_but_not_waits_for_a_core() -> None:
    """This process and a busy child share one core: a fixed amount of work takes about twice its wall time, and
    the timer counts about the work alone; a sleep (an emulated or throttled device) counts in full."""
    timer = DeviceTimer()
    assert timer.excludes_waits
    try:
        before = timer.now()
        time.sleep(0.2)
        assert timer.now() - before >= 0.19
        core = sorted(os.sched_getaffinity(0))[0]
        old = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {core})
        hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
        try:
            time.sleep(0.3)  # the child runs
            wall, timed, work = time.perf_counter(), timer.now(), time.process_time()
            while time.process_time() - work < 0.4:  # 0.4 s of this thread's own CPU time
                pass
            wall, timed = time.perf_counter() - wall, timer.now() - timed
        finally:
            hog.kill()
            hog.wait(10)
            os.sched_setaffinity(0, old)
        assert wall > 0.6, f"the child did not compete for the core ({wall:.2f} s wall for 0.4 s of CPU)"
        assert 0.35 < timed < 0.6, f"timer {timed:.2f} s for 0.4 s of work ({wall:.2f} s wall)"
    finally:
        timer.close()


def test_receives_from_peers_are_timed_and_a_repair_from_the_own_log_is_not() -> None:
    def pending(_: int) -> bool:
        return True

    assert timed_kind(ins.RecvActivationFrom(buffer_id=0, micro_batch=(0, 0), peer=3), pending, rank=1) == "R"
    assert timed_kind(ins.RecvGradFrom(buffer_id=0, micro_batch=(0, 0), peer=1), pending, rank=1) is None
    assert timed_kind(ins.SendActivationTo(buffer_id=0, micro_batch=(0, 0), peer=3), pending, rank=1) is None


class _Event:
    """An accelerator timing event as the clock uses one (``record``, ``query``, ``elapsed_time`` in ms): its
    device time is set when the test says the device got there."""

    log: list[_Event] = []

    def __init__(self) -> None:
        self.at: float | None = None
        self.recorded = False

    def record(self) -> None:
        self.recorded = True
        _Event.log.append(self)

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None and end.at is not None, "read before the device passed both events"
        return (end.at - self.at) * 1000.0


def test_accelerator_events_are_read_once_passed_and_never_waited_for() -> None:
    _Event.log = []
    clock = OpClock(window=5, events=_Event)
    assert clock.on_device
    for kind in ("F", "B"):
        clock.end(kind, clock.begin(), seconds=99.0)  # the host's reading is not the device's time
    clock.end_iteration(1.0)
    assert clock.medians() == {}, "the device has not run the iteration yet: nothing filed, nothing waited for"
    for n, event in enumerate(_Event.log):
        event.at = [0.0, 0.25, 0.25, 0.75][n]
    clock.end("F", clock.begin(), seconds=99.0)
    clock.end_iteration(2.0)
    assert clock.medians() == {"F": 0.25, "B": 0.5} and clock.iteration_median() == 1.0
    assert clock.pace() == 0.75
    for _ in range(EVENT_ITERATIONS + 1):  # a device that never gets there: the clock keeps a bounded backlog
        clock.end("F", clock.begin(), seconds=1.0)
        clock.end_iteration(1.0)
    assert clock.dropped == 2 and clock.medians() == {"F": 0.25, "B": 0.5}
