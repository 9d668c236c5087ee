"""Process groups that a dead peer cannot hang: one gloo group per membership epoch, bounded waits.

After a failure, every group that contained the dead rank is poisoned (gloo peers of the dead rank
error out, the others block until the group's timeout). So ds_recycle never reuses a group across a
membership change: each epoch builds fresh gloo groups over a prefix of the launcher's store, with
ranks renumbered among the members, and abandons the old ones (kept referenced, never destroyed, so
that no destructor waits on a blocked gloo thread).

Every wait is :func:`bounded_wait`: the training thread blocks in gloo's own ``wait()``, bounded by the
group's timeout; when the worker's failure detector (:class:`~ds_recycle.resilience.watchdog.Watchdog`)
declares a member exited or hung it breaks the epoch's groups (:meth:`EpochGroup.break_links`), and the
blocked wait raises :class:`~ds_recycle.resilience.errors.PeerFailure` at once (within about a millisecond
of a launcher's exit report, within ``heartbeat_stale_s`` of a hung member's last heartbeat).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ds_recycle.engine.devices import HOST, host_buffer, host_copy, staged
from ds_recycle.engine.transport import P2P
from ds_recycle.resilience.device_errors import sticky_device_error
from ds_recycle.resilience.errors import PeerFailure

logger = logging.getLogger(__name__)

__all__ = ["Addressed", "Detector", "EpochGroup", "Group", "Work", "allreduce_options", "bounded_wait"]


_BREAK_TAG = 2**31 - 1
"""The tag of :meth:`EpochGroup.break_links`'s receive: no message ever carries it."""


class Work(Protocol):
    """What gloo returns for an asynchronous operation."""

    def wait(self, timeout: timedelta = ...) -> bool: ...


class Detector(Protocol):
    """The worker's failure detector, as a wait sees it (:class:`~ds_recycle.resilience.watchdog.Watchdog`)."""

    def failed(self) -> bool:
        """A member of the current epoch is known dead."""
        ...

    def tripped(self) -> bool:
        """The detector declared a failure (and broke the epoch's groups)."""
        ...

    def reason(self) -> str:
        """Why it tripped, in words."""
        ...


class Group(Protocol):
    """One group of a membership epoch, addressed by global rank: :class:`EpochGroup` (gloo) or
    :class:`~ds_recycle.resilience.nccl.NcclGroup`."""

    members: list[int]
    name: str

    def break_links(self) -> None: ...
    def post_p2p(self, ops: Sequence[P2P]) -> list[Work]: ...
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work: ...
    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work: ...
    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Work: ...
    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Work: ...
    def all_reduce_sum(self, tensor: torch.Tensor) -> Work: ...
    def all_reduce_max(self, tensor: torch.Tensor) -> Work: ...


def bounded_wait(work: Work, detector: Detector, what: str) -> None:
    """Wait for ``work``; raise :class:`PeerFailure` when a member failed or the group's timeout passed.

    The training thread blocks in gloo's own ``wait()`` (no thread hand-off, no polling), bounded by the group's
    timeout; the detector's trip breaks the epoch's groups (:meth:`EpochGroup.break_links`), which makes the
    wait raise at once.
    """
    if detector.failed():
        raise PeerFailure(f"{what}: {detector.reason()} before waiting")
    try:
        work.wait()
    except RuntimeError as e:  # a broken group, the dead pair's error, or the group's timeout
        if sticky_device_error(e):  # this worker's own GPU failed (host staging): not a peer's failure
            raise
        cause = detector.reason() if detector.tripped() else str(e)
        raise PeerFailure(f"{what}: {cause}") from e


class Addressed:
    """What every group of an epoch shares: its members (global ranks) and their numbering in the group, and the
    SUM and MAX all-reduces over the group's own ``_all_reduce``."""

    def __init__(self, name: str, members: Sequence[int], rank: int) -> None:
        self.members = sorted(members)
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not a member of group {name} {self.members}")
        self.name = name
        self.index = {r: i for i, r in enumerate(self.members)}
        self.index_of_self = self.index[rank]

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> Work:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> Work:
        raise NotImplementedError

    @contextlib.contextmanager
    def _posting(self, what: str) -> Iterator[None]:
        """An operation that cannot even be posted is a :class:`PeerFailure` (gloo refuses to post on a pair whose
        peer died; NCCL on a communicator aborted already), but for a sticky CUDA error: this worker's own GPU failed
        (host staging, or NCCL on it), not a peer."""
        try:
            yield
        except RuntimeError as e:
            if sticky_device_error(e):
                raise
            raise PeerFailure(f"group {self.name}: {what}: {e}") from e


def allreduce_options(op: Any) -> dist.AllreduceOptions:
    """torch's options for an all-reduce with ``op``."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


class EpochGroup(Addressed):
    """A gloo group over ``members`` (global ranks) for one membership epoch, with global-rank addressing.

    Whoever replaces a group keeps a reference to the old one until the job ends: destroying a gloo
    group closes its connections, which members still blocked in it would take for a new failure.
    """

    def __init__(self, store: dist.Store, name: str, members: Sequence[int], rank: int, timeout_s: float) -> None:
        super().__init__(name, members, rank)
        self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"ds_recycle/pg/{name}/", store), self.index[rank],
                                             len(self.members), timedelta(seconds=timeout_s))
        """The gloo group (typed Any: torch's stubs for ProcessGroupGloo lack its collectives)."""

    def break_links(self) -> None:
        """Fail every pending and later operation of this group at once, here and at its members (the watchdog's
        answer to a trip: the epoch is over, and a wait blocked in gloo must not sit out the group's timeout).

        Gloo has no abort for a pending send or receive, but an operation whose wait expires closes every pair
        of the group's context; so a receive that nobody sends is posted and given a millisecond: from any
        source, or else from each member in turn (posting on the pair of a dead member fails at once).
        """
        if len(self.members) < 2:
            return  # nothing of a group of one ever waits on a peer
        sources: list[int | None] = [None, *(i for i in range(len(self.members)) if i != self.index_of_self)]
        for source in sources:
            try:
                sink = [torch.zeros(1, device=HOST)]  # a gloo group's own receive, never matched
                work = (self.pg.recv_anysource(sink, _BREAK_TAG) if source is None
                        else self.pg.recv(sink, source, _BREAK_TAG))
            except RuntimeError:
                continue
            try:
                work.wait(timedelta(milliseconds=1))
            except RuntimeError:
                return  # expired: the context closed its pairs

    # Every operation takes tensors on any device: a GPU's are staged through the host (engine.devices.staged).
    def post_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        """Post sends and receives, in order (gloo has no groups: each its own operation)."""
        return [self.send(t, peer) if send else self.recv(t, peer) for send, t, peer in ops]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        host = host_copy(tensor)
        with self._posting(f"send to rank {dst}"):
            return staged(self.pg.send([host], self.index[dst], tag), inputs=[(tensor, host)])

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        host = host_buffer(tensor)
        with self._posting(f"receive from rank {src}"):
            return staged(self.pg.recv([host], self.index[src], tag), outputs=[(tensor, host)])

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.index[src]
        opts.rootTensor = 0
        host = host_copy(tensor)
        with self._posting(f"broadcast from rank {src}"):
            return staged(self.pg.broadcast([host], opts), outputs=[(tensor, host)])

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        """Member ``j`` (in rank order) receives the ``j``-th equal slice of every member's ``tensor``."""
        host_in, host_out = host_copy(tensor), host_buffer(output)
        with self._posting("all-to-all"):
            return staged(self.pg.alltoall_base(host_out, host_in, [], [], dist.AllToAllOptions()),
                          outputs=[(output, host_out)], inputs=[(tensor, host_in)])

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Work:
        """Every member's ``tensor`` into ``outputs``, in rank order."""
        host_in, host_outs = host_copy(tensor), [host_buffer(o) for o in outputs]
        with self._posting("all-gather"):
            return staged(self.pg.allgather([host_outs], [host_in]), outputs=list(zip(outputs, host_outs)),
                          inputs=[(tensor, host_in)])

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> Work:
        host = host_copy(tensor)
        with self._posting("all-reduce"):
            return staged(self.pg.allreduce([host], allreduce_options(op)), outputs=[(tensor, host)])

