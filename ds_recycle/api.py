"""``ds_recycle.initialize``: ``deepspeed.initialize`` for a ``PipelineModule``, with ReCycle's engine.

A DeepSpeed pipeline script changes in two lines (the import and the call), and its JSON config may gain an
optional ``"recycle"`` section::

     import deepspeed
    +import ds_recycle
     ...
     net = PipelineModule(layers=..., num_stages=2, loss_fn=...)
    -engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=params, training_data=ds)
    +engine, _, _, _ = ds_recycle.initialize(args=args, model=net, model_parameters=params, training_data=ds)
     for step in range(steps):
         loss = engine.train_batch()

``S`` comes from the module, ``D`` from the world size. The script runs as before under ``torchrun`` and
``deepspeed`` (no failure survival there: those launchers kill every worker when one dies); under
``ds-recycle launch`` the engine survives worker failures inside ``train_batch()``: the failed worker's
micro-batches are re-routed to its data-parallel peers, the global batch and the model stay those of a
failure-free run. ``"recycle": {"enabled": false}`` returns DeepSpeed's own engine for the same script.

Data must be addressable (a peer may have to produce another pipeline's micro-batch): ``training_data=``
a map-style Dataset (served in DeepSpeed's own order), or an object with a
``micro_batch(step, pipeline, index)`` method, or ``train_batch(data_iter=...)`` over a DataLoader with a
DistributedSampler. What the ReCycle engine cannot run is refused here, with the reason and the fix.
"""
from __future__ import annotations

import argparse
import atexit
import copy
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from ds_recycle.config import ConfigError
from ds_recycle.config.job import JobConfig, job_config, read_deepspeed_config
from ds_recycle.engine.engine import MicroBatchSourceLike, RecyclePipelineEngine
from ds_recycle.engine.schedule import PlanLike, PlanNotRunnableError
from ds_recycle.runtime.grid import SurvivorGrid, WorkerMap

__all__ = ["UnsupportedModelError", "initialize", "make_job_plan"]

logger = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The model uses something the ReCycle engine does not run (said at ``initialize``, never mid-run)."""


def make_job_plan(cfg: JobConfig) -> PlanLike:
    """The planner's plan for the job: shape, absent workers, schedule, optimizer, memory limit and costs."""
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


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable[..., Any] | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None, *,
               plan: PlanLike | None = None) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` for a ``PipelineModule``: ``(engine, optimizer, dataloader, lr_scheduler)``.

    The arguments are DeepSpeed's (see the module docstring for what differs); ``plan`` (keyword only)
    overrides the planner's plan for the job. The dataloader is None: the engine serves each micro-batch
    itself, by address. ``optimizer`` may be a torch optimizer, a callable that builds one from the
    parameters, or None with an ``"optimizer"`` block in the config. As in DeepSpeed, ``dist_init_required``
    None or True initialises ``torch.distributed`` if it is not (False: it must be already), and
    ``distributed_port`` is the rendezvous port when no launcher set ``MASTER_PORT``. ``mpu`` and
    ``mesh_param`` are refused (the grid comes from the module).
    """
    ds_config = read_deepspeed_config(config, args, config_params)
    if not isinstance(model, PipelineModule):
        raise UnsupportedModelError(f"model is a {type(model).__name__}, not a deepspeed.pipe.PipelineModule: "
                                    "ds_recycle runs pipeline-parallel models; build one with "
                                    "PipelineModule(layers=..., num_stages=...), or use deepspeed.initialize")
    section = ds_config.get("recycle", {})
    if isinstance(section, dict) and section.get("enabled", True) is False:
        return _vanilla(args, model, optimizer, model_parameters, training_data, lr_scheduler, collate_fn, ds_config,
                        distributed_port, dist_init_required, mpu, mesh_param)
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise UnsupportedModelError(f"{name}= is not supported: the pipeline grid comes from the "
                                        "PipelineModule (and is rebuilt among the survivors after a failure)")
    _check_topology(model)
    world = _init_distributed(distributed_port, dist_init_required)
    if world.resilient and _ENGINES:
        raise UnsupportedModelError("a second ds_recycle.initialize in one process under ds-recycle launch: the "
                                    "failure handler holds one engine per worker (its groups, its store keys). "
                                    "Reuse the first engine (engine.load_checkpoint reads a checkpoint into it), "
                                    "or run the second model in its own process")
    user_config = copy.deepcopy(ds_config)
    holes = model._grid.workers if isinstance(model._grid, SurvivorGrid) else None  # built with absent workers
    cfg = job_config(ds_config, stages=model.num_stages, cpu=not torch.cuda.is_available(),
                     world_size=world.world_size if holes is None else holes.stages * holes.pipelines,
                     absent=frozenset() if holes is None else holes.absent())
    _check_model(model)
    workers = holes or WorkerMap.dense(cfg.recycle.stages, cfg.recycle.pipelines)
    if workers.worker_of_rank(world.rank)[1] != model.stage_id:
        raise UnsupportedModelError(f"rank {world.rank} holds stage {model.stage_id} of the module, but DeepSpeed's "
                                    f"layout (stage-major) puts it in stage {workers.worker_of_rank(world.rank)[1]}: "
                                    "build the PipelineModule with num_stages= or a PipeDataParallelTopology")
    data = _data_source(training_data, collate_fn, cfg)
    job_plan = plan if plan is not None else make_job_plan(cfg)
    if holes is None:
        model._grid = SurvivorGrid(workers, timeout_s=cfg.recycle.failure_timeout_s)
    engine = _build_engine(model, optimizer, model_parameters, lr_scheduler, cfg, job_plan, data)
    engine.job_config, engine.rng_seed = cfg, cfg.recycle.rng_seed
    if cfg.recycle.repartition.enabled:
        if engine.layers_fixed is None:
            engine.seed_per_layer()  # a layer's dropout masks follow it to whichever stage holds it
        elif engine.global_rank == 0:
            logger.warning("recycle.repartition: layers will not move between stages in this job (%s); failures "
                           "are only re-routed", engine.layers_fixed)
    engine.config = user_config  # as DeepSpeed's engine.config: the user's own dict (a script may hand it on)
    _ENGINES.append(engine)
    _close_at_exit(engine)
    if world.resilient:
        from ds_recycle.resilience.handler import FailureHandler

        _resume_after_fallback(engine, FailureHandler(engine, cfg, rejoining=world.rejoining))
    logger.info("ds_recycle engine: %d stages x %d pipelines, %d micro-batches, schedule %s, failure handling %s",
                cfg.recycle.stages, cfg.recycle.pipelines, cfg.micro_batches, cfg.recycle.schedule,
                "on" if world.resilient else "off (use ds-recycle launch)")
    return engine, engine.optimizer, None, engine.lr_scheduler


def _init_distributed(distributed_port: int, dist_init_required: bool | None) -> Any:
    """``torch.distributed`` as ``deepspeed.initialize`` leaves it (see :func:`initialize`), through
    :func:`~ds_recycle.resilience.world.init_worker`; the worker's place in the job."""
    import os

    import torch.distributed as dist

    from ds_recycle.resilience.world import init_worker

    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call deepspeed.init_distributed() before "
                           "ds_recycle.initialize, or pass dist_init_required=None or True")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", str(distributed_port))  # DeepSpeed uses it where no launcher set one
    return init_worker()


def _resume_after_fallback(engine: RecyclePipelineEngine, handler: Any) -> None:
    """A job restarted from its checkpoint after a whole stage was lost: load it, so that a script that never
    loads checkpoints itself resumes too. Its loop starts again from its first step: the calls up to the
    checkpoint's iteration return at once (a NaN loss), as for a worker that joined a running job; a script that
    does call ``engine.load_checkpoint`` itself resumes where it says."""
    directory = handler.resume_directory() if handler.joined_at is None else None
    if directory is None:
        return
    path, _ = engine.load_checkpoint(directory)
    engine.resume_calls_at(0)
    logger.warning("resumed from the checkpoint %s after the fallback (iteration %d): the loop's first %d calls "
                   "return at once", path, engine.iteration, engine.iteration)


def _close_at_exit(engine: RecyclePipelineEngine) -> None:
    """At a normal exit of the script, ``engine.close()`` (last step final, groups released) unless it ran."""
    crashed: list[bool] = []
    previous = sys.excepthook

    def note_crash(*exc: Any) -> None:  # a script dying of an exception must not wait in a closing barrier
        crashed.append(True)
        previous(*exc)

    sys.excepthook = note_crash

    def close() -> None:
        if not crashed:
            engine.close()
    atexit.register(close)


_ENGINES: list[RecyclePipelineEngine] = []
"""The engines this process built (one under ds-recycle launch)."""


def _check_topology(model: PipelineModule) -> None:
    """Refuse a topology with an axis beside ``pipe`` and ``data`` larger than 1 (tensor or sequence parallelism):
    its shards would be averaged as if they were replicas."""
    topo = model._topo
    extra = {axis: topo.get_dim(axis) for axis in topo.get_axis_names() if axis not in ("pipe", "data")}
    wide = {axis: size for axis, size in extra.items() if size > 1}
    if wide:
        raise UnsupportedModelError(f"the PipelineModule's topology has {wide} beside pipe and data: ds_recycle "
                                    "re-routes work between data-parallel replicas only, so tensor- or sequence-"
                                    "parallel shards are not supported; build the module with num_stages= or a "
                                    "PipeDataParallelTopology")


def _check_model(model: PipelineModule) -> None:
    """Activation checkpointing: segments recomputed by a non-reentrant checkpoint (:mod:`ds_recycle.engine.recompute`).
    Running statistics (BatchNorm): said to be outside the exactness claim (see the README)."""
    from ds_recycle.engine.recompute import use_recompute

    try:
        use_recompute(model)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from e
    running = running_statistics(model)
    if running:
        logger.warning("%s keep running statistics (buffers updated by each forward): after a failure they also "
                       "absorb the re-routed micro-batches, so they differ from a failure-free run's; the parameters "
                       "do not. Use GroupNorm/LayerNorm, or track_running_stats=False, for buffers that are exact "
                       "too", ", ".join(running[:3]) + (" ..." if len(running) > 3 else ""))


def running_statistics(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose forward updates buffers (BatchNorm-style running statistics)."""
    from torch.nn.modules.batchnorm import _NormBase

    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, _NormBase) and m.track_running_stats]


class _NoData:
    """The data source of an engine built without training data: ``train_batch(data_iter=...)`` must give one."""

    def micro_batch(self, iteration: int, pipeline: int, index: int) -> Any:
        raise ValueError("no training data: pass training_data= to ds_recycle.initialize, or an addressable "
                         "data_iter= to train_batch (see ds_recycle.data.addressable)")


def _data_source(training_data: Any, collate_fn: Callable[..., Any] | None, cfg: JobConfig) -> MicroBatchSourceLike:
    if training_data is None:
        return _NoData()
    if hasattr(training_data, "micro_batch"):
        return training_data
    if not (hasattr(training_data, "__getitem__") and hasattr(training_data, "__len__")):
        raise ConfigError("training_data", f"a {type(training_data).__name__} is neither a map-style Dataset nor an "
                          "object with micro_batch(step, pipeline, index)", "pass a torch Dataset, or add the method "
                          "(a peer must be able to load another pipeline's micro-batch after a failure)")
    from ds_recycle.data.addressable import DeepSpeedOrder

    return DeepSpeedOrder.from_config(training_data, cfg.deepspeed, cfg.recycle.pipelines, collate_fn=collate_fn)


def _build_engine(model: PipelineModule, optimizer: Any, model_parameters: Iterable[Any] | None, lr_scheduler: Any,
                  cfg: JobConfig, plan: PlanLike, data: MicroBatchSourceLike) -> RecyclePipelineEngine:
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    if cfg.recycle.deterministic and torch.cuda.is_available():
        torch.use_deterministic_algorithms(True)  # bit-identical recomputation on peers (CPU kernels already are)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params)
    if optimizer is None and "optimizer" not in cfg.deepspeed:
        raise ConfigError("optimizer", "no optimizer given and none in the config",
                          "pass optimizer= (a torch optimizer) or add an \"optimizer\" block to the DeepSpeed config")
    mpu = model.mpu()
    deepspeed.runtime.zero.partition_parameters.shutdown_init_context()
    try:
        return RecyclePipelineEngine(plan=plan, data=data, args=None, model=model, optimizer=optimizer,
                                     model_parameters=params, training_data=None, lr_scheduler=lr_scheduler,
                                     mpu=mpu, dist_init_required=None, collate_fn=None, config=cfg.deepspeed,
                                     config_class=DeepSpeedConfig(cfg.deepspeed, mpu))
    finally:
        deepspeed.runtime.zero.partition_parameters.restore_init_context()


def _vanilla(args: Any, model: PipelineModule, optimizer: Any, model_parameters: Any, training_data: Any,
             lr_scheduler: Any, collate_fn: Any, ds_config: dict[str, Any], distributed_port: int,
             dist_init_required: bool | None, mpu: Any, mesh_param: Any) -> tuple[Any, Any, Any, Any]:
    """``"recycle": {"enabled": false}``: DeepSpeed's own engine, for the same script and config (every argument
    is handed to ``deepspeed.initialize``)."""
    import deepspeed

    _init_distributed(distributed_port, dist_init_required)
    plain = {k: v for k, v in ds_config.items() if k != "recycle"}
    if args is not None and hasattr(args, "deepspeed_config"):  # DeepSpeed refuses a config given twice
        args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "deepspeed_config"})
    built = tuple(deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                       model_parameters=model_parameters, training_data=training_data,
                                       lr_scheduler=lr_scheduler, collate_fn=collate_fn, config=plain,
                                       distributed_port=distributed_port, dist_init_required=dist_init_required,
                                       mpu=mpu, mesh_param=mesh_param))
    from ds_recycle.resilience.world import end_start_up_without_handler

    end_start_up_without_handler()
    return built
