"""A WORLD that does no communication, for a process that joins a running job.

A restarted worker cannot enter the job's WORLD group: its peers built it long ago (and it now contains a
dead process), and ``torch.distributed`` cannot grow a group. Yet DeepSpeed needs an initialised default
group to build a ``PipelineModule`` and a ``PipelineEngine`` (ranks, world size, sub-groups, a start-up
broadcast of the parameters). So the joining process initialises a *detached* WORLD: its own rank and the
job's world size, on a process group that never touches the network (``torch``'s ``FakeProcessGroup``:
every collective returns at once and leaves its tensors as they are).

Nothing that group "computes" is ever used: before the first instruction runs, the runner replaces every
communicator of the engine with the members' per-epoch gloo groups
(:class:`~ds_recycle.resilience.transport.EpochComm`) and overwrites the parameters and optimizer state
with those of a live replica (:mod:`ds_recycle.resilience.rejoin`).
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["DETACHED_BACKEND", "init_detached_world"]

logger = logging.getLogger(__name__)

DETACHED_BACKEND = "ds_recycle_detached"
"""The backend name under which the communication-free process group is registered."""


def _create(common_opts: Any, backend_opts: Any) -> Any:
    from torch._C._distributed_c10d import FakeProcessGroup

    create: Any = FakeProcessGroup._create_internal  # the stub lags torch 2.13's signature (rank, size, options)
    return create(common_opts.group_rank, common_opts.group_size, backend_opts)


def init_detached_world(rank: int, world_size: int, timeout_s: float = 60.0) -> None:
    """Initialise WORLD as ``rank`` of ``world_size`` without connecting to anyone."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised: a detached WORLD must be the first one")
    if DETACHED_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(DETACHED_BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(DETACHED_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    logger.info("detached WORLD: rank %d of %d (no communication; the job's groups come with the join)",
                rank, world_size)
