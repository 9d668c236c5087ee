"""The built-in GPT under ``ds-recycle launch`` with layers moved between stages at given iterations (run by
test_repartition.py).

    ds-recycle launch --num_accelerators N tests/engine/_repartition_job.py --deepspeed_config C --steps K \
        --move 2=0,2,5,8 --move 4=0,3,5,8 --save-final out.pt

``--move K=PARTS``: before iteration K every live worker calls ``engine.repartition`` with the plan for that
partition (the job's failure set, uniform layer costs). Prints ``MOVED K <transfers>`` on every rank and
``step K loss X clipped C`` on the reporter (C: the step's gradients were clipped).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch

    import ds_recycle
    from ds_recycle.config import load_config
    from ds_recycle.config._strict import to_jsonable
    from ds_recycle.data import MicroBatchSource
    from ds_recycle.model import build_pipeline_module
    from ds_recycle.plan.partition import LayerCosts, partitioned_plan
    from ds_recycle.resilience.world import init_worker
    from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap, survivor_module_grid
    from ds_recycle.train.optim import build_optimizer

    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--move", action="append", default=[])
    p.add_argument("--save-final", dest="save_final", required=True)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()
    moves = {int(k): tuple(int(x) for x in v.split(",")) for k, v in (m.split("=") for m in args.move)}
    cfg = load_config(json.loads(Path(args.deepspeed_config).read_text()))
    rc = cfg.recycle
    init_worker()
    absent = frozenset(rc.assume_failed)
    grid = SurvivorGrid(WorkerMap.dense(rc.stages, rc.pipelines, absent), timeout_s=rc.failure_timeout_s)
    with survivor_module_grid(grid):
        module = build_pipeline_module(rc.model, rc.stages, topology=grid.topology())
    engine, *_ = ds_recycle.initialize(model=module, config={**cfg.deepspeed, "recycle": to_jsonable(rc)},
                                       training_data=MicroBatchSource(cfg),
                                       optimizer=build_optimizer(cfg, module.parameters()))
    layers = LayerCosts.uniform(len(module._layer_specs))
    for step in range(args.steps):
        if step in moves:
            plan = partitioned_plan(layers, moves[step], rc.stages, rc.pipelines, cfg.micro_batches, absent)
            done = engine.repartition(plan)
            print(f"MOVED {step} {[(t.layer, t.src, t.dst) for t in done]} holds {list(engine.module.parts)}",
                  flush=True)
        loss = engine.train_batch()
        engine.finish_step()
        outcome = engine.last_step
        if engine.is_reporter():
            print(f"step {step} loss {float(loss):.8f} clipped {outcome is not None and outcome.clipped}", flush=True)
    state = engine.gather_final_state()
    if state is not None:
        torch.save(state, args.save_final)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
