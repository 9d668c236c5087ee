"""Process-group start-up for a worker, the same under ``ds-recycle launch``, ``deepspeed`` and ``torchrun``.

:func:`init_worker` is what ``deepspeed.init_distributed()`` does, plus what a job that survives failures
needs first: under ``ds-recycle launch`` a rank restarted while the others train starts on a detached WORLD
(:mod:`ds_recycle.resilience.detached`), and a job that fell back to a checkpoint starts under a fresh store
prefix. It never JIT-compiles DeepSpeed's CPU shared-memory op (only inference all-reduce uses it). The
launcher's bootstrap (:mod:`ds_recycle.launcher.bootstrap`) calls it before a user's script runs, so the
script's own ``deepspeed.init_distributed()`` finds the process group ready and only wraps it. Calling it
again returns the same :class:`World`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ds_recycle.resilience.accelerator import place_worker

logger = logging.getLogger(__name__)

__all__ = ["World", "disable_cpu_jit_ops", "end_start_up_without_handler", "init_worker", "peer_lost_in_start_up",
           "under_recycle_launcher"]


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


_WORLD: World | None = None


def under_recycle_launcher() -> bool:
    """True in a worker started by ``ds-recycle launch`` (whose store outlives every worker)."""
    return os.environ.get("DS_RECYCLE_LAUNCHER") == "1" and bool(os.environ.get("DS_RECYCLE_STORE"))


def end_start_up_without_handler() -> None:
    """Under ``ds-recycle launch``, an engine without ds_recycle's failure handler (DeepSpeed's own, a stock script
    or ``"recycle": {"enabled": false}``) ends the generation's start-up once built: a loss before restarts every
    rank, a later one does not (there is no handler to recover from it; see ``ds_recycle/gen<g>/started``)."""
    if not under_recycle_launcher():
        return
    from ds_recycle.resilience.store import connect_store
    from ds_recycle.runtime.job_store import generation, started_key

    store = connect_store()
    store.set(started_key(generation(store)), "1")


def peer_lost_in_start_up(wait_s: float) -> bool:
    """Under ``ds-recycle launch``, for a worker whose start-up ended in an exception: whether a peer's death
    explains it. True when this process's generation has not finished its start-up and, within ``wait_s``, a
    rank of it is reported lost before the end of the start-up or the start-up is restarted (a peer that died
    while the groups were built fails the others' connections, often before its loss is reported: a whole
    host's loss is declared only after the launchers' node timeout)."""
    if not under_recycle_launcher():
        return False
    import time

    from ds_recycle.resilience.store import connect_store
    from ds_recycle.runtime.job_store import GENERATION_ENV, generation, start_up_deaths_key, started_key

    store = connect_store()
    mine = int(os.environ.get(GENERATION_ENV, "0"))
    deadline = time.monotonic() + wait_s
    while True:
        if store.check([started_key(mine)]):
            return False
        if generation(store) != mine or int(store.add(start_up_deaths_key(mine), 0)) > 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def disable_cpu_jit_ops() -> None:
    """Keep ``deepspeed.init_distributed()`` on CPU from JIT-compiling its shared-memory op (~2 min cold)."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_worker(timeout_s: float = 600.0, threads: int | None = None) -> World:
    """Initialise ``torch.distributed`` (gloo, also on GPUs) through DeepSpeed, without its hidden JIT builds.

    One compute thread per process unless ``OMP_NUM_THREADS`` or ``threads`` says otherwise: several
    workers sharing a CPU are many times slower when each uses several threads.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    disable_cpu_jit_ops()
    from deepspeed.comm.comm import init_distributed  # DeepSpeed's own (the launcher's bootstrap routes the
    # public names, deepspeed.init_distributed and deepspeed.comm.init_distributed, here)

    # WORLD and DeepSpeed's groups are gloo's, on GPUs too: no NCCL communicator outside the epochs' ever holds a dead
    # rank (the epochs carry the training's tensors, over NCCL where recycle.transport takes it); the GPU is
    # placed first, so that DeepSpeed's own placements find the device
    place_worker(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "gloo"
    rejoining = False
    import torch.distributed as dist

    if under_recycle_launcher() and not dist.is_initialized():
        # After a fallback to a checkpoint the job runs again under a fresh store prefix (the old WORLD's
        # keys are still in the launcher's store); generation 0 uses the ordinary env:// start-up; a rank
        # restarted while the others train on joins them on a detached WORLD.
        from ds_recycle.resilience.checkpoint import WorldStart, init_generation_world

        if init_generation_world(timeout_s) is WorldStart.REJOIN:
            from ds_recycle.resilience.detached import init_detached_world

            init_detached_world(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s)
            rejoining = True
    init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    world = World(rank=dist.get_rank(), world_size=dist.get_world_size(),
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                  resilient=under_recycle_launcher(), rejoining=rejoining)
    _WORLD = world
    return world
