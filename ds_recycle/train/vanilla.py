"""DeepSpeed's stock ``PipelineEngine`` behind the :class:`~ds_recycle.train.runner.Runner` seam: the baseline."""
from __future__ import annotations

import logging
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ds_recycle.config import TrainConfig
from ds_recycle.data import MicroBatchSource
from ds_recycle.engine.state import gather_state_dict
from ds_recycle.events import Event
from ds_recycle.model import build_pipeline_module
from ds_recycle.resilience.world import World
from ds_recycle.train.optim import build_optimizer
from ds_recycle.train.runner import IterationResult
from ds_recycle.train.throttle import throttle_pipeline_engine

logger = logging.getLogger(__name__)

__all__ = ["VanillaRunner"]


class VanillaRunner:
    """Vanilla DeepSpeed: 1F1B, fused backward, one synchronous optimizer step, no failure survival."""

    generation = 0
    """Vanilla DeepSpeed never falls back by itself (a failure ends its job)."""

    def __init__(self, cfg: TrainConfig, world: World) -> None:
        if cfg.recycle.assume_failed:
            raise ValueError("config key 'recycle.assume_failed': vanilla DeepSpeed cannot run with absent workers. "
                             "Fix: set recycle.enabled to true, or empty assume_failed")
        self.world = world
        module = build_pipeline_module(cfg.recycle.model, cfg.recycle.stages)
        optimizer = build_optimizer(cfg, module.parameters())
        self.engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg.deepspeed)
        self.source = MicroBatchSource(cfg)
        self.pipeline = self.engine.grid.get_data_parallel_id()
        worker = (self.pipeline, self.engine.stage_id)
        slowdowns = [(f.iteration, f.slow) for f in cfg.recycle.faults if f.slow is not None and f.worker == worker]
        if slowdowns:  # --slow: the same slow accelerator as a ds_recycle run meets (no kill: vanilla dies whole)
            throttle_pipeline_engine(self.engine, slowdowns)
            logger.warning("worker %s: slow accelerator injected (from iteration, factor): %s", worker, slowdowns)

    def train_iteration(self, iteration: int) -> IterationResult:
        loss = self.engine.train_batch(data_iter=self.source.iteration(iteration, self.pipeline))
        return IterationResult(loss=float(loss), live_workers=self.world.world_size, rerouted_microbatches=0)

    def is_reporter(self) -> bool:
        return self.world.rank == 0

    def finish(self, keep_final_state: bool) -> tuple[Event, ...]:
        return ()  # DeepSpeed's step is final when train_batch returns

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        return gather_state_dict(self.engine.module, contributes=self.pipeline == 0)

    def save_checkpoint(self, directory: str, next_iteration: int) -> None:
        self.engine.save_checkpoint(directory, tag=f"iter{next_iteration}",
                                    client_state={"next_iteration": next_iteration})

    def load_checkpoint(self, directory: str) -> int | None:
        if not (Path(directory) / "latest").is_file():
            return None
        path, client = self.engine.load_checkpoint(directory)
        if path is None:
            raise RuntimeError(f"checkpoint in {directory} could not be loaded (see DeepSpeed's log above)")
        return int(client["next_iteration"])

    def measured_costs(self) -> None:
        return None  # DeepSpeed's engine does not time its instructions

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
