"""``RecycleRunner``: the ReCycle engine behind the training loop's ``Runner`` seam.

``launch/train.py`` builds it when ``recycle.enabled`` is true. It lays out the live workers (the config's
``assume_failed`` workers are absent and the job has that many fewer processes), builds the GPT on a
:class:`~ds_recycle.runtime.grid.SurvivorGrid`, asks the planner for the plan of that failure set and runs
it, one :meth:`train_iteration` per global batch.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.config import TrainConfig
from ds_recycle.data import MicroBatchSource
from ds_recycle.engine.engine import RecyclePipelineEngine
from ds_recycle.engine.initialize import initialize
from ds_recycle.engine.schedule import PlanLike, PlanNotRunnableError, check_plan_for_job
from ds_recycle.model import build_pipeline_module
from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap, survivor_module_grid
from ds_recycle.train.optim import build_optimizer
from ds_recycle.train.runner import IterationResult
from ds_recycle.train.state import gather_state_dict

__all__ = ["RecycleRunner", "make_job_plan", "rerouted_microbatches"]

logger = logging.getLogger(__name__)


def make_job_plan(cfg: TrainConfig) -> PlanLike:
    """The planner's plan for this job: shape, absent workers, schedule, optimizer, memory and costs."""
    from ds_recycle.plan import CostModel, PlanError, make_plan

    rc = cfg.recycle
    try:
        costs = CostModel.from_file(rc.costs_file) if rc.costs_file else CostModel.uniform(rc.stages)
        return make_plan(rc.stages, rc.pipelines, cfg.micro_batches, costs, rc.assume_failed, iterations=1,
                         schedule=rc.schedule, optimizer=rc.optimizer_step, memory_limit=rc.memory_limit)
    except (PlanError, ValueError, OSError) as e:
        raise PlanNotRunnableError(f"no runnable plan for {rc.stages} stages x {rc.pipelines} pipelines, "
                                   f"{cfg.micro_batches} micro-batches, absent {list(rc.assume_failed)}, "
                                   f"costs_file {rc.costs_file!r}: {e}") from e


def rerouted_microbatches(plan: PlanLike) -> int:
    """(stage, micro-batch) pairs of one iteration processed by a worker of another pipeline."""
    return sum(plan.worker_of(s, (d, i))[0] != d for s in range(plan.stages) for d in range(plan.pipelines)
               for i in range(plan.microbatches))


class RecycleRunner:
    """ds_recycle's engine: the planner's plan for the job's absent workers, B/W split, staggered step."""

    def __init__(self, cfg: TrainConfig, world: Any, plan: PlanLike | None = None) -> None:
        rc = cfg.recycle
        self.world = world
        self.workers = WorkerMap.dense(rc.stages, rc.pipelines, frozenset(rc.assume_failed))
        # Plan and check it first: a plan that cannot run fails on every rank before any communication.
        self.plan = plan if plan is not None else make_job_plan(cfg)
        check_plan_for_job(self.plan, rc.stages, rc.pipelines, cfg.micro_batches, self.workers.absent())
        grid = SurvivorGrid(self.workers)
        with survivor_module_grid(grid):
            module = build_pipeline_module(rc.model, rc.stages, topology=grid.topology())
        self.engine: RecyclePipelineEngine
        self.engine, *_ = initialize(model=module, config=cfg.deepspeed, plan=self.plan, data=MicroBatchSource(cfg),
                                     optimizer=build_optimizer(cfg, module.parameters()))
        self.rerouted = rerouted_microbatches(self.plan)
        self._finished = False

    def train_iteration(self, iteration: int) -> IterationResult:
        if iteration != self.engine.iteration:
            raise ValueError(f"iteration {iteration} requested, but the engine is at iteration {self.engine.iteration};"
                             " iterations run in order from 0")
        loss = self.engine.train_batch()
        return IterationResult(loss=None if loss is None else float(loss), live_workers=self.workers.world_size,
                               rerouted_microbatches=self.rerouted)

    def is_reporter(self) -> bool:
        return self.engine.is_reporter()

    def _finish(self) -> None:
        if not self._finished:
            self.engine.finish()
            self._finished = True
            st = self.engine.stepper
            logger.info("optimizer steps: %d, clipped %d, redone after post-validation %d", self.engine.global_steps,
                        st.clipped_steps, st.redone_steps)

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        self._finish()
        stage_ranks = self.workers.stage_ranks(self.engine.stage_id)
        return gather_state_dict(self.engine.module, contributes=self.world.rank == stage_ranks[0],
                                 dst=self.engine.reporter_rank)

    def close(self) -> None:
        self._finish()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
