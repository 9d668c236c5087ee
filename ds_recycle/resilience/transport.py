"""The engine's transfers and collectives on per-epoch groups, every wait bounded.

:class:`EpochComm` holds the gloo groups of one membership epoch (every member for activations and
gradients, every member for the clipping norm, and this rank's stage replicas for the gradient
all-reduce), built over the launcher's store with :class:`~ds_recycle.resilience.comm.EpochGroup`.
:class:`BoundedChannel` and :class:`BoundedOptimizer` are the engine's
:class:`~ds_recycle.engine.p2p.PeerChannel` and :class:`~ds_recycle.engine.optimizer.StaggeredOptimizer`
with their communication moved onto those groups: the tag scheme and the arithmetic are unchanged, and
each wait is :func:`~ds_recycle.resilience.comm.bounded_wait`, which turns a dead peer into a
:class:`~ds_recycle.resilience.comm.PeerFailure` within milliseconds of the launcher's exit report.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.engine.optimizer import StaggeredOptimizer
from ds_recycle.engine.p2p import PeerChannel
from ds_recycle.resilience.comm import EpochGroup, FailureProbe, bounded_wait

__all__ = ["BoundedChannel", "BoundedOptimizer", "EpochComm"]

logger = logging.getLogger(__name__)


@dataclass
class EpochComm:
    """The groups of one membership epoch for one rank, and how long any single wait may last."""

    epoch: int
    members: list[int]
    p2p: EpochGroup
    norm: EpochGroup
    stage: EpochGroup
    probe: FailureProbe
    timeout_s: float

    @classmethod
    def build(cls, store: dist.Store, epoch: int, members: list[int], stage_members: list[int], rank: int,
              timeout_s: float, tag: str = "") -> EpochComm:
        """Build the groups collectively (every member calls it with the same ``epoch``, ``members``, ``tag``).

        ``tag`` makes the store prefixes unique across rebuilds of the same epoch number (e.g. a rejoin).
        """
        prefix = f"e{epoch}{tag}"
        stage_name = f"{prefix}/stage-" + "-".join(str(r) for r in sorted(stage_members))
        p2p = EpochGroup(store, f"{prefix}/p2p", members, rank, timeout_s)
        norm = EpochGroup(store, f"{prefix}/norm", members, rank, timeout_s)
        stage = EpochGroup(store, stage_name, stage_members, rank, timeout_s)
        return cls(epoch, sorted(members), p2p, norm, stage, FailureProbe(store).arm(members), timeout_s)

    def wait(self, work: Any, what: str) -> None:
        bounded_wait(work, self.probe, self.timeout_s, f"epoch {self.epoch}: {what}")


class BoundedChannel(PeerChannel):
    """:class:`PeerChannel` on an epoch's p2p group; receives and send completions are bounded waits."""

    def __init__(self, comm: EpochComm, pipelines: int, microbatches: int) -> None:
        super().__init__(None, pipelines, microbatches)
        self.comm = comm

    def _post(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending.append((self.comm.p2p.send(tensor, peer, tag), tensor))

    def _recv(self, buffer: torch.Tensor, peer: int, tag: int) -> None:
        self.comm.wait(self.comm.p2p.recv(buffer, peer, tag), f"receive tag {tag} from rank {peer}")

    def _recv_parts(self, buffers: Sequence[torch.Tensor], peer: int, tags: Sequence[int]) -> None:
        works = [self.comm.p2p.recv(b, peer, t) for b, t in zip(buffers, tags)]
        for work, tag in zip(works, tags):
            self.comm.wait(work, f"receive tag {tag} from rank {peer}")

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self.comm.wait(work, "send completion")


class BoundedOptimizer(StaggeredOptimizer):
    """:class:`StaggeredOptimizer` whose all-reduce and norm exchange run on an epoch's groups, bounded."""

    comm: EpochComm
    after_reduce: Callable[[], None] | None = None
    """Called after the stage all-reduce, as the optimizer step starts (fault injection)."""

    def attach(self, comm: EpochComm, after_reduce: Callable[[], None] | None = None) -> BoundedOptimizer:
        self.comm = comm
        self.after_reduce = after_reduce
        return self

    def _all_reduce_stage(self, tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.stage.all_reduce_sum(tensor), f"stage {self.stage} gradient all-reduce")

    def step(self, iteration: int, synchronous: bool) -> None:
        if self.after_reduce is not None:
            self.after_reduce()
        super().step(iteration, synchronous)

    def _all_to_all_stage(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.stage.all_to_all(output, tensor), f"stage {self.stage} gradient reduce-scatter")

    def _all_gather_stage(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.stage.all_gather(outputs, tensor), f"stage {self.stage} gradient all-gather")

    def _broadcast_norm(self, tensor: torch.Tensor, src: int) -> Any:
        return self.comm.norm.broadcast(tensor, src)

    def _all_reduce_norm(self, tensor: torch.Tensor) -> Any:
        return self.comm.norm.all_reduce_sum(tensor)

    def _wait(self, work: Any) -> None:
        self.comm.wait(work, "clipping norm exchange")
