"""``ds_recycle.initialize``: ``deepspeed.initialize`` for the ReCycle engine.

DeepSpeed builds its pipeline grid inside ``PipelineModule.__init__`` from the world size, which cannot
describe absent workers. So the module is built with :func:`build_pipeline_module` (the same layers,
partition and loss as DeepSpeed's ``PipelineModule``, on a :class:`~ds_recycle.runtime.grid.SurvivorGrid`)
and then :func:`initialize` constructs :class:`~ds_recycle.engine.engine.RecyclePipelineEngine` the way
``deepspeed.initialize`` constructs a ``PipelineEngine``::

    workers = WorkerMap.dense(S, D, absent={(1, 0)})
    module = build_pipeline_module(specs, workers=workers, loss_fn=loss, partition_method="type:Block")
    engine, optimizer, _, scheduler = ds_recycle.initialize(model=module, optimizer=torch.optim.Adam(...),
                                                            config=ds_config, plan=plan, data=source)
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule

from ds_recycle.engine.engine import MicroBatchSourceLike, RecyclePipelineEngine
from ds_recycle.engine.optimizer import ClipScope
from ds_recycle.engine.schedule import PlanLike
from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap, survivor_module_grid

__all__ = ["build_pipeline_module", "initialize"]

logger = logging.getLogger(__name__)


def build_pipeline_module(layers: Sequence[Any], *, workers: WorkerMap, loss_fn: Callable[..., torch.Tensor],
                          partition_method: str = "parameters", timeout_s: float = 300.0) -> PipelineModule:
    """DeepSpeed's ``PipelineModule(layers, num_stages=S, ...)`` for a job whose grid may have holes.

    Call collectively on every live rank after ``deepspeed.init_distributed``.
    """
    grid = SurvivorGrid(workers, timeout_s=timeout_s)
    with survivor_module_grid(grid):
        return PipelineModule(layers=list(layers), topology=grid.topology(), loss_fn=loss_fn,
                              partition_method=partition_method)


def initialize(*, model: PipelineModule, config: dict[str, Any], plan: PlanLike, data: MicroBatchSourceLike,
               optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer],
               lr_scheduler: Any = None, clip_scope: ClipScope = ClipScope.FIRST_STAGE,
               ) -> tuple[RecyclePipelineEngine, torch.optim.Optimizer, None, Any]:
    """Build the engine; returns ``(engine, optimizer, None, lr_scheduler)`` like ``deepspeed.initialize``."""
    if not isinstance(model._grid, SurvivorGrid):
        raise TypeError("model must come from ds_recycle.build_pipeline_module (a PipelineModule on a SurvivorGrid)")
    if "optimizer" in config:
        raise ValueError("the DeepSpeed config has an 'optimizer' block; pass a torch optimizer instead "
                         "(DeepSpeed's would compile fused ops)")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters())
    mpu = model.mpu()
    deepspeed.runtime.zero.partition_parameters.shutdown_init_context()
    engine = RecyclePipelineEngine(plan=plan, data=data, clip_scope=clip_scope, args=None, model=model,
                                   optimizer=optimizer, model_parameters=None, training_data=None,
                                   lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=None, collate_fn=None,
                                   config=config, config_class=DeepSpeedConfig(config, mpu))
    deepspeed.runtime.zero.partition_parameters.restore_init_context()
    return engine, engine.optimizer, None, engine.lr_scheduler
