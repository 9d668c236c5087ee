"""How often a plan runs a worker's own pipeline's W ops out of micro-batch order, and what keeping the order costs.

    .venv/bin/python benchmarks/plan_w_order.py

A worker accumulates the weight gradients of its own pipeline's micro-batches into one row; a run with failures
equals the failure-free run bit for bit only if they are added in the failure-free order (index order). The engine
holds a W whose predecessors have not run and runs it right after them (``ds_recycle.engine.row_order``).

This sweep asks the plan cache the failure handler uses (``PlanCache``, failure sets normalised and relabelled)
for shapes 2x2..4x4, M = S and 2S, the three schedules, uniform and random costs, no, one and some pairs of failed
workers, and counts the plans in which some worker's own W ops are not in index order, with a few examples. For
those it simulates the plan as the engine runs it (held W moved behind the W that releases it) under the plan's
own costs and reports the iteration time against the plan's. No training runs.
"""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_recycle.plan import CostModel, PlanCache  # noqa: E402
from ds_recycle.plan.errors import PlanError  # noqa: E402
from ds_recycle.plan.ops import Op, OpKind  # noqa: E402
from ds_recycle.plan.simulator import simulate  # noqa: E402


def as_executed(ops: tuple[Op, ...], pipeline: int) -> list[Op]:
    """``ops`` of a worker of ``pipeline`` in the order the engine runs them: an own W waits for its predecessors."""
    out: list[Op] = []
    held: dict[tuple[int, int], Op] = {}
    done: set[tuple[int, int]] = set()
    for op in ops:
        if op.kind is OpKind.O:  # the engine adds what is still held before the step (none in these plans)
            out.extend(held.pop(k) for k in sorted(k for k in held if k[0] == op.iteration))
        if op.kind is not OpKind.W or op.micro[0] != pipeline:
            out.append(op)
            continue
        k, i = op.iteration, op.micro[1]
        if any((k, j) not in done for j in range(i)):
            held[(k, i)] = op
            continue
        out.append(op)
        done.add((k, i))
        while (k, i + 1) in held:
            i += 1
            out.append(held.pop((k, i)))
            done.add((k, i))
    return out


def main() -> int:
    rng = random.Random(0)
    total, out_of_order, examples, ratios = 0, 0, [], []
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
                                planned = simulate(plan.workers, plan.costs, optimizer=plan.optimizer).makespan
                                run = simulate({w: as_executed(o, w[0]) for w, o in plan.workers.items()},
                                               plan.costs, optimizer=plan.optimizer).makespan
                                ratios.append(run / planned)
                                break
    print(f"plans made: {total}; with a worker's own W ops out of index order: {out_of_order}")
    print("\n".join(examples))
    if ratios:
        slower = sum(r > 1 + 1e-9 for r in ratios)
        print(f"as the engine runs them (held W behind their predecessors), simulated under the plan's costs: "
              f"iteration time / planned: mean {sum(ratios) / len(ratios):.4f}, worst {max(ratios):.4f}, "
              f"best {min(ratios):.4f}; {slower} of {len(ratios)} plans slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
