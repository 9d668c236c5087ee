"""The grid the engine and DeepSpeed read, rebuilt for a new membership epoch.

DeepSpeed's ``PipelineParallelGrid`` cannot hold a hole, and a :class:`~ds_recycle.runtime.grid.SurvivorGrid`
creates its groups with ``dist.new_group``, which needs every rank of the (now poisoned) WORLD. An
:class:`EpochGrid` answers the same mpu questions from the survivors' :class:`WorkerMap`, and its groups are
the epoch's gloo groups (:class:`~ds_recycle.resilience.transport.EpochComm`), which are not registered with
``torch.distributed``: code that hands them to ``dist.*`` calls fails loudly instead of hanging. The engine
itself communicates only through its channel and optimizer, which the runner replaces at the same time.
"""
from __future__ import annotations

import datetime
from typing import Any

from ds_recycle.resilience.transport import EpochComm
from ds_recycle.runtime.grid import SurvivorGrid, SurvivorTopology, WorkerMap

__all__ = ["EpochGrid"]


class EpochGrid(SurvivorGrid):
    """A :class:`SurvivorGrid` for the members of one epoch, built without any collective call."""

    def __init__(self, workers: WorkerMap, rank: int, comm: EpochComm) -> None:  # noqa: D107 (no super().__init__)
        self.workers = workers
        self.global_rank = rank
        self.world_size = workers.world_size
        self._topo = SurvivorTopology(workers)
        self.timeout = datetime.timedelta(seconds=comm.timeout_s)
        self.data_parallel_id, self.stage_id = workers.worker_of_rank(rank)
        self.pipe_parallel_size = workers.stages
        self.data_parallel_size = workers.pipelines
        self.model_parallel_size = 1
        self.slice_parallel_size = 1
        live = sorted(workers.ranks.values())
        self.comm = comm
        self.world_proc_group = self.p2p_group = comm.p2p
        self.norm_group = comm.norm
        self.dp_group = workers.stage_ranks(self.stage_id)
        self.dp_proc_group = comm.stage
        self.slice_proc_group = None
        self.pp_group = [r for (d, _), r in sorted(workers.ranks.items(), key=lambda kv: kv[0][1])
                         if d == self.data_parallel_id]
        self.ds_model_rank = live.index(rank)
        self.ds_model_world_size = len(live)

    def get_pipe_parallel_group(self) -> Any:
        """An epoch has no per-pipeline group (the engine never needs one): refused rather than handing out WORLD."""
        raise RuntimeError("after a regroup the grid has no per-pipeline process group; its ranks are in pp_group")
