"""How often a plan runs a worker's own pipeline's W ops out of micro-batch order (a question for exactness).

    .venv/bin/python benchmarks/plan_w_order.py

A worker accumulates the weight gradients of its own pipeline's micro-batches into one row, in the order their W
(or fused backward) runs; a run with failures equals the failure-free run bit for bit only if that order gives the
same floating-point sum. This sweep asks the plan cache the failure handler uses (``PlanCache``, failure sets normalised and
relabelled) for shapes 2x2..4x4, M = S and 2S, the three schedules, uniform and random
costs, no, one and some pairs of failed workers, and counts the plans in which some worker's own W ops are not in
index order, with a few examples. No training runs.
"""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_recycle.plan import CostModel, PlanCache  # noqa: E402
from ds_recycle.plan.errors import PlanError  # noqa: E402
from ds_recycle.plan.ops import OpKind  # noqa: E402


def main() -> int:
    rng = random.Random(0)
    total, out_of_order, examples = 0, 0, []
    for stages, pipelines in [(2, 2), (2, 3), (3, 2), (3, 3), (4, 2), (4, 4)]:
        workers = [(p, s) for p in range(pipelines) for s in range(stages)]
        failure_sets = [()] + [(w,) for w in workers] + list(itertools.combinations(workers, 2))[:10]
        for m in (stages, 2 * stages):
            for kind in ("uniform", "random"):
                costs = CostModel.uniform(stages) if kind == "uniform" else CostModel(
                    *(tuple(rng.uniform(lo, hi) for _ in range(stages)) for lo, hi in
                      ((0.5, 2.0), (0.5, 2.0), (0.3, 1.5), (0.0, 1.0))), comm=0.05)
                for schedule in ("adaptive", "zb-h1", "1f1b"):
                    cache = PlanCache(stages, pipelines, m, costs, schedule=schedule)  # what the engine runs
                    for failed in failure_sets:
                        try:
                            plan = cache.get(failed)
                        except (PlanError, ValueError):
                            continue
                        total += 1
                        for (p, s), ops in sorted(plan.workers.items()):
                            own = [op.micro[1] for op in ops if op.kind is OpKind.W and op.micro[0] == p]
                            if own != sorted(own):
                                out_of_order += 1
                                if len(examples) < 5:
                                    examples.append(f"  {stages}x{pipelines} M={m} {kind} {schedule} failed "
                                                    f"{list(failed)}: worker {(p, s)} runs its own W in order {own}")
                                break
    print(f"plans made: {total}; with a worker's own W ops out of index order: {out_of_order}")
    print("\n".join(examples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
