"""Checkpoints in DeepSpeed's own pipeline layout, written and read by one worker of each stage.

DeepSpeed 0.19.8's ``PipelineEngine.save_checkpoint`` writes, under ``SAVE_DIR/TAG/``:

- ``layer_XX-model_states.pt``: each layer's ``state_dict`` (``XX`` = the layer's global index), written by the
  first data-parallel replica of the stage (``PipelineModule.save_state_dict``);
- ``mp_rank_SS_model_states.pt``: the stage's engine state (``module`` None, the optimizer and LR-scheduler
  state, step counters, the config; ``SS`` = the stage, DeepSpeed's pipeline "model parallel" rank) plus the
  caller's ``client_state``;
- ``SAVE_DIR/latest``: the tag.

DeepSpeed's writer is data-parallel rank 0 of each stage and its barriers run over WORLD; after a failure neither
need exist. Here the writer is the stage's first *live* replica, and the caller synchronises (the failure handler's
bounded groups, or the grid's). The files are DeepSpeed's, so vanilla DeepSpeed's ``load_checkpoint`` reads them
(tested), and ds_recycle reads DeepSpeed's. ds_recycle adds one client key, ``ds_recycle_iteration``: the next
iteration, so that a resumed job continues the same data stream (a micro-batch is a pure function of its step).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["ITERATION_KEY", "latest_tag", "read_stage", "write_latest", "write_stage"]

ITERATION_KEY = "ds_recycle_iteration"
"""Client-state key of the next iteration to train (the data position)."""


def _layer_path(directory: Path, index: int) -> Path:
    return directory / f"layer_{index:02d}-model_states.pt"


def _stage_path(directory: Path, stage: int) -> Path:
    return directory / f"mp_rank_{stage:02d}_model_states.pt"


def write_stage(engine: Any, save_dir: str, tag: str, client_state: dict[str, Any] | None = None) -> Path:
    """Write ``engine``'s stage (layers and engine state) under ``save_dir/tag``; returns the stage file."""
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE
    from deepspeed.git_version_info import version

    directory = Path(save_dir) / str(tag)
    directory.mkdir(parents=True, exist_ok=True)
    module = engine.module
    for local, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "state_dict"):
            _save(layer.state_dict(), _layer_path(directory, module._local_start + local))
    state = {
        "module": None, "buffer_names": engine._get_buffer_names(),
        "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
        "param_shapes": None, "frozen_param_shapes": None, "shared_params": None, "frozen_param_fragments": None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None, "random_ltd": None, "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "dp_world_size": engine.workers.pipelines, "mp_world_size": engine.num_stages,
        CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: engine.num_stages, CHECKPOINT_TP_DEGREE: 1},
        "ds_config": engine.config, "ds_version": version,
        **(client_state or {}), ITERATION_KEY: engine.iteration,
    }
    path = _stage_path(directory, engine.stage_id)
    _save(state, path)
    return path


def _save(obj: Any, path: Path) -> None:
    """``torch.save`` through a temporary file: a reader (a restarted rank loading the checkpoint its peer is
    writing again) sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` (after every stage's files are complete)."""
    tmp = Path(save_dir) / "latest.tmp"
    tmp.write_text(str(tag))
    os.replace(tmp, Path(save_dir) / "latest")


def latest_tag(load_dir: str) -> str | None:
    """The tag ``load_dir/latest`` names, or None when there is none."""
    path = Path(load_dir) / "latest"
    return path.read_text().strip() if path.is_file() else None


def read_stage(engine: Any, load_dir: str, tag: str | None = None, *, load_optimizer_states: bool = True,
               load_lr_scheduler_states: bool = True, strict: bool = True) -> tuple[str | None, dict[str, Any]]:
    """Load ``engine``'s stage from a DeepSpeed pipeline checkpoint; ``(stage file, client state)`` as DeepSpeed.

    ``(None, {})`` when there is no checkpoint. Sets the engine's step counters and its next iteration (the
    ``ds_recycle_iteration`` key, else DeepSpeed's ``global_steps``).
    """
    tag = tag if tag is not None else latest_tag(load_dir)
    if tag is None:
        return None, {}
    directory = Path(load_dir) / str(tag)
    path = _stage_path(directory, engine.stage_id)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint {directory} has no state for stage "
                                f"{engine.stage_id} (was it written by a job with {engine.num_stages} stages?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    module = engine.module
    for local, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "load_state_dict"):
            layer.load_state_dict(torch.load(_layer_path(directory, module._local_start + local),
                                             map_location="cpu", weights_only=True), strict=strict)
    if load_optimizer_states and state.get("optimizer") is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state.get("global_samples", engine.global_steps * engine.train_batch_size()))
    engine.skipped_steps = int(state.get("skipped_steps", 0))
    engine.iteration = int(state.get(ITERATION_KEY, engine.global_steps))
    own = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
           "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS

    own.add(CHECKPOINT_PARALLEL_DIMS)
    return str(path), {k: v for k, v in state.items() if k not in own}
