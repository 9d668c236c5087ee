"""Train the emulated GPT with DeepSpeed, as a DeepSpeed user's pipeline script would.

    deepspeed --num_accelerators 16 benchmarks/emulated/train.py --deepspeed_config ds.json \
        --costs profile.json --stages 4 --steps 8

(``PYTHONPATH`` must hold the repository root, for ``benchmarks.emulated``.) ``benchmarks/emulated_figure.py``
runs it as is (vanilla DeepSpeed) and with the documented two-line change (``ds_recycle.initialize``) under
``ds-recycle launch``. Workers absent from the start (the config's ``recycle.assume_failed``) need the module
built on a grid with holes, as the built-in GPT does; only that branch uses ds_recycle's grid.

Prints, on the rank that holds the loss, ``step N loss X t T`` after each step (``T``: wall clock, seconds)
and ``event {...}`` for each ds_recycle event; at the end every rank prints ``cpu rank R s X iterations N``:
its process CPU time over the steps after ``--warmup`` (all its threads: engine, transport, watchdogs).
"""
import argparse
import cProfile
import json
import os
import time
from typing import Any

import deepspeed
import torch.distributed as dist

from benchmarks.emulated.layers import set_jitter, set_slowdown
from benchmarks.emulated.model import build, build_layers


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed pipeline training of the emulated GPT")
    parser.add_argument("--costs", default=None, help="a profile: per-stage F, B, W in milliseconds")
    parser.add_argument("--layer-costs", default=None,
                        help="instead of --costs: per-layer F, B, W in milliseconds (embedding first, head last) "
                             "and the layer boundaries to cut at ('parts')")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps before the CPU time is counted")
    parser.add_argument("--cprofile", default=None,
                        help="write each rank's cProfile (main-thread CPU time) over the timed steps to DIR/rank<R>.prof")
    parser.add_argument("--slow", action="append", default=[], metavar="P:S@K*F",
                        help="from step K on, the worker of pipeline P at stage S runs F times slower (repeatable)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="each emulated op time is scaled by a factor drawn from [1 - J, 1 + J] (seeded per rank)")
    parser.add_argument("--print-costs", action="store_true",
                        help="ds_recycle: print the F, B, W, O and transfer the job measured at the end (ms), the "
                             "running plan's iteration under them and the measured median iteration")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def parse_slow(text: str) -> tuple[tuple[int, int], int, float]:
    """``P:S@K*F`` -> ``((P, S), K, F)``."""
    worker, _, rest = text.partition("@")
    step, _, factor = rest.partition("*")
    pipeline, _, stage = worker.partition(":")
    return (int(pipeline), int(stage)), int(step), float(factor)


def build_module(args: argparse.Namespace) -> tuple:
    if (args.costs is None) == (args.layer_costs is None):
        raise SystemExit("give one of --costs (per-stage profile) and --layer-costs (per-layer costs and parts)")
    if args.costs is not None:
        costs = json.load(open(args.costs))

        def make(**where: Any) -> tuple:
            return build(costs, args.stages, **where)
    else:
        layer_ms = json.load(open(args.layer_costs))

        def make(**where: Any) -> tuple:
            return build_layers(layer_ms, layer_ms["parts"], args.stages, **where)
    with open(args.deepspeed_config) as f:
        recycle = json.load(f).get("recycle", {})
    absent = recycle.get("assume_failed", [])
    if not absent:
        return make()
    from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap, survivor_module_grid

    workers = WorkerMap.dense(args.stages, recycle["pipelines"], frozenset(tuple(w) for w in absent))
    grid = SurvivorGrid(workers, timeout_s=recycle.get("failure_timeout_s", 300.0))
    with survivor_module_grid(grid):
        return make(topology=grid.topology())


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    net, dataset = build_module(args)
    params = [p for p in net.parameters() if p.requires_grad]

    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=params, training_data=dataset)

    reporter = getattr(engine, "is_reporter", lambda: engine.global_rank == 0)
    set_jitter(args.jitter, seed=engine.global_rank)
    here = (engine.grid.data_parallel_id, engine.stage_id)
    slow = [(step, factor) for (worker, step, factor) in map(parse_slow, args.slow) if worker == here]
    cpu0 = time.process_time()
    profiler = cProfile.Profile(time.thread_time) if args.cprofile else None  # main-thread CPU, not wall
    for step in range(args.steps):
        if step == args.warmup:
            cpu0 = time.process_time()
            if profiler is not None:
                profiler.enable()
        for at, factor in slow:
            if step == at:
                set_slowdown(factor)
        loss = engine.train_batch()
        stamp = time.time()
        for event in getattr(engine, "recycle_events", list)():
            print(f"event {json.dumps(event.to_dict())}", flush=True)
        if reporter():
            print(f"step {step} loss {float(loss):.6f} t {stamp:.6f}", flush=True)
    cpu = time.process_time() - cpu0
    if args.print_costs and hasattr(engine, "measured_costs"):
        measured = engine.measured_costs()  # a collective: every rank
        if measured is not None and reporter():
            from ds_recycle.plan.simulator import simulate

            plan = engine.plan  # the plan running now, timed under the measured costs
            planned = simulate(plan.workers, measured, optimizer=plan.optimizer).makespan / plan.iterations
            iteration = engine.clock.iteration_median()
            print("measured costs (ms) " + json.dumps({
                **{k: [round(v * 1e3, 2) for v in getattr(measured, k)] for k in ("F", "B", "W", "O")},
                "comm": round(measured.comm * 1e3, 3), "planned": round(planned * 1e3, 1),
                "iteration": None if iteration is None else round(iteration * 1e3, 1)}), flush=True)
    if profiler is not None:
        profiler.disable()
        os.makedirs(args.cprofile, exist_ok=True)
        profiler.dump_stats(os.path.join(args.cprofile, f"rank{engine.global_rank}.prof"))
    print(f"cpu rank {engine.global_rank} s {cpu:.4f} iterations {args.steps - args.warmup}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
