"""The simulator: exact times on hand-written orders, peak memory, bubble, deadlock detection."""
from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, DeadlockError, PlanError, simulate
from ds_recycle.plan.ops import Op


def _orders(text: dict) -> dict:
    return {w: [Op.parse(t).key for t in ops.split()] for w, ops in text.items()}


def test_two_stage_times() -> None:
    costs = CostModel((1.0, 2.0), (1.0, 2.0), (0.5, 0.5), (0.25, 0.25), comm=0.1)
    orders = _orders({(0, 0): "F0.0 F0.1 B0.0 W0.0 B0.1 W0.1 O",
                      (0, 1): "F0.0 B0.0 F0.1 B0.1 W0.0 W0.1 O"})
    sim = simulate(orders, costs)
    ends = {str(op): op.end for op in sim.workers[(0, 1)]}
    # stage 1: F0.0 at 1.1..3.1, B0.0 3.1..5.1, F0.1 (input ready 2.1) 5.1..7.1, B0.1 7.1..9.1
    assert ends["F0.0"] == pytest.approx(3.1) and ends["B0.1"] == pytest.approx(9.1)
    assert ends["O"] == pytest.approx(10.1 + 0.25)
    stage0 = {str(op): (op.start, op.end) for op in sim.workers[(0, 0)]}
    assert stage0["B0.0"] == pytest.approx((5.2, 6.2))
    assert stage0["B0.1"] == pytest.approx((9.2, 10.2))
    assert stage0["O"] == pytest.approx((10.7, 10.95))   # staggered: after its own W0.1
    assert sim.makespan == pytest.approx(10.95)
    assert sim.peak_memory == {(0, 0): 2, (0, 1): 2}
    busy = 2 * 1 + 2 * 1 + 2 * 0.5 + 0.25 + 2 * 2 + 2 * 2 + 2 * 0.5 + 0.25
    assert sim.bubble_fraction == pytest.approx(1 - busy / (2 * 10.95))


def test_synchronous_optimizer_aligns_o() -> None:
    costs = CostModel((1.0, 2.0), (1.0, 2.0), (0.5, 0.5), (0.25, 0.25), comm=0.1)
    orders = _orders({(0, 0): "F0.0 B0.0 W0.0 O", (0, 1): "F0.0 B0.0 W0.0 O"})
    sim = simulate(orders, costs, optimizer="synchronous")
    starts = {w: ops[-1].start for w, ops in sim.workers.items()}
    assert starts[(0, 0)] == starts[(0, 1)] == pytest.approx(6.7)


def test_deadlock_reported_with_picture() -> None:
    costs = CostModel.uniform(2)
    orders = _orders({(0, 0): "F0.0 B0.0 F0.1 W0.0 B0.1 W0.1 O",
                      (0, 1): "F0.1 B0.1 F0.0 B0.0 W0.0 W0.1 O"})
    # stage 1 wants mb 1 first, stage 0 sends mb 1 only after B0.0, which needs stage 1's B0.0
    with pytest.raises(DeadlockError, match="deadlock") as info:
        simulate(orders, costs)
    text = str(info.value)
    assert "worker (0, 0): next op B0.0" in text and "worker (0, 1): next op F0.1" in text
    assert ">B0.0<" in text


def test_missing_producer_is_an_error() -> None:
    costs = CostModel.uniform(2)
    orders = _orders({(0, 0): "F0.0 B0.0 W0.0 O", (0, 1): "F0.0 F0.1 B0.0 B0.1 W0.0 W0.1 O"})
    with pytest.raises(PlanError, match="needs F at stage 0"):
        simulate(orders, costs)


def test_fused_backward_waits_for_w() -> None:
    costs = CostModel.uniform(2)
    orders = _orders({(0, 0): "F0.0 B0.0 W0.0 O", (0, 1): "F0.0 B0.0 W0.0 O"})
    split = simulate(orders, costs)
    fused = simulate(orders, costs, fused_backward=True)
    assert fused.makespan == pytest.approx(split.makespan + 1.0)
