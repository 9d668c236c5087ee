"""The validator rejects hand-broken plans, one test per rule, with the failing op and the grid."""
from __future__ import annotations

import dataclasses

import pytest

from ds_recycle.plan import CostModel, Plan, PlanValidationError, make_plan, validate_plan
from ds_recycle.plan.ops import Op, OpKind
from ds_recycle.plan.validate import check_channels, validate_document


@pytest.fixture
def plan() -> Plan:
    costs = CostModel.uniform(3, 1.0, 1.0, 1.0, 0.5, 0.1)
    return make_plan(3, 2, 4, costs, [(1, 1)], iterations=2, memory_limit=4)


def _with(plan: Plan, worker, ops) -> Plan:
    workers = dict(plan.workers)
    workers[worker] = tuple(ops)
    return dataclasses.replace(plan, workers=workers)


def _index(plan: Plan, worker, text: str) -> int:
    return next(i for i, op in enumerate(plan.workers[worker]) if str(op) == text)


def _expect(plan: Plan, rule: int, match: str) -> PlanValidationError:
    with pytest.raises(PlanValidationError, match=match) as info:
        validate_plan(plan)
    assert info.value.rule == rule
    assert "p0s0 |" in str(info.value)  # the grid picture
    return info.value


def test_valid_plan_passes(plan: Plan) -> None:
    validate_plan(plan)
    check_channels(plan)
    validate_document(plan.to_json())


def test_rule1_missing_op(plan: Plan) -> None:
    ops = list(plan.workers[(0, 2)])
    del ops[_index(plan, (0, 2), "W0.1")]
    _expect(_with(plan, (0, 2), ops), 1, "no W of micro-batch")


def test_rule1_duplicate_op(plan: Plan) -> None:
    ops = list(plan.workers[(0, 2)])
    ops.append(ops[0])
    err = _expect(_with(plan, (0, 2), ops), 1, "runs twice")
    assert err.op == str(ops[0])


def test_rule1_split_across_workers(plan: Plan) -> None:
    a, b = list(plan.workers[(0, 2)]), list(plan.workers[(1, 2)])
    i = _index(plan, (0, 2), "W0.0")
    b.append(a.pop(i))
    broken = _with(_with(plan, (0, 2), a), (1, 2), b)
    _expect(broken, 1, "different workers")


def test_rule1_failed_worker_has_ops(plan: Plan) -> None:
    _expect(_with(plan, (1, 1), plan.workers[(0, 1)]), 1, "failed worker")


def test_rule2_wrong_duration(plan: Plan) -> None:
    ops = list(plan.workers[(0, 0)])
    op = ops[-1]
    ops[-1] = Op(op.kind, op.iteration, op.mb, op.start, op.end + 0.5)
    _expect(_with(plan, (0, 0), ops), 2, "lasts")


def test_rule3_overlap(plan: Plan) -> None:
    ops = list(plan.workers[(0, 0)])
    first, second = ops[0], ops[1]
    ops[1] = Op(second.kind, second.iteration, second.mb, first.start + 0.5, first.start + 1.5)
    _expect(_with(plan, (0, 0), ops), 3, "before the previous op ends")


def test_rule4_forward_before_input(plan: Plan) -> None:
    ops = list(plan.workers[(0, 1)])
    i = _index(plan, (0, 1), "F0.0")
    op = ops[i]
    ops[i] = Op(op.kind, op.iteration, op.mb, op.start - 0.05, op.end - 0.05)  # comm is 0.1
    err = _expect(_with(plan, (0, 1), ops), 4, "before its input is ready")
    assert err.op == "F0.0"


def test_rule4_w_before_b(plan: Plan) -> None:
    ops = list(plan.workers[(0, 2)])
    i, j = _index(plan, (0, 2), "B0.0"), _index(plan, (0, 2), "W0.0")
    b, w = ops[i], ops[j]
    ops[i], ops[j] = Op(b.kind, b.iteration, b.mb, w.start, w.end), Op(w.kind, w.iteration, w.mb, b.start, b.end)
    ops.sort(key=lambda o: o.start)
    _expect(_with(plan, (0, 2), ops), 4, "before its input is ready")


def test_rule5_missing_o(plan: Plan) -> None:
    ops = [op for op in plan.workers[(0, 0)] if not (op.kind is OpKind.O and op.iteration == 1)]
    _expect(_with(plan, (0, 0), ops), 5, "no O in iteration 1")


def test_rule5_o_not_together(plan: Plan) -> None:
    ops = list(plan.workers[(1, 0)])
    i = _index(plan, (1, 0), "O@1")
    op = ops[i]
    ops[i] = Op(op.kind, op.iteration, None, op.start + 1, op.end + 1)
    _expect(_with(plan, (1, 0), ops), 5, "another O of stage 0 starts")


def test_rule5_next_iteration_before_o(plan: Plan) -> None:
    ops = list(plan.workers[(0, 2)])
    i = _index(plan, (0, 2), "O")
    o, nxt = ops[i], ops[i + 1]
    ops[i + 1] = Op(nxt.kind, nxt.iteration, nxt.mb, o.start + 0.1, o.start + 0.1 + (nxt.end - nxt.start))
    broken = _with(plan, (0, 2), ops)
    with pytest.raises(PlanValidationError) as info:
        validate_plan(broken)
    assert info.value.rule in (3, 5)


def test_rule5_synchronous(plan: Plan) -> None:
    sync = dataclasses.replace(plan, optimizer="synchronous")
    _expect(sync, 5, "another O of the iteration")


def test_rule6_memory(plan: Plan) -> None:
    tight = dataclasses.replace(plan, memory_limit=1)
    err = _expect(tight, 6, "over memory_limit 1")
    assert err.op.startswith("F")


def test_rule7_makespan_field(plan: Plan) -> None:
    doc = plan.to_json()
    doc["makespan"] += 1.0
    with pytest.raises(PlanValidationError) as info:
        validate_document(doc)
    assert info.value.rule == 7


def test_channel_order(plan: Plan) -> None:
    ops = list(plan.workers[(0, 1)])
    i, j = _index(plan, (0, 1), "F0.0"), _index(plan, (0, 1), "F0.1")
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(PlanValidationError, match="sent in order"):
        check_channels(_with(plan, (0, 1), ops))
