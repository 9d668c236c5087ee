"""The engine's transport under failure handling: the gloo groups of one membership epoch, every wait bounded.

:class:`EpochComm` holds the groups of one epoch (every member for activations and gradients, every member
for the clipping norm and the loss, this rank's stage replicas for the gradient reduction, and the live
holders of each weight tied across stages), built over the launcher's store with
:class:`~ds_recycle.resilience.comm.EpochGroup`. :class:`EpochTransport` is the engine's
:class:`~ds_recycle.engine.transport.Transport` on those groups: the same operations in the same order as
``torch.distributed``'s, and each wait is :func:`~ds_recycle.resilience.comm.bounded_wait`, which turns a dead
peer into a :class:`~ds_recycle.resilience.errors.PeerFailure` within milliseconds of the launcher's exit report.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.engine.devices import HOST
from ds_recycle.engine.transport import P2P
from ds_recycle.resilience.comm import Detector, EpochGroup, Group, bounded_wait

__all__ = ["EpochComm", "EpochTransport", "LossRider"]

logger = logging.getLogger(__name__)


@dataclass
class EpochComm:
    """The groups of one membership epoch for one rank, and the detector that bounds every wait on them."""

    epoch: int
    members: list[int]
    p2p: Group
    norm: Group
    stage: Group
    detector: Detector
    timeout_s: float
    """The groups' own timeout: the longest any single wait may last."""
    tied: Mapping[str, Group] = field(default_factory=dict)
    device: torch.device = HOST
    """Where the tensors the groups carry live: the host for gloo (a GPU's are staged), the GPU for NCCL."""

    @classmethod
    def build(cls, store: dist.Store, epoch: int, members: list[int], stage_members: list[int], rank: int,
              timeout_s: float, detector: Detector, tag: str = "",
              tied_members: Mapping[str, list[int]] | None = None) -> EpochComm:
        """Build the groups collectively (every member calls it with the same ``epoch``, ``members``, ``tag``).

        ``tag`` makes the store prefixes unique across rebuilds of the same epoch number (e.g. a rejoin);
        ``tied_members``: the live holders of each tied weight this rank holds, by group name.
        """
        prefix = f"e{epoch}{tag}"
        stage_name = f"{prefix}/stage-" + "-".join(str(r) for r in sorted(stage_members))
        p2p = EpochGroup(store, f"{prefix}/p2p", members, rank, timeout_s)
        norm = EpochGroup(store, f"{prefix}/norm", members, rank, timeout_s)
        stage = EpochGroup(store, stage_name, stage_members, rank, timeout_s)
        tied = {name: EpochGroup(store, f"{prefix}/{name}", holders, rank, timeout_s)
                for name, holders in (tied_members or {}).items()}
        return cls(epoch, sorted(members), p2p, norm, stage, detector, timeout_s, tied)

    @property
    def groups(self) -> list[Group]:
        """Every group of the epoch (the detector breaks them all when it trips)."""
        return [self.p2p, self.norm, self.stage, *self.tied.values()]

    def wait(self, work: Any, what: str) -> None:
        bounded_wait(work, self.detector, f"epoch {self.epoch}: {what}")

    def wait_on_stream(self, work: Any, what: str) -> None:
        """A wait whose result only the device reads (gloo has no streams: :meth:`wait`)."""
        self.wait(work, what)

    def retire(self) -> None:
        """The epoch is over on this worker: gloo groups are left as they are (kept referenced, never destroyed)."""

    @property
    def shrunk_roles(self) -> tuple[str, ...]:
        """The groups this epoch took shrunk from the failed one (NCCL's fast path); gloo builds every group."""
        return ()


class LossRider:
    """A number that rides on each loss broadcast from the reporter (the job's count of join requests), so that
    every member knows the same value at the next iteration boundary without a collective of its own."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self.value: int | None = None
        """The value the last loss broadcast of this epoch carried (None: none yet)."""

    def outgoing(self) -> int:
        """On the reporter: read it now and send it."""
        self.value = self._read()
        return self.value


class EpochTransport:
    """The engine's :class:`~ds_recycle.engine.transport.Transport` on an epoch's groups (see the module docstring)."""

    def __init__(self, comm: EpochComm, rank: int, rider: LossRider | None = None) -> None:
        self.comm = comm
        self.device = comm.device
        """Where what the groups carry lives (the host for gloo, the GPU for NCCL)."""
        self.rank = rank
        self.rider = rider
        self._loss_work: Any = None
        self._loss_message: tuple[torch.Tensor, torch.Tensor] | None = None

    def isend(self, tensor: torch.Tensor, peer: int) -> Any:
        return self.comm.p2p.send(tensor, peer)

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, what: str) -> None:
        works = [self.comm.p2p.recv(b, peer) for b in buffers]
        for work in works:
            self.comm.wait(work, f"receive {what} from rank {peer}")

    def post_p2p(self, ops: Sequence[P2P]) -> list[Any]:
        return self.comm.p2p.post_p2p(ops)

    def stage_all_reduce(self, tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.stage.all_reduce_sum(tensor), "stage gradient all-reduce")

    def stage_all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.stage.all_to_all(output, tensor), "stage gradient reduce-scatter")

    def stage_all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.stage.all_gather(outputs, tensor), "stage gradient all-gather")

    def post_broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        return self.comm.norm.broadcast(tensor, src)

    def post_all_reduce(self, tensor: torch.Tensor) -> Any:
        return self.comm.norm.all_reduce_sum(tensor)

    def wait(self, work: Any, what: str) -> None:
        self.comm.wait(work, what)

    def wait_on_stream(self, work: Any, what: str) -> None:
        self.comm.wait_on_stream(work, what)

    def all_reduce_members(self, tensor: torch.Tensor, what: str) -> None:
        self.comm.wait(self.comm.norm.all_reduce_sum(tensor), what)

    def barrier(self, what: str) -> None:
        self.all_reduce_members(torch.zeros(1, device=self.device), what)

    def tied_all_reduce(self, name: str, tensor: torch.Tensor) -> None:
        self.comm.wait(self.comm.tied[name].all_reduce_sum(tensor), "tied gradients")

    def share_loss(self, value: torch.Tensor, src: int) -> None:
        """The loss, with the rider's value beside it, in one broadcast of two float64s over every member."""
        self.flush()
        message = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.rank == src:
            message[0] = value.double()
            message[1] = float(self.rider.outgoing()) if self.rider is not None else 0.0
        work = self.comm.norm.broadcast(message, src)
        if self.rank == src:
            self._loss_work = work
            return
        self.comm.wait(work, "loss broadcast")
        value.copy_(message[0].to(value.dtype))
        if self.rider is not None:
            self.rider.value = int(message[1])

    def flush(self) -> None:
        work, self._loss_work = self._loss_work, None
        if work is not None:
            self.comm.wait(work, "loss broadcast")
