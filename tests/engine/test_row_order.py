"""Own rows add weight gradients in micro-batch order, whatever order the plan runs them in (engine.row_order)."""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ds_recycle.engine.row_order import RowOrder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import spawn  # noqa: E402


def _recorder(order: RowOrder, done: set[tuple[int, int]],
              ran: list[tuple[int, int]]) -> Callable[[tuple[int, int]], None]:
    def submit(mb: tuple[int, int]) -> None:
        order.submit(mb, lambda: ran.append(mb), done)
    return submit


def test_held_until_predecessors_then_released_in_index_order() -> None:
    order, done, ran = RowOrder(lambda pipeline: pipeline == 0), set(), []  # type: ignore[var-annotated]
    submit = _recorder(order, done, ran)
    for mb in [(0, 2), (1, 3), (0, 3), (1, 0), (0, 0)]:
        submit(mb)
    assert ran == [(1, 3), (1, 0), (0, 0)]  # pipeline 1 keeps a row per micro-batch: never held
    assert order.held == ((0, 2), (0, 3))
    submit((0, 1))
    assert ran[3:] == [(0, 1), (0, 2), (0, 3)] and order.held == ()
    assert done == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 3)}


def test_adopted_prefix_counts_as_done_and_twice_is_refused() -> None:
    order, done, ran = RowOrder(lambda pipeline: True), {(0, 0), (0, 1)}, []  # type: ignore[var-annotated]
    submit = _recorder(order, done, ran)
    submit((0, 2))  # a repaired iteration: 0 and 1 are in the adopted row
    assert ran == [(0, 2)]
    with pytest.raises(RuntimeError, match=r"micro-batch \(0, 2\) is accumulated twice"):
        submit((0, 2))


def test_flush_runs_the_rest_in_order_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    order, done, ran = RowOrder(lambda pipeline: True), set(), []  # type: ignore[var-annotated]
    submit = _recorder(order, done, ran)
    with caplog.at_level(logging.WARNING):
        order.flush(done, "stage 1, iteration 4")  # nothing held: silent
        assert caplog.text == ""
        submit((0, 3))
        submit((0, 2))
        order.flush(done, "stage 1, iteration 4")
    assert ran == [(0, 2), (0, 3)] and "stage 1, iteration 4" in caplog.text
    submit((0, 1))  # (0, 0) never ran: held again, and dropped with an interrupted iteration
    assert order.held == ((0, 1),)
    order.drop()
    assert order.held == ()


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_out_of_order_plan_ends_at_the_in_order_model_bit_for_bit() -> None:
    out = spawn(1, ["tests/engine/_row_order_job.py"], timeout=130)[0]
    report = json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])
    assert report.pop("fp32 split scrambled, plan order") is False  # the order matters: the oracle can fail
    assert report == {k: True for k in report} and len(report) == 6, report
