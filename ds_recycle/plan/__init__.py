"""The ReCycle planner: schedules as data, adapted F/B/W plans for any failure set, validated,
simulated, cached and drawn. Pure Python: imports neither torch nor DeepSpeed.

    from ds_recycle.plan import CostModel, make_plan, validate_plan
    plan = make_plan(4, 2, 8, CostModel.uniform(4, comm=0.05), failed=[(1, 2)], iterations=2)
    validate_plan(plan); print(plan.grid()); print(plan.time_per_iteration)

Command line: ``ds-recycle plan --stages 4 --pipelines 2 --microbatches 8 --fail 1:2``.
"""
from __future__ import annotations

from ds_recycle.plan.bounds import lower_bound
from ds_recycle.plan.cache import PlanCache, normalize_failures
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import DeadlockError, PlanError, PlanValidationError, StageLostError
from ds_recycle.plan.ops import Op, OpKind
from ds_recycle.plan.plan import Plan
from ds_recycle.plan.schedules import best_failure_free, best_possible, make_plan
from ds_recycle.plan.simulator import SimResult, simulate
from ds_recycle.plan.validate import validate_document, validate_plan

__all__ = ["OpKind", "Op", "CostModel", "Plan", "make_plan", "PlanCache", "normalize_failures",
           "lower_bound", "best_possible", "best_failure_free", "validate_plan", "validate_document",
           "simulate", "SimResult", "PlanError", "StageLostError", "PlanValidationError", "DeadlockError"]
