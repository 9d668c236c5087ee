from __future__ import annotations

import json

import pytest

from ds_recycle.plan import CostModel, Plan, PlanError, StageLostError, make_plan, validate_document, validate_plan
from ds_recycle.plan.ops import Op, OpKind
from ds_recycle.plan.plan import write_plan_json


def test_json_round_trip(small_plan: Plan) -> None:
    doc = small_plan.to_json()
    assert doc["format"] == "ds-recycle-plan/1"
    assert doc["makespan"] == small_plan.makespan
    again = Plan.from_json(json.loads(json.dumps(doc)))
    assert again.to_json() == doc
    assert again.workers == small_plan.workers


def test_document_keys(small_plan: Plan) -> None:
    doc = small_plan.to_json()
    assert set(doc) == {"format", "stages", "pipelines", "microbatches", "iterations", "optimizer",
                        "memory_limit", "costs", "failed", "makespan", "workers"}
    assert doc["failed"] == [[1, 1]]
    assert {(w["pipeline"], w["stage"]) for w in doc["workers"]} == set(small_plan.workers)
    op = doc["workers"][0]["ops"][0]
    assert set(op) == {"kind", "iter", "mb", "start", "end"}
    o_ops = [o for w in doc["workers"] for o in w["ops"] if o["kind"] == "O"]
    assert o_ops and all("mb" not in o for o in o_ops)


def test_worker_of_and_rerouted(small_plan: Plan) -> None:
    assert small_plan.worker_of(1, (1, 0)) == (0, 1)  # the failed worker's peer
    assert small_plan.worker_of(0, (1, 0)) == (1, 0)
    assert small_plan.worker_of(2, (1, 3)) == (1, 2)
    rerouted = small_plan.rerouted()
    assert rerouted == [((0, 1), (1, i)) for i in range(4)]
    with pytest.raises(PlanError):
        small_plan.worker_of(1, (5, 0))


def test_relabel(small_plan: Plan) -> None:
    swapped = small_plan.relabel([1, 0])
    validate_plan(swapped)
    assert swapped.failed == frozenset({(0, 1)})
    assert swapped.makespan == small_plan.makespan
    assert swapped.worker_of(1, (0, 2)) == (1, 1)


def test_stage_lost() -> None:
    with pytest.raises(StageLostError, match="every one of the 2 workers of stage 1") as info:
        make_plan(3, 2, 4, CostModel.uniform(3), [(0, 1), (1, 1)])
    assert info.value.stage == 1
    assert isinstance(info.value, PlanError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "gpipe"}, "schedule"), ({"optimizer": "eager"}, "optimizer"),
    ({"memory_limit": 0}, "memory_limit"), ({"iterations": 0}, "iterations"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make_plan(3, 2, 4, CostModel.uniform(3), **kwargs)


def test_bad_shape() -> None:
    with pytest.raises(PlanError, match="cost model has 3 stages"):
        make_plan(4, 2, 4, CostModel.uniform(3))
    with pytest.raises(PlanError, match="outside 2 pipelines"):
        make_plan(3, 2, 4, CostModel.uniform(3), [(2, 0)])


def test_grid_picture(small_plan: Plan) -> None:
    picture = small_plan.grid(((0, 1), 3))
    assert "p0s1 |" in picture and ">" in picture
    assert f">{small_plan.workers[(0, 1)][3]}<" in picture
    assert all(op.kind in OpKind for ops in small_plan.workers.values() for op in ops)


def test_planner_imports_neither_torch_nor_deepspeed() -> None:
    import subprocess
    import sys
    code = ("import sys, ds_recycle.plan, ds_recycle.plan.cli, ds_recycle.plan.exact, ds_recycle.plan.trace; "
            "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_write_plan_json_is_the_document(small_plan: Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    write_plan_json(small_plan, path)
    doc = json.loads(path.read_text())
    assert doc == small_plan.to_json()
    validate_document(doc)


def test_trusted_op_is_an_op() -> None:
    fast = Op.trusted(OpKind.B, 1, (2, 3), 1.5, 2.5)
    assert fast == Op(OpKind.B, 1, (2, 3), 1.5, 2.5) and hash(fast) == hash(Op(OpKind.B, 1, (2, 3), 1.5, 2.5))
    assert str(fast) == "B2.3@1" and {OpKind.B: 1}[OpKind("B")] == 1
