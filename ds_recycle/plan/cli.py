"""``ds-recycle plan``: make, validate, simulate and draw a ReCycle plan.

    ds-recycle plan --stages 4 --pipelines 2 --microbatches 8 --fail 1:2
    ds-recycle plan --stages 4 --pipelines 2 --microbatches 8 --iterations 2 --fail 1:2 --fail 0:0 \\
        --costs 1,1,1,0.5,0.05 --memory-limit 6 --optimizer staggered --schedule adaptive \\
        --json plan.json --png plan.png --trace plan.trace.json
    ds-recycle plan --stages 4 --pipelines 2 --microbatches 8 --costs-file profile.json --schedule zb-h1
    ds-recycle plan --stages 4 --pipelines 4 --microbatches 8 --fail 0:1 --layers 16   # with layers moved

Prints the timeline, the time per iteration, the bubble fraction, the plan format's lower bound and the
plan's ratio to it, and the ratio to the failure-free plan of the same schedule and settings. With ``--layers N``
each stage's costs are N equal layers and the plan is made on the partition that evens out the live workers' work
(:func:`~ds_recycle.plan.partition.choose_partition`: what a job does while the failure lasts); the choice is printed
and the plan carries the partition.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_recycle.plan._gc import gc_paused
from ds_recycle.plan.bounds import best_lower_bound, lower_bound
from ds_recycle.plan.chart import timeline
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.ops import Worker
from ds_recycle.plan.partition import LayerCosts, choose_partition, even_partition, partitioned_plan
from ds_recycle.plan.plan import OPTIMIZERS, SCHEDULES, Plan, write_plan_json
from ds_recycle.plan.schedules import best_failure_free_time, failure_free_time, make_plan
from ds_recycle.plan.simulator import busy_time, peak_memory
from ds_recycle.plan.validate import validate_plan

__all__ = ["add_arguments", "run", "parse_worker", "parse_costs"]


def parse_worker(text: str) -> Worker:
    """``"d:s"`` -> ``(d, s)``."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--fail {text!r}: expected PIPELINE:STAGE with 0-based integers, e.g. 1:2")
    return int(parts[0]), int(parts[1])


def parse_costs(text: str) -> tuple[float, float, float, float, float]:
    """``"F,B,W,O,comm"`` -> five non-negative numbers."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 5 or any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--costs {text!r}: expected five numbers >= 0, F,B,W,O,comm "
                                         f"(e.g. 1,1,1,0.5,0.05)")
    return values


def _positive(name: str):
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{name} {text!r}: expected an integer >= 1")
        return int(text)
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``ds-recycle plan``."""
    parser.add_argument("--stages", type=_positive("--stages"), required=True, help="pipeline stages S")
    parser.add_argument("--pipelines", type=_positive("--pipelines"), required=True, help="data-parallel pipelines D")
    parser.add_argument("--microbatches", type=_positive("--microbatches"), required=True,
                        help="micro-batches per pipeline per iteration M")
    parser.add_argument("--iterations", type=_positive("--iterations"), default=1, help="iterations planned K")
    parser.add_argument("--fail", type=parse_worker, action="append", default=[], metavar="D:S",
                        help="a failed worker, pipeline:stage (repeat for more)")
    costs = parser.add_mutually_exclusive_group()
    costs.add_argument("--costs", type=parse_costs, default=(1.0, 1.0, 1.0, 0.0, 0.0), metavar="F,B,W,O,comm",
                       help="the same costs at every stage (default 1,1,1,0,0)")
    costs.add_argument("--costs-file", type=Path, metavar="FILE", help="cost profile: the plan format's costs object")
    parser.add_argument("--memory-limit", type=_positive("--memory-limit"), default=None, metavar="N",
                        help="most micro-batches a worker may hold (default: none; zb-h1 always holds at most S)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                        help="default: synchronous for 1f1b (as DeepSpeed steps), staggered otherwise")
    parser.add_argument("--schedule", choices=SCHEDULES, default="adaptive")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the plan (ds-recycle-plan/1)")
    parser.add_argument("--layers", type=_positive("--layers"), default=None, metavar="N",
                        help="re-partition: each stage is N equal layers, moved between stages to even out the work")
    parser.add_argument("--png", type=Path, metavar="FILE", help="write a timeline picture")
    parser.add_argument("--trace", type=Path, metavar="FILE", help="write a Chrome trace")
    parser.add_argument("--width", type=_positive("--width"), default=120, help="columns of the printed timeline")


def _costs(args: argparse.Namespace) -> CostModel:
    if args.costs_file is not None:
        costs = CostModel.from_file(args.costs_file)
        if costs.stages != args.stages:
            raise PlanError(f"--costs-file {args.costs_file} has {costs.stages} stages but --stages is "
                            f"{args.stages}: give one cost per stage")
        return costs
    f, b, w, o, comm = args.costs
    return CostModel.uniform(args.stages, f, b, w, o, comm)


def _layers(costs: CostModel, per_stage: int) -> LayerCosts:
    """Each stage's costs as ``per_stage`` equal layers."""
    def split(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v / per_stage for v in values for _ in range(per_stage))
    return LayerCosts(split(costs.F), split(costs.B), split(costs.W), split(costs.O),
                      (0.0,) * (per_stage * costs.stages), comm=costs.comm)


def run(args: argparse.Namespace) -> int:
    """Make the plan, check it, print its figures and write the files asked for."""
    with gc_paused():  # ~10^5 acyclic objects: the cyclic collector would only re-scan them (see _gc)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        costs = _costs(args)
        optimizer = args.optimizer or ("synchronous" if args.schedule == "1f1b" else "staggered")
        kwargs = dict(iterations=args.iterations, schedule=args.schedule, optimizer=optimizer,
                      memory_limit=args.memory_limit)
        if args.layers is not None:
            layers = _layers(costs, args.layers)
            base = even_partition(layers.layers, args.stages)
            choice = choose_partition(layers, args.stages, args.pipelines, args.microbatches, args.fail, base,
                                      memory_limit=args.memory_limit)
            print(f"re-partition ({args.layers} layers a stage): {choice.describe()}")
            plan = partitioned_plan(layers, choice.partition, args.stages, args.pipelines, args.microbatches,
                                    args.fail, **kwargs)
            validate_plan(plan, layers)
        else:
            plan = make_plan(args.stages, args.pipelines, args.microbatches, costs, args.fail, **kwargs)
            validate_plan(plan)
        free = failure_free_time(args.stages, args.pipelines, args.microbatches, costs, **kwargs)
        best_free = best_failure_free_time(args.stages, args.pipelines, args.microbatches, costs,
                                           iterations=args.iterations, optimizer=optimizer,
                                           memory_limit=args.memory_limit)
    except PlanError as exc:
        print(f"ds-recycle plan: error: {exc}", file=sys.stderr)
        return 2
    _report(plan, free, best_free, costs, args)
    _write(plan, args)
    return 0


def _report(plan: Plan, free: float, best_free: float, costs: CostModel, args: argparse.Namespace) -> None:
    K = plan.iterations
    bound = lower_bound(plan.stages, plan.pipelines, plan.microbatches, plan.costs, plan.failed, K)
    tight = best_lower_bound(plan.stages, plan.pipelines, plan.microbatches, plan.costs, plan.failed, K,
                             optimizer=plan.optimizer, memory_limit=args.memory_limit)
    best = max(bound, best_free)
    bubble = 1 - busy_time(plan.workers) / (len(plan.workers) * plan.makespan)
    failed = " ".join(f"{p}:{s}" for p, s in sorted(plan.failed)) or "none"
    print(f"{plan.schedule} plan: S={plan.stages} D={plan.pipelines} M={plan.microbatches} K={K}, "
          f"optimizer {plan.optimizer}, memory limit {plan.memory_limit}, failed {failed}")
    print(timeline(plan, args.width))
    print(f"time per iteration          {plan.time_per_iteration:.6g}")
    print(f"bubble fraction             {bubble:.4f}")
    print(f"lower bound per iteration   {bound / K:.6g}   plan / bound = {plan.makespan / bound:.4f}")
    print(f"failure-free per iteration  {free / K:.6g}   plan / failure-free = "
          f"{plan.makespan / free:.4f}   (throughput kept {free / plan.makespan:.4f})")
    print(f"best possible per iteration {best / K:.6g}   plan / best possible = {plan.makespan / best:.4f}")
    print(f"tightest bound per iteration {tight / K:.6g}   plan / max(it, failure-free) = "
          f"{plan.makespan / max(tight, best_free):.4f}")
    print(f"peak memory (micro-batches) {max(peak_memory(ops) for ops in plan.workers.values())}   "
          f"re-routed (worker, micro-batch) pairs {len(plan.rerouted())}")


def _write(plan: Plan, args: argparse.Namespace) -> None:
    if args.json is not None:
        write_plan_json(plan, args.json)
        print(f"wrote {args.json}")
    if args.png is not None:
        from ds_recycle.plan.draw import draw_plan
        draw_plan(plan, args.png)
        print(f"wrote {args.png}")
    if args.trace is not None:
        from ds_recycle.plan.trace import write_chrome_trace
        write_chrome_trace(plan, args.trace)
        print(f"wrote {args.trace}")
