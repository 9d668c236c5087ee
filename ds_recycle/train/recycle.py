"""The built-in GPT on ds_recycle's engine, through the public API like any user's script.

``launch/train.py`` builds this runner when ``recycle.enabled`` is true: it builds the GPT as a DeepSpeed
``PipelineModule``, hands it to :func:`ds_recycle.initialize` with the corpus as addressable data
(``MicroBatchSource.micro_batch(step, pipeline, index)``), and drives ``engine.train_batch()``. Under
``ds-recycle launch`` the engine survives failures itself; this runner only reads what the engine
reports (events, live workers, re-routed micro-batches). The config's ``assume_failed`` workers are
absent from the start: the module is then built on a grid with those holes.
"""
from __future__ import annotations

import logging

import torch

import ds_recycle
from ds_recycle.config import TrainConfig
from ds_recycle.config._strict import to_jsonable
from ds_recycle.data import MicroBatchSource
from ds_recycle.engine.engine import RecyclePipelineEngine
from ds_recycle.events import Event
from ds_recycle.model import build_pipeline_module
from ds_recycle.resilience.handler import FailureHandler
from ds_recycle.resilience.world import World
from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap, survivor_module_grid
from ds_recycle.train.optim import build_optimizer
from ds_recycle.train.runner import CostReport, IterationResult

__all__ = ["EngineRunner"]

logger = logging.getLogger(__name__)


class EngineRunner:
    """ds_recycle's engine on the GPT: the planner's plan, B/W split, staggered step, failure survival."""

    def __init__(self, cfg: TrainConfig, world: World) -> None:
        rc = cfg.recycle
        if rc.assume_failed:
            grid = SurvivorGrid(WorkerMap.dense(rc.stages, rc.pipelines, frozenset(rc.assume_failed)),
                                timeout_s=rc.failure_timeout_s)
            with survivor_module_grid(grid):
                module = build_pipeline_module(rc.model, rc.stages, topology=grid.topology())
        else:
            module = build_pipeline_module(rc.model, rc.stages)
        config = {**cfg.deepspeed, "recycle": to_jsonable(rc)}
        engine, *_ = ds_recycle.initialize(model=module, config=config, training_data=MicroBatchSource(cfg),
                                           optimizer=build_optimizer(cfg, module.parameters()))
        self.engine: RecyclePipelineEngine = engine
        self.world = world

    @property
    def handler(self) -> FailureHandler | None:
        """The engine's failure handler (``ds-recycle launch``), or None."""
        driver = self.engine.driver
        return driver if isinstance(driver, FailureHandler) else None

    @property
    def fallback_directory(self) -> str | None:
        """The checkpoint directory a lost stage falls back to (the handler's; None without failure handling)."""
        return self.handler.fallback_directory if self.handler is not None else None

    @fallback_directory.setter
    def fallback_directory(self, directory: str | None) -> None:
        if self.handler is not None:
            self.handler.fallback_directory = directory

    @property
    def generation(self) -> int:
        return int(self.handler.generation) if self.handler is not None else 0

    def train_iteration(self, iteration: int) -> IterationResult:
        """One ``engine.train_batch()`` (a worker that joined later returns NaN until its loop catches up)."""
        loss = self.engine.train_batch()
        events = tuple(self.engine.recycle_events())  # typed (ds_recycle.events)
        value = float(loss)
        return IterationResult(loss=None if value != value else value, live_workers=self.engine.live_workers,
                               rerouted_microbatches=self.engine.rerouted_microbatches, events=events)

    def is_reporter(self) -> bool:
        return self.engine.is_reporter()

    def finish(self, keep_final_state: bool) -> tuple[Event, ...]:
        self.engine.finish(keep_final_state)
        return tuple(self.engine.recycle_events())

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        return self.engine.gather_final_state()

    def measured_costs(self) -> CostReport | None:
        from ds_recycle.plan.simulator import simulate

        costs = self.engine.measured_costs()
        if costs is None:
            return None
        plan = self.engine.plan
        planned = simulate(plan.workers, costs, optimizer=plan.optimizer).makespan / plan.iterations
        return CostReport(costs, planned, self.engine.clock.iteration_median())

    def save_checkpoint(self, directory: str, next_iteration: int) -> None:
        if self.handler is None:
            raise RuntimeError("checkpoints of the ReCycle engine are written under ds-recycle launch; "
                               "run with it, or with --vanilla")
        self.handler.save_checkpoint(directory, next_iteration)

    def load_checkpoint(self, directory: str) -> int | None:
        if self.handler is None:
            raise RuntimeError("checkpoints of the ReCycle engine are read under ds-recycle launch")
        return self.handler.load_checkpoint(directory)

    def close(self) -> None:
        self.engine.close()
