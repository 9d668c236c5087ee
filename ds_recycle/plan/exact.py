"""The exact planner: the optimal adapted plan, or the best one found in a time limit and its proven gap.

    result = solve_exact(3, 3, 4, costs, [(0, 0)], iterations=1, time_limit=5)
    result.plan, result.optimal, result.dual_bound, result.remaining_gap, result.gap

Two solvers over the same rules: OR-Tools CP-SAT (``solver="cp-sat"``, the default; :mod:`cpsat`: interval
variables, no-overlap per worker, precedences with communication delays, a cumulative memory limit, routing
of orphans left to the solver) and HiGHS (``solver="highs"``; :mod:`milp`: big-M order binaries, the
greedy's routing). CP-SAT is the default because it measures better (``benchmarks/planner.py --only exact``):
its propagation of no-overlap and precedences proves optimality where the MILP's weak relaxation leaves a
gap at its time limit.

Both start from the greedy plan (CP-SAT as a hint), bound the makespan by it and by
:func:`bounds.best_lower_bound`, and hand their op orders to :func:`simulate`, which re-times them with the
exact costs (never later than the solver's times), so the plan is valid whatever the solver's rounding. If
the solver finds nothing better in time, the greedy plan is kept.

A solver's plan measures what is possible; it need not keep each channel's transfers in one order
(:func:`validate.check_channels`), which the list scheduler's plans, the ones the runtime runs, always do.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ds_recycle.plan.bounds import best_lower_bound, check_shape, failures_per_stage
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import DeadlockError, PlanError
from ds_recycle.plan.ops import Worker
from ds_recycle.plan.plan import Plan
from ds_recycle.plan.schedules import make_plan
from ds_recycle.plan.simulator import simulate

__all__ = ["ExactResult", "solve_exact", "SOLVERS"]

logger = logging.getLogger(__name__)

SOLVERS = ("cp-sat", "highs")


@dataclass(frozen=True)
class ExactResult:
    """The exact plan, whether it is proven optimal, the proven lower bound and the greedy's makespan."""

    plan: Plan
    optimal: bool
    dual_bound: float
    """A proven lower bound on the makespan of any plan (the plan's makespan when ``optimal``)."""
    heuristic_makespan: float
    solver: str = "cp-sat"
    status: str = ""
    seconds: float = 0.0

    @property
    def gap(self) -> float:
        """Greedy makespan over the exact makespan, minus one."""
        return self.heuristic_makespan / self.plan.makespan - 1.0

    @property
    def remaining_gap(self) -> float:
        """The exact plan's makespan over the proven bound, minus one (0 when optimal)."""
        return 0.0 if self.optimal else self.plan.makespan / self.dual_bound - 1.0


def solve_exact(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                failed: Iterable[Worker] = (), *, iterations: int = 1, optimizer: str = "staggered",
                memory_limit: int | None = None, time_limit: float = 20.0, solver: str = "cp-sat",
                workers: int = 2, greedy: Plan | None = None) -> ExactResult:
    """Solve for the best plan (see the module docstring); ``greedy``: the warm start (default: make_plan's)."""
    check_shape(stages, pipelines, microbatches, costs, iterations)
    if solver not in SOLVERS:
        raise PlanError(f"solver = {solver!r}: use one of {SOLVERS}")
    failed = frozenset(failed)
    failures_per_stage(failed, stages, pipelines)
    if greedy is None:
        greedy = make_plan(stages, pipelines, microbatches, costs, failed, iterations=iterations,
                           optimizer=optimizer, memory_limit=memory_limit)
    horizon = greedy.makespan
    bound = best_lower_bound(stages, pipelines, microbatches, costs, failed, iterations, optimizer=optimizer,
                             memory_limit=memory_limit)
    if horizon <= bound * (1 + 1e-12):
        return ExactResult(greedy, True, horizon, horizon, solver, "greedy at the bound")
    sync = optimizer == "synchronous"
    if solver == "cp-sat":
        from ds_recycle.plan.cpsat import solve_cpsat
        answer = solve_cpsat(stages, pipelines, microbatches, costs, failed, iterations=iterations,
                             synchronous=sync, memory_limit=memory_limit, horizon=horizon, lower=bound,
                             hint=greedy.workers, time_limit=time_limit, workers=workers)
    else:
        from ds_recycle.plan.milp import solve_milp
        answer = solve_milp(stages, pipelines, microbatches, costs, failed, iterations=iterations,
                            synchronous=sync, memory_limit=memory_limit, horizon=horizon, time_limit=time_limit)
    plan = greedy
    if answer.orders is not None:
        try:
            sim = simulate(answer.orders, costs, optimizer=optimizer)
            if sim.makespan < greedy.makespan - 1e-12:
                plan = Plan(stages, pipelines, microbatches, iterations, optimizer, memory_limit, costs, failed,
                            sim.workers, "adaptive")
        except DeadlockError as exc:  # rounding made a tie the solver ordered differently: keep the greedy
            logger.warning("the %s solution does not re-time: %s", solver, exc)
    # with rounded costs the solver's bound is for other durations: keep only the exact bounds then
    dual = min(max(bound, bound if answer.rounded else answer.bound), plan.makespan)
    optimal = answer.optimal or dual >= plan.makespan * (1 - 1e-9)
    return ExactResult(plan, optimal, plan.makespan if optimal else dual, horizon, solver, answer.status,
                       answer.seconds)
