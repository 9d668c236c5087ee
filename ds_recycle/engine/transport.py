"""The engine's one communication seam: every transfer and collective the engine makes goes through a
:class:`Transport`.

The engine, its :class:`~ds_recycle.engine.p2p.PeerChannel` and its
:class:`~ds_recycle.engine.optimizer.StaggeredOptimizer` address peers by global rank and name the group
by its role (the stage's live replicas, every member, the holders of a tied weight); the transport decides
how. :class:`DistTransport` is ``torch.distributed`` on the groups of a
:class:`~ds_recycle.runtime.grid.SurvivorGrid` (no failure handling: under ``torchrun`` and ``deepspeed``);
the failure handler installs its own per membership epoch, whose waits a dead peer cannot hang
(:class:`ds_recycle.resilience.transport.EpochTransport`).

Point-to-point messages carry no tags: between two ranks they match in the order they were posted, as NCCL
matches them (NCCL ignores tags). The engine posts each pair's sends and receives in one order
(:func:`ds_recycle.engine.nccl_check.check_order` proves it for a plan without running it), so every CPU run
exercises the ordering a GPU run needs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ds_recycle.engine.devices import HOST, host_buffer, host_copy, staged

__all__ = ["DistTransport", "P2P", "Transport"]

P2P = tuple[bool, torch.Tensor, int]
"""A point-to-point operation to post: (is a send, tensor, peer's global rank)."""


class Transport(Protocol):
    """How the engine communicates (see the module docstring). Blocking calls return when done; ``post_*``
    calls return a work for :meth:`wait`."""

    @property
    def device(self) -> torch.device:
        """Where the tensors this transport carries live (the host for gloo, the rank's GPU for NCCL): the engine
        makes its control messages there (:mod:`ds_recycle.engine.devices`)."""
        ...

    # point to point, by global rank, matched per pair in posting order (no tags: NCCL's discipline)
    def isend(self, tensor: torch.Tensor, peer: int) -> Any:
        """Post a send; the work completes once ``peer`` received it."""
        ...

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, what: str) -> None:
        """Receive the next ``len(buffers)`` messages from ``peer`` into ``buffers`` (all posted first, then waited
        for); ``what`` names them in errors."""
        ...

    def post_p2p(self, ops: Sequence[P2P]) -> list[Any]:
        """Post sends and receives together (one NCCL group), in order; their works for :meth:`wait`, in order."""
        ...

    # the stage's live replicas
    def stage_all_reduce(self, tensor: torch.Tensor) -> None:
        """SUM ``tensor`` in place over the stage's live replicas."""
        ...

    def stage_all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Replica ``j`` (in rank order) receives the ``j``-th equal slice of every replica's ``tensor``."""
        ...

    def stage_all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every replica's ``tensor`` into ``outputs``, in rank order."""
        ...

    # every member of the job
    def post_broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        """Post a broadcast from global rank ``src`` over every member."""
        ...

    def post_all_reduce(self, tensor: torch.Tensor) -> Any:
        """Post a SUM all-reduce over every member."""
        ...

    def wait(self, work: Any, what: str) -> None:
        """Wait for a posted operation (``what`` names it in errors)."""
        ...

    def wait_on_stream(self, work: Any, what: str) -> None:
        """Make the device's current stream wait for a posted operation whose result only the device reads (a
        received activation or gradient): on NCCL the host goes on; gloo has no streams and waits."""
        ...

    def all_reduce_members(self, tensor: torch.Tensor, what: str) -> None:
        """SUM ``tensor`` in place over every member (blocking)."""
        ...

    def barrier(self, what: str) -> None:
        """Return once every member called it."""
        ...

    def tied_all_reduce(self, name: str, tensor: torch.Tensor) -> None:
        """SUM ``tensor`` in place over the live holders of tied weight ``name``."""
        ...

    def share_loss(self, value: torch.Tensor, src: int) -> None:
        """The iteration's loss from ``src`` to every member, in place: ``src`` posts it and goes on (its send
        completes by :meth:`flush`), the others wait for it."""
        ...

    def flush(self) -> None:
        """Complete what this rank posted and did not wait for (the last loss broadcast)."""
        ...


class DistTransport:
    """:class:`Transport` over ``torch.distributed`` on a grid's groups (see the module docstring)."""

    def __init__(self, p2p_group: Any = None, stage_group: Any = None, norm_group: Any = None, world_group: Any = None,
                 tied_group: Callable[[str], Any] | None = None) -> None:
        """Each group as ``torch.distributed`` takes it (None: the default group)."""
        self.p2p_group = p2p_group
        self.stage_group = stage_group
        self.norm_group = norm_group
        self.world_group = world_group
        self._tied_group = tied_group
        self._loss_work: Any = None

    @classmethod
    def of_grid(cls, grid: Any, tied_group: Callable[[str], Any] | None = None) -> DistTransport:
        """On a :class:`~ds_recycle.runtime.grid.SurvivorGrid`'s groups; ``tied_group(name)``: a tied weight's."""
        return cls(grid.p2p_group, grid.get_data_parallel_group(), grid.norm_group, grid.world_proc_group, tied_group)

    @functools.cached_property
    def device(self) -> torch.device:
        """The host on gloo; this rank's current GPU on NCCL (asked of the point-to-point group's backend)."""
        if dist.get_backend(self.p2p_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return HOST

    # gloo's send, receive, all-to-all and all-gather take host tensors only: a GPU's are staged (engine.devices)
    def _in(self, tensor: torch.Tensor) -> torch.Tensor:
        return host_copy(tensor) if self.device == HOST else tensor

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return host_buffer(tensor) if self.device == HOST else tensor

    def isend(self, tensor: torch.Tensor, peer: int) -> Any:
        host = self._in(tensor)
        return staged(dist.isend(host, dst=peer, group=self.p2p_group), inputs=[(tensor, host)])

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, what: str) -> None:
        hosts = [self._out(b) for b in buffers]
        works = [staged(dist.irecv(h, src=peer, group=self.p2p_group), outputs=[(b, h)]) for b, h in zip(buffers, hosts)]
        for work in works:
            if work is not None:  # None only on a rank outside the group, which cannot be a peer
                work.wait()

    def post_p2p(self, ops: Sequence[P2P]) -> list[Any]:
        if self.device != HOST and ops:  # NCCL: one group
            return list(dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer,
                                                           group=self.p2p_group) for send, t, peer in ops]))
        works = []
        for send, tensor, peer in ops:
            if send:
                works.append(self.isend(tensor, peer))
            else:
                host = self._out(tensor)
                works.append(staged(dist.irecv(host, src=peer, group=self.p2p_group), outputs=[(tensor, host)]))
        return works

    def stage_all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.stage_group)

    def stage_all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        host_out = self._out(output)
        staged(dist.all_to_all_single(host_out, self._in(tensor), group=self.stage_group, async_op=True),
               outputs=[(output, host_out)]).wait()

    def stage_all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        hosts = [self._out(o) for o in outputs]
        staged(dist.all_gather(hosts, self._in(tensor), group=self.stage_group, async_op=True),
               outputs=list(zip(outputs, hosts))).wait()

    def post_broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        return dist.broadcast(tensor, src=src, group=self.norm_group, async_op=True)

    def post_all_reduce(self, tensor: torch.Tensor) -> Any:
        return dist.all_reduce(tensor, group=self.norm_group, async_op=True)

    def wait(self, work: Any, what: str) -> None:
        work.wait()

    def wait_on_stream(self, work: Any, what: str) -> None:
        work.wait()  # NCCL: the current stream waits, the host goes on; gloo: the host waits

    def tied_all_reduce(self, name: str, tensor: torch.Tensor) -> None:
        if self._tied_group is None:
            raise RuntimeError(f"no group for the tied weight {name}")
        dist.all_reduce(tensor, group=self._tied_group(name))

    def share_loss(self, value: torch.Tensor, src: int) -> None:
        self.flush()
        work = dist.broadcast(value, src, group=self.world_group, async_op=True)
        if dist.get_rank() == src:
            self._loss_work = work
        else:
            work.wait()

    def flush(self) -> None:
        work, self._loss_work = self._loss_work, None
        if work is not None:
            work.wait()

    def all_reduce_members(self, tensor: torch.Tensor, what: str) -> None:
        dist.all_reduce(tensor, group=self.world_group)

    def barrier(self, what: str) -> None:
        dist.barrier(group=self.world_group)
