"""How often a plan runs a worker's own pipeline's W ops out of micro-batch order, and what keeping the order costs.

    .venv/bin/python benchmarks/plan_w_order.py

A worker accumulates the weight gradients of its own pipeline's micro-batches into one row; a run with failures
equals the failure-free run bit for bit only if they are added in the failure-free order (index order). The engine
holds a W whose predecessors have not run and runs it right after them (``ds_recycle.engine.row_order``).

This sweep asks the plan cache the failure handler uses (``PlanCache``, failure sets normalised and relabelled)
for shapes 2x2..4x4, M = S and 2S, the three schedules, uniform and random costs, no, one and some pairs of failed
workers, and counts the plans in which the engine would hold some W (``ds_recycle.plan.as_run``), with a few examples. For
those it simulates the plan as the engine runs it (held W moved behind the W that releases it) under the plan's
own costs and reports the iteration time against the plan's. No training runs.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plan_sweep import sweep  # noqa: E402
from ds_recycle.plan.as_run import engine_orders, held_ws  # noqa: E402
from ds_recycle.plan.simulator import simulate  # noqa: E402


def main() -> int:
    total, holding, examples, ratios = 0, 0, [], []
    for swept in sweep():
        plan = swept.plan
        total += 1
        fuse_all = swept.schedule == "1f1b"
        holds = held_ws(plan.workers, fuse_all)
        if not holds:
            continue
        holding += 1
        planned = simulate(plan.workers, plan.costs, optimizer=plan.optimizer).makespan
        run = simulate(engine_orders(plan.workers, fuse_all), plan.costs, optimizer=plan.optimizer).makespan
        ratios.append(run / planned)
        if len(examples) < 5:
            examples.append(f"  {swept.describe()}: {holds} W held, {run / planned:.4f} of the planned time")
    print(f"plans made: {total}; in which the engine would hold some W: {holding}")
    print("\n".join(examples))
    if ratios:
        slower = sum(r > 1 + 1e-9 for r in ratios)
        print(f"as the engine runs them, simulated under the plan's costs: iteration time / planned: mean "
              f"{sum(ratios) / len(ratios):.4f}, worst {max(ratios):.4f}, best {min(ratios):.4f}; "
              f"{slower} of {len(ratios)} plans slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
