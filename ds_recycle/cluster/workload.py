"""What is trained: per-stage costs for any pipeline depth, samples per micro-batch, recovery times.

Two sources: a model profile (:mod:`ds_recycle.cluster.models`, costs derived from FLOP counts and the
hardware) or a cost-profile file in the plan format (`--costs-file`, the planner's `CostModel`). A
file gives costs for exactly its own stage count; a system that re-partitions the model over `n`
stages (Oobleck's templates) then spreads the file's total per-kind cost evenly over the `n` stages,
and its all-reduce cost is kept per stage as measured.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from ds_recycle.cluster.models import (
    A100_NODE,
    BYTES_PER_PARAM,
    Hardware,
    ModelProfile,
    base_partition,
    layer_costs,
    stage_costs,
)
from ds_recycle.plan import CostModel
from ds_recycle.plan.partition import LayerCosts, Partition

__all__ = ["Workload", "workload_from_model", "workload_from_costs_file", "FILE_LAYERS_PER_STAGE"]

FILE_LAYERS_PER_STAGE = 16
"""A cost file gives stages, not layers: re-partitioning treats each of its stages as this many equal layers."""


@dataclass(frozen=True)
class Workload:
    """Everything the systems need to know about the job's model.

    `costs_at(stages, pipelines)` is the planner cost model of the model split over `stages` nodes with
    `pipelines` replicas a stage; `stage_state_bytes(stages)` the model state one node of such a split
    holds (what a checkpoint writes and a rejoining node copies).
    """

    name: str
    micro_batch: int
    """Sequences (samples) per micro-batch."""
    reconfigure_s: float
    restart_s: float
    hardware: Hardware
    model: ModelProfile | None = None
    fixed_costs: CostModel | None = None
    state_bytes_total: float = 0.0

    def costs_at(self, stages: int, pipelines: int) -> CostModel:
        return _costs_at(self, stages, pipelines)

    def layers_at(self, stages: int, pipelines: int) -> tuple[LayerCosts, Partition]:
        """Per-layer costs and the partition :meth:`costs_at` assumes (what re-partitioning starts from)."""
        return _layers_at(self, stages, pipelines)

    def stage_state_bytes(self, stages: int) -> float:
        return self.state_bytes_total / stages

    @property
    def default_stages(self) -> int | None:
        return self.fixed_costs.stages if self.fixed_costs is not None else None


@lru_cache(maxsize=4096)
def _costs_at(w: Workload, stages: int, pipelines: int) -> CostModel:
    if w.model is not None:
        return stage_costs(w.model, w.hardware, stages, pipelines, w.micro_batch)
    assert w.fixed_costs is not None
    c = w.fixed_costs
    if stages == c.stages:
        return c
    spread = lambda xs: tuple([sum(xs) / stages] * stages)  # noqa: E731 - one-line helper
    return CostModel(F=spread(c.F), B=spread(c.B), W=spread(c.W),
                     O=tuple([max(c.O)] * stages), comm=c.comm)


@lru_cache(maxsize=256)
def _layers_at(w: Workload, stages: int, pipelines: int) -> tuple[LayerCosts, Partition]:
    if w.model is not None:
        return (layer_costs(w.model, w.hardware, pipelines, w.micro_batch),
                base_partition(w.model, stages, w.micro_batch))
    c, n = w.costs_at(stages, pipelines), FILE_LAYERS_PER_STAGE
    per = {k: tuple(v / n for v in getattr(c, k) for _ in range(n)) for k in ("F", "B", "W", "O")}
    state = w.stage_state_bytes(stages) / n
    layers = LayerCosts(per["F"], per["B"], per["W"], per["O"], (state,) * (n * stages),
                        w.hardware.inter_node_gbs * 1e9, c.comm)
    return layers, tuple(n * s for s in range(stages + 1))


def workload_from_model(model: ModelProfile, micro_batch: int,
                        hardware: Hardware = A100_NODE) -> Workload:
    """A workload from a model profile; `micro_batch` sequences per micro-batch."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch}: at least one sequence. Fix: micro_batch >= 1")
    return Workload(name=model.name, micro_batch=micro_batch, reconfigure_s=model.reconfigure_s,
                    restart_s=model.restart_s, hardware=hardware, model=model,
                    state_bytes_total=float(BYTES_PER_PARAM * model.params))


def workload_from_costs_file(path: str | os.PathLike[str], *, micro_batch: int, state_gb: float,
                             reconfigure_s: float, restart_s: float,
                             hardware: Hardware = A100_NODE) -> Workload:
    """A workload from a plan-format cost profile; the rest of what a system needs is given."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"--costs-file {path!r} does not exist. Fix: pass a JSON file with "
                         "F, B, W, O (lists, one entry a stage) and comm")
    costs = CostModel.from_file(path)
    return Workload(name=os.path.basename(path), micro_batch=micro_batch,
                    reconfigure_s=reconfigure_s, restart_s=restart_s, hardware=hardware,
                    fixed_costs=costs, state_bytes_total=state_gb * 1e9)
