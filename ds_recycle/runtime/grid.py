"""A pipeline grid with holes: DeepSpeed's mpu interface over an explicit worker -> rank map.

DeepSpeed's ``PipelineParallelGrid`` is a full Cartesian product of stages x pipelines that asserts
``stages * pipelines == world size``; it cannot describe a job in which some workers are absent.
:class:`SurvivorGrid` answers the same questions (DeepSpeed's engine, its ``groups`` module and its
``PipelineModule`` call them) from an explicit ``{(pipeline, stage): global rank}`` map:

- the data-parallel group of a stage holds the *live* replicas of that stage;
- ``data_parallel_size`` stays the nominal number of pipelines D, because the global batch
  (``train_batch_size = mbs * M * D``) and the gradient normalization do not change with failures;
- groups are created with ``dist.new_group(..., use_local_synchronization=True, timeout=...)``, so a
  wait never lasts DeepSpeed's default 30 minutes.

Ranks of live workers follow DeepSpeed's order (stage-major, then pipeline) with the holes removed, so
a job without absent workers has exactly DeepSpeed's rank layout.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from deepspeed.runtime.pipe import module as ds_module
from deepspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["Worker", "WorkerMap", "SurvivorTopology", "SurvivorGrid", "survivor_module_grid"]

logger = logging.getLogger(__name__)

Worker = tuple[int, int]
"""A worker as ``(pipeline, stage)``."""


@dataclass(frozen=True)
class WorkerMap:
    """Which global rank runs which live worker of an S x D job."""

    stages: int
    pipelines: int
    ranks: Mapping[Worker, int]
    """``(pipeline, stage) -> global rank`` of every live worker."""

    @classmethod
    def dense(cls, stages: int, pipelines: int, absent: frozenset[Worker] | set[Worker] = frozenset()) -> WorkerMap:
        """Live workers numbered as DeepSpeed does (stage-major, then pipeline), holes skipped."""
        ranks: dict[Worker, int] = {}
        for s in range(stages):
            for d in range(pipelines):
                if (d, s) not in absent:
                    ranks[(d, s)] = len(ranks)
        for s in range(stages):
            if all((d, s) in absent for d in range(pipelines)):
                raise ValueError(f"every worker of stage {s} is absent; keep at least one live worker per stage")
        return cls(stages, pipelines, ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def worker_of_rank(self, rank: int) -> Worker:
        for worker, r in self.ranks.items():
            if r == rank:
                return worker
        raise KeyError(f"rank {rank} runs no worker of this {self.stages}x{self.pipelines} job (ranks: {dict(self.ranks)})")

    def rank_of(self, worker: Worker) -> int:
        try:
            return self.ranks[worker]
        except KeyError:
            raise KeyError(f"worker (pipeline {worker[0]}, stage {worker[1]}) is absent") from None

    def stage_ranks(self, stage: int) -> list[int]:
        """Global ranks of the live replicas of ``stage``, by pipeline."""
        return [self.ranks[(d, stage)] for d in range(self.pipelines) if (d, stage) in self.ranks]

    def absent(self) -> frozenset[Worker]:
        return frozenset((d, s) for s in range(self.stages) for d in range(self.pipelines) if (d, s) not in self.ranks)


class SurvivorTopology(ProcessTopology):
    """DeepSpeed's ``pipe`` x ``data`` topology restricted to the live workers."""

    def __init__(self, workers: WorkerMap) -> None:
        super().__init__(axes=["pipe", "data"], dims=[workers.stages, workers.pipelines])
        self.mapping = {self.ProcessCoord(pipe=s, data=d): r for (d, s), r in workers.ranks.items()}

    def get_rank(self, **coord_kwargs: int) -> int:
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise KeyError(f"no live worker at {key}: that worker is absent")
        return self.mapping[key]


class SurvivorGrid:
    """DeepSpeed's mpu / pipeline-grid duck type for a job whose grid may have holes.

    All ranks build it collectively, in the same order. Groups:

    - ``dp_proc_group``: the live replicas of this rank's stage (gradient all-reduce);
    - ``world_proc_group``: every live rank (DeepSpeed's "model parallel" group, used at start-up only);
    - ``p2p_group``: every live rank, for activations and gradients between any two workers;
    - ``norm_group``: every live rank, for the clipping norm;
    - ``pp_proc_group`` (``get_pipe_parallel_group``): the live workers of this rank's pipeline, as DeepSpeed's
      ``PipelineParallelGrid`` means it (one pipeline's stages; with a hole, the pipeline's survivors).

    The "model parallel" group stays every live rank, unlike DeepSpeed's (one pipeline's ranks): DeepSpeed reads
    it to sum the clipping norm over a pipeline and to name checkpoint files, and ds_recycle does both itself
    (the norm over ``norm_group``, checkpoints in :mod:`ds_recycle.engine.ds_checkpoint`); at start-up the
    engine only needs a group that holds every rank.
    """

    def __init__(self, workers: WorkerMap, timeout_s: float = 300.0) -> None:
        self.workers = workers
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size != workers.world_size:
            raise ValueError(f"{workers.stages} stages x {workers.pipelines} pipelines with "
                             f"{len(workers.absent())} absent need {workers.world_size} processes, "
                             f"but the world has {self.world_size}; launch that many processes")
        self._topo = SurvivorTopology(workers)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.data_parallel_id, self.stage_id = workers.worker_of_rank(self.global_rank)
        self.pipe_parallel_size = workers.stages
        self.data_parallel_size = workers.pipelines
        self.model_parallel_size = 1
        self.slice_parallel_size = 1
        live = sorted(workers.ranks.values())
        self.world_proc_group = self._group(live)
        self.p2p_group = self._group(live)
        self.norm_group = self._group(live)
        self.dp_group = workers.stage_ranks(self.stage_id)
        self.dp_proc_group = self._group(self.dp_group)
        self.slice_proc_group = self._group([self.global_rank])
        self.pp_group = [r for (d, _), r in sorted(workers.ranks.items(), key=lambda kv: kv[0][1])
                         if d == self.data_parallel_id]
        self.pp_proc_group = self._group(self.pp_group)
        self.ds_model_rank = live.index(self.global_rank)
        self.ds_model_world_size = len(live)

    def _group(self, ranks: list[int]) -> Any:
        return dist.new_group(ranks=ranks, timeout=self.timeout, use_local_synchronization=True)

    # Coordinates
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        data = kwargs.pop("data", self.data_parallel_id)
        if kwargs:
            raise KeyError(f"unknown grid axes {sorted(kwargs)}; this grid has 'pipe' and 'data'")
        return self.workers.rank_of((data, stage_id))

    def topology(self) -> SurvivorTopology:
        return self._topo

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    # Pipe axis
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        """The live workers of this rank's pipeline (global ranks in :attr:`pp_group`, by stage)."""
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # Data axis: the live replicas of this stage; the size stays the nominal D
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    # "Model parallel" in DeepSpeed's pipeline sense: every live rank
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.world_proc_group

    # Tensor slicing: none
    def get_slice_parallel_rank(self) -> int:
        return 0

    def get_slice_parallel_world_size(self) -> int:
        return 1

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


@contextlib.contextmanager
def survivor_module_grid(grid: SurvivorGrid) -> Iterator[None]:
    """Make ``PipelineModule(...)`` built inside this block use ``grid`` instead of a Cartesian grid.

    ``PipelineModule.__init__`` always constructs DeepSpeed's ``PipelineParallelGrid`` (which cannot hold a
    hole); inside this block the name it looks up returns ``grid``. Pass ``topology=grid.topology()``.
    """
    original = ds_module.PipelineParallelGrid
    ds_module.PipelineParallelGrid = lambda *args, **kwargs: grid
    try:
        yield
    finally:
        ds_module.PipelineParallelGrid = original
