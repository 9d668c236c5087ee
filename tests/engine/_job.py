"""One worker of an engine test job: train a config with vanilla DeepSpeed or ds_recycle, save the final state.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/_job.py CONFIG STEPS OUT \
        [vanilla | plan | test-1f1b | test-deferred]

``plan`` asks the planner; ``test-*`` use the hand-made plans of tests/engine/plans.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    config, steps, out, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import torch

    from ds_recycle.config import load_config
    from ds_recycle.train.distributed import init_worker

    cfg = load_config(config)
    world = init_worker()
    if mode == "vanilla":
        from ds_recycle.train.vanilla import VanillaRunner

        runner = VanillaRunner(cfg, world)
    else:
        from ds_recycle.engine.runner import RecycleRunner
        plan = None
        if mode.startswith("test-"):
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from plans import one_f_one_b

            rc = cfg.recycle
            plan = one_f_one_b(rc.stages, rc.pipelines, cfg.micro_batches, frozenset(rc.assume_failed),
                               defer_w=mode == "test-deferred", optimizer=rc.optimizer_step)
        runner = RecycleRunner(cfg, world, plan=plan)
    losses = []
    for it in range(steps):
        losses.append(runner.train_iteration(it).loss)
    state = runner.gather_final_state()
    if state is not None:
        torch.save(state, out)
        Path(out + ".json").write_text(json.dumps({"losses": losses}))
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
