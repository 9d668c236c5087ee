"""Process-group start-up for a worker, the same under ``ds-recycle launch``, ``deepspeed`` and ``torchrun``."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)

__all__ = ["World", "init_worker"]


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    resilient: bool
    """True under ``ds-recycle launch``, whose store outlives every worker."""
    rejoining: bool = False
    """A restarted worker joining a running job: its WORLD is detached, its state comes from a live peer."""


def init_worker(timeout_s: float = 600.0, threads: int | None = None) -> World:
    """Initialise ``torch.distributed`` (gloo on CPU) through DeepSpeed, without its hidden JIT builds.

    One compute thread per process unless ``OMP_NUM_THREADS`` or ``threads`` says otherwise: several
    workers sharing a CPU are many times slower when each uses several threads.
    """
    torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator would JIT-compile a shared-memory op only inference all-reduce uses.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = "gloo" if not torch.cuda.is_available() else "nccl"
    rejoining = False
    if os.environ.get("DS_RECYCLE_LAUNCHER") == "1" and os.environ.get("DS_RECYCLE_STORE"):
        # After a fallback to a checkpoint the job runs again under a fresh store prefix (the old WORLD's
        # keys are still in the launcher's store); generation 0 uses the ordinary env:// start-up; a rank
        # restarted while the others train on joins them on a detached WORLD.
        from ds_recycle.resilience.checkpoint import WorldStart, init_generation_world

        if init_generation_world(timeout_s) is WorldStart.REJOIN:
            from ds_recycle.resilience.detached import init_detached_world

            init_detached_world(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s)
            rejoining = True
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    import torch.distributed as dist

    world = World(rank=dist.get_rank(), world_size=dist.get_world_size(),
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                  resilient=os.environ.get("DS_RECYCLE_LAUNCHER") == "1", rejoining=rejoining)
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
    return world
