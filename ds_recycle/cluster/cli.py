"""`ds-recycle simulate`: one job over a failure trace, every chosen system side by side.

    ds-recycle simulate --trace ../shared/traces/oobleck/1h.csv --model gpt3-2.7b --stages 6 --pipelines 5
    ds-recycle simulate --mtbf 1 --nodes 512 --stages 8 --hours 24 --repair-hours 2 --model gpt3-6.7b
    ds-recycle simulate --trace t.csv --costs-file costs.json --stages 4 --pipelines 4 --json out.json --png out.png

Prints the per-system table (effective throughput, effective-time fraction and its breakdown, ReCycle's
ratio to each) and every modelling assumption with its source.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from ds_recycle.cluster.assumptions import ShrinkPolicy, resolve_assumptions
from ds_recycle.cluster.generator import generate_trace
from ds_recycle.cluster.models import A100_NODE, get_model, model_names
from ds_recycle.cluster.report import format_assumptions, format_table, to_json
from ds_recycle.cluster.simulator import default_hours, job_mtbf_s, simulate
from ds_recycle.cluster.systems import parse_systems
from ds_recycle.cluster.timing import BaselineSchedule, JobShape
from ds_recycle.cluster.trace import Trace, TraceError, read_trace
from ds_recycle.cluster.workload import Workload, workload_from_costs_file, workload_from_model

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="failure trace: time_ms,add|remove,nodeN lines")
    src.add_argument("--mtbf", type=float, metavar="H", help="generate failures: cluster MTBF in hours")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", default=None, help=f"model profile: {', '.join(model_names())} "
                      "(default gpt3-medium)")
    what.add_argument("--costs-file", metavar="FILE", help="plan-format cost profile (F, B, W, O, comm)")
    parser.add_argument("--nodes", type=int, help="nodes in the cluster (generated traces; default S x D)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs a node (A100 80GB; a stage is tensor parallel over them)")
    parser.add_argument("--stages", type=int, help="pipeline stages S (default 6, or the costs file's)")
    parser.add_argument("--pipelines", type=int, help="data-parallel pipelines D (default nodes // S)")
    parser.add_argument("--microbatches", type=int, help="micro-batches per pipeline M (default 2 S)")
    parser.add_argument("--micro-batch-size", type=int,
                        help="samples per micro-batch (default: the model's global batch / (D M))")
    parser.add_argument("--systems", default="all", help="comma-separated systems, or 'all'")
    parser.add_argument("--hours", type=float, help="simulated hours (default: the trace's span)")
    parser.add_argument("--repair-hours", type=float, help="generated traces: mean repair time")
    parser.add_argument("--seed", type=int, default=0, help="generated traces: random seed")
    parser.add_argument("--baseline-schedule", choices=[b.value for b in BaselineSchedule],
                        default="1f1b", help="failure-free schedule of the other systems")
    parser.add_argument("--shrink-policy", choices=[p.value for p in ShrinkPolicy], default="shrink",
                        help="checkpoint-restart with too few nodes: shrink or wait")
    parser.add_argument("--recycle-group", type=int, default=8, help="ReCycle re-routing group Dg")
    parser.add_argument("--recycle-memory-limit", type=int, metavar="N",
                        help="ReCycle's adapted plans: most micro-batches a worker may hold")
    parser.add_argument("--recycle-rebalance", action="store_true",
                        help="let ReCycle move live nodes between stages (beyond the paper)")
    parser.add_argument("--checkpoint-interval", type=float, metavar="S",
                        help="seconds of training between checkpoints (default: Young's optimum)")
    parser.add_argument("--state-gb", type=float, default=0.0,
                        help="--costs-file: model state in GB (checkpoint and copy sizes)")
    parser.add_argument("--restart-s", type=float, default=100.0, help="--costs-file: restart time")
    parser.add_argument("--reconfigure-s", type=float, default=3.0,
                        help="--costs-file: reconfiguration time")
    parser.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    parser.add_argument("--png", metavar="FILE", help="draw throughput over time")


class _UsageError(ValueError):
    pass


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise _UsageError(f"{name} {value}: must be positive")


def _shape(args: argparse.Namespace, stages_default: int) -> JobShape:
    stages = args.stages or stages_default
    if args.pipelines is None and args.nodes is None:
        raise _UsageError("give --pipelines D or --nodes N (then D = N // S)")
    pipelines = args.pipelines or (args.nodes // stages)
    if pipelines < 1:
        raise _UsageError(f"--nodes {args.nodes} is fewer than --stages {stages}: no pipeline fits")
    if args.nodes is not None and stages * pipelines > args.nodes:
        raise _UsageError(f"--stages {stages} x --pipelines {pipelines} = {stages * pipelines} nodes "
                          f"> --nodes {args.nodes}. Fix: fewer pipelines or more nodes")
    return JobShape(stages, pipelines, args.microbatches or 2 * stages, args.recycle_group)


def _workload(args: argparse.Namespace, shape: JobShape) -> Workload:
    if args.gpus_per_node < 1:
        raise _UsageError(f"--gpus-per-node {args.gpus_per_node}: at least one GPU a node")
    per_gpu_gb = A100_NODE.node_memory_gb / A100_NODE.gpus_per_node
    hardware = replace(A100_NODE, name=f"{args.gpus_per_node}xA100-80GB", gpus_per_node=args.gpus_per_node,
                       node_memory_gb=per_gpu_gb * args.gpus_per_node)
    if args.costs_file:
        return workload_from_costs_file(args.costs_file, micro_batch=args.micro_batch_size or 1,
                                        state_gb=args.state_gb, reconfigure_s=args.reconfigure_s,
                                        restart_s=args.restart_s, hardware=hardware)
    model = get_model(args.model or "gpt3-medium")
    b = args.micro_batch_size or max(1, round(model.global_batch / (shape.pipelines * shape.microbatches)))
    return workload_from_model(model, b, hardware)


def _trace(args: argparse.Namespace, shape: JobShape) -> Trace:
    if args.trace:
        return read_trace(args.trace)
    _positive("--mtbf", args.mtbf)
    if args.hours is None:
        raise _UsageError("--mtbf needs --hours H (how long to generate and simulate)")
    return generate_trace(args.nodes or shape.nodes, args.hours, args.mtbf, args.seed,
                          args.repair_hours)


def _stages_default(args: argparse.Namespace) -> int:
    if args.costs_file:
        from ds_recycle.plan import CostModel  # noqa: PLC0415 - only to read the stage count

        try:
            return CostModel.from_file(args.costs_file).stages
        except (OSError, ValueError) as exc:
            raise _UsageError(f"--costs-file {args.costs_file!r}: {exc}") from None
    return 6


def run(args: argparse.Namespace) -> int:
    try:
        for name in ("hours", "repair_hours", "checkpoint_interval", "recycle_memory_limit"):
            _positive("--" + name.replace("_", "-"), getattr(args, name))
        shape = _shape(args, _stages_default(args))
        workload = _workload(args, shape)
        trace = _trace(args, shape)
        kinds = parse_systems(args.systems)
        hours = args.hours or default_hours(trace)
        assumptions = resolve_assumptions(workload, shape, job_mtbf_s(trace, hours * 3600),
                                          ShrinkPolicy(args.shrink_policy), args.checkpoint_interval,
                                          args.recycle_rebalance)
        result = simulate(trace, workload, shape, kinds, hours=hours, assumptions=assumptions,
                          baseline=BaselineSchedule(args.baseline_schedule),
                          memory_limit=args.recycle_memory_limit)
    except (TraceError, ValueError) as exc:
        print(f"ds-recycle simulate: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    print("\nassumptions:\n" + format_assumptions(result))
    p = result.planner
    print(f"\nplanner: {int(p['recycle_plans'])} ReCycle plans made in {p['recycle_plan_s']:.2f} s "
          f"for {int(p['recycle_lookups'])} lookups; {int(p['baseline_plans'])} baseline plans in "
          f"{p['baseline_plan_s']:.2f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(to_json(result), handle, indent=1, allow_nan=False,
                      default=lambda v: None if isinstance(v, float) and math.isinf(v) else v)
        print(f"wrote {args.json}")
    if args.png:
        from ds_recycle.cluster.draw import draw_timeline  # noqa: PLC0415 - matplotlib only if asked

        draw_timeline(result, args.png)
        print(f"wrote {args.png}")
    return 0
