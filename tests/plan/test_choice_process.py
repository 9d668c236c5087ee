"""The partition choice in a child process (ds_recycle.plan.choice_process): the same answer as in-process, errors
named, a bound on its time."""
from __future__ import annotations

import json

import pytest

from ds_recycle.plan import Plan
from ds_recycle.plan.choice_process import answer, choice_request, choose_in_child
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.partition import LayerCosts, even_partition


def _request(**overrides: object) -> dict[str, object]:
    layers = LayerCosts.uniform(12, f=1.0, b=1.0, w=1.0, state_bytes=1.0)
    base = even_partition(12, 3)
    request = choice_request(layers, 3, 2, 4, [(0, 1)], base, horizon=50, slow={(1, 2): 2.0},
                             plan_options={"optimizer": "staggered", "memory_limit": None})
    request.update(overrides)
    return request


def test_the_child_answers_as_the_planner_does_in_process() -> None:
    request = _request()
    got = choose_in_child(request, 60)
    assert got == json.loads(json.dumps(answer(request)))
    assert got["partition"] != request["current"] and got["planned_after"] < got["planned_before"]
    plan = Plan.from_json(got["plan"])
    assert plan.partition == tuple(got["partition"])


def test_a_bad_request_is_an_error_naming_the_cause() -> None:
    with pytest.raises(PlanError, match="child process exited with 1: .*current partition"):
        choose_in_child(_request(current=[0, 5, 4, 12]), 60)


def test_a_choice_over_its_time_is_killed() -> None:
    with pytest.raises(PlanError, match="longer than 0.01 s"):
        choose_in_child(_request(), 0.01)
