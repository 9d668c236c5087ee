"""Shared helpers of the planner tests (pure Python; no torch)."""
from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, Plan, make_plan


@pytest.fixture
def small_plan() -> Plan:
    """S=3, D=2, M=4, K=2, worker (1, 1) failed, O and comm non-zero."""
    costs = CostModel.uniform(3, 1.0, 1.0, 1.0, 0.5, 0.1)
    return make_plan(3, 2, 4, costs, [(1, 1)], iterations=2)
