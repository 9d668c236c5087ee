from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, Op, OpKind, PlanError


@pytest.mark.parametrize("text", ["F0.3", "B1.0@2", "W0.3", "O", "O@1", "F12.345@7"])
def test_op_round_trip(text: str) -> None:
    op = Op.parse(text)
    assert str(op) == text
    assert Op.parse(str(op)).key == op.key


def test_op_fields() -> None:
    op = Op.parse("B1.0@2")
    assert (op.kind, op.iteration, op.mb) == (OpKind.B, 2, (1, 0))
    assert Op.parse("O").mb is None


@pytest.mark.parametrize("text", ["X0.1", "F0", "F0.1@", "O0.1", "", "F-1.2"])
def test_op_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse op"):
        Op.parse(text)


def test_op_needs_mb_unless_o() -> None:
    with pytest.raises(ValueError):
        Op(OpKind.F, 0, None)
    with pytest.raises(ValueError):
        Op(OpKind.O, 0, (0, 1))


def test_costs_json_round_trip(tmp_path) -> None:
    costs = CostModel((1, 2), (2, 3), (0.5, 1), (0.1, 0.2), 0.05)
    assert CostModel.from_json(costs.to_json()) == costs
    doc = dict(costs.to_json(), units="ms", device="cpu")
    path = tmp_path / "profile.json"
    import json
    path.write_text(json.dumps(doc))
    assert CostModel.from_file(path) == costs
    assert costs.stages == 2 and costs.work(1) == 6.0


@pytest.mark.parametrize("bad, match", [
    ({"F": [1], "B": [1], "W": [1], "O": [1]}, "missing"),
    ({"F": [1], "B": [1, 2], "W": [1], "O": [1], "comm": 0}, "costs.B has 2 stages"),
    ({"F": [-1], "B": [1], "W": [1], "O": [1], "comm": 0}, r"costs.F\[0\] = -1"),
    ({"F": "1", "B": [1], "W": [1], "O": [1], "comm": 0}, "list of numbers"),
])
def test_costs_reject(bad: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        CostModel.from_json(bad)


def test_costs_file_errors(tmp_path) -> None:
    with pytest.raises(PlanError, match="cost file"):
        CostModel.from_file(tmp_path / "missing.json")
