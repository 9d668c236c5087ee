"""Values the engine derives from its plan are computed once per plan."""
from __future__ import annotations

import pytest


def test_rerouted_microbatches_is_computed_once_per_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from ds_recycle.engine import engine as engine_module

    calls: list[object] = []
    monkeypatch.setattr(engine_module, "rerouted_microbatches", lambda plan: calls.append(plan) or 5)
    fake = SimpleNamespace(plan=object(), _rerouted_cache=None)
    prop = engine_module.RecyclePipelineEngine.rerouted_microbatches
    assert [prop.fget(fake) for _ in range(3)] == [5, 5, 5] and len(calls) == 1
    fake.plan = object()  # a plan switch
    assert prop.fget(fake) == 5 and len(calls) == 2
