"""NCCL groups of one membership epoch (``recycle.transport: "nccl"``): built per epoch, left behind by an abort.

The same shape as the gloo groups (:mod:`ds_recycle.resilience.comm`), with what NCCL needs instead:

- **Building.** Each group is its own NCCL communicator over its members, built outside ``torch.distributed``'s
  registry (``dist.new_group`` would split WORLD, which a dead member is part of): a ``ProcessGroupNCCL`` over a
  store prefix fresh for every epoch and rebuild, nonblocking (``config.blocking = 0``, NCCL's precondition for
  an abort that cannot hang on a dead peer), connected eagerly on the worker's GPU, inside an unregistered
  ``ProcessGroup`` so that a step's sends and receives can be posted as one NCCL group (``_start_coalescing`` /
  ``_end_coalescing``, what ``batch_isend_irecv`` does). The build is bounded like gloo's (``run_guarded``).
- **Waiting.** NCCL reports no error when a peer in the same node dies: its operations spin. A received activation
  or gradient, which only the GPU reads, is waited for on the stream (``Work.wait`` makes the current stream wait,
  the host goes on: no CPU poll per transfer); every :data:`RUN_AHEAD` such waits the host polls a CUDA event
  recorded on the stream, between looks at the failure detector, so it never runs far ahead of a stream stuck
  behind a dead peer. A wait whose result the host reads (a norm, a loss, a size) polls the work's completion the
  same way (``Work.is_completed``, a CUDA event query), bounded by the group's timeout. So the main thread does not
  sit in a CUDA call behind a dead peer, and the failure handler aborts from it. As a last resort (the main thread
  blocked in CUDA anyway, e.g. in the model's own host synchronisation), the watchdog's trip aborts the epoch from
  its thread after :data:`BACKSTOP_S` if the main thread has not.
- **Leaving an epoch.** :meth:`NcclEpochComm.retire` aborts every communicator of the epoch inside one NCCL group
  (``ncclGroupStart``, ``ncclCommAbort`` on each, ``ncclGroupEnd``: aborted one by one they can deadlock), on a
  thread with a deadline. Nothing is destroyed or finalized: those are collective and would wait for the dead
  member. An abort that does not return makes the worker leave as lost (the launcher restarts it; it rejoins).
  Every survivor retires the failed epoch before it builds the next (NCCL requires every rank of a communicator
  with a failed member to abort it), and after a rejoin's regroup the old epoch too; a job that ends retires its
  last epoch the same way (an abort needs no peer; a destroy would be collective).
- **Shrinking instead of building** (``recycle.nccl_shrink``, where the NCCL build has ``ncclCommShrink``, 2.27+).
  After a failure that only removes members, the next epoch's communicators are the failed epoch's with the lost
  ranks cut out, not new ones: the survivors keep the failed epoch (:meth:`NcclEpochComm.hold`) until they agree
  who is lost. Each then tells the others through the store that it still has the epoch (from then on its backstop
  cannot abort it); only if all do, each shrinks every communicator that lost a member (``SHRINK_ABORT``: its
  pending operations are aborted first, only the survivors call it) in one order on every rank (p2p, norm, stage,
  tied by name), and aborts the parents together (:meth:`NcclEpochComm.shrink`). The survivors then tell each
  other whether every shrink worked; only if all did is the next epoch built from the shrunk communicators,
  otherwise they are aborted and every group is built afresh (:func:`ds_recycle.resilience.phases.shrink_failed`).
  Communicators that lost no member are built afresh either way. While the failed epoch is kept, the watchdog's backstop waits
  :data:`SHRINK_WINDOW_S` rather than :data:`BACKSTOP_S`, so a training thread stuck in CUDA behind a dead peer is
  still released.

Sources: NCCL's user guide (``usage/communicators.rst``: abort needs nonblocking communicators, every surviving rank
aborts; ``api/comms.rst``), pytorch#119797 and NCCL#1013 (aborting communicators one by one can deadlock), NCCL#279
(no error for a peer that dies inside a node), torch 2.13's ``_abort_process_group`` (the group abort) and torchft's
``ProcessGroupNCCL`` (an unregistered, nonblocking, eagerly connected communicator per configuration); for the
shrink, NCCL's ``api/comms.rst`` (``ncclCommShrink``: called by the survivors only; ``NCCL_SHRINK_ABORT``) and torch
2.13's ``Backend.shrink`` (not ``dist.shrink_group``, which destroys the parent, a collective with the dead rank).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ds_recycle.engine.transport import P2P
from ds_recycle.resilience.comm import Addressed, Detector, Work, allreduce_options
from ds_recycle.resilience.device_errors import sticky_device_error
from ds_recycle.resilience.errors import PeerFailure
from ds_recycle.resilience.transport import EpochComm

__all__ = ["ABORT_DEADLINE_S", "NcclEpochComm", "NcclGroup", "ShrunkGroups", "abort_together", "epoch_device",
           "nccl_device", "polled_wait"]

logger = logging.getLogger(__name__)

ABORT_DEADLINE_S = 30.0
"""How long the abort of an epoch's communicators may take before the worker leaves as lost."""
RUN_AHEAD = 8
"""Stream waits the host may run ahead of the stream before it polls where the stream is."""
BACKSTOP_S = 2.0
"""After the watchdog's trip, how long the main thread has to abort the epoch before the watchdog's thread does."""
SHRINK_WINDOW_S = 10.0
"""How long a failed epoch is kept for the survivors to agree and shrink it before the backstop aborts it."""
SHRINK_ABORT = 1
"""``ncclCommShrink``'s flag that aborts the parent's pending operations first (torch's ``dist.SHRINK_ABORT``)."""

Connect = Callable[[dist.Store, int, int, float, torch.device], tuple[Any, Any]]
"""``(store, index, size, timeout_s, device) -> (backend, process group)``: how a communicator is made."""


def nccl_device(device: torch.device, sharing: int) -> torch.device:
    """The GPU the NCCL transport uses for a worker on ``device`` whose node puts ``sharing`` workers on each GPU;
    raises :class:`~ds_recycle.config.errors.ConfigError` where it cannot run (NCCL needs one GPU per rank)."""
    from ds_recycle.config.errors import ConfigError

    fix = ('use "auto" (gloo where NCCL cannot run, CUDA tensors staged through host memory), or give every worker a '
           "GPU of its own")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError("recycle.transport", f'"nccl" on a worker whose device is {device}', fix)
    if not dist.is_nccl_available():
        raise ConfigError("recycle.transport", '"nccl" with a torch built without NCCL', fix)
    if sharing > 1:
        raise ConfigError("recycle.transport", f'"nccl" with {sharing} workers on each GPU of this node (NCCL needs '
                          "one GPU per rank)", fix)
    return device


def epoch_device(transport: str, device: torch.device, sharing: int) -> torch.device | None:
    """The GPU whose NCCL communicators the epochs use for ``recycle.transport`` on a worker on ``device`` whose node
    puts ``sharing`` workers on each GPU; None: gloo groups (on GPUs, tensors staged through host memory).

    ``"auto"`` takes NCCL where it can run (a GPU of its own for every worker, a torch with NCCL), gloo elsewhere;
    ``"nccl"`` is refused where it cannot run (:func:`nccl_device`); ``"gloo"`` is gloo everywhere."""
    if transport == "nccl":
        return nccl_device(device, sharing)
    if (transport == "auto" and device.type == "cuda" and sharing == 1 and torch.cuda.is_available()
            and dist.is_nccl_available()):
        return device
    return None


def connect_nccl(store: dist.Store, index: int, size: int, timeout_s: float, device: torch.device) -> tuple[Any, Any]:
    """A nonblocking NCCL communicator of ``size`` ranks (this one ``index``) over ``store``, connected on ``device``,
    inside an unregistered ``ProcessGroup``: ``(backend, process group)``."""
    # a nonblocking communicator's init and abort are polled by torch for this long (30 minutes by default)
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout_s))))
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    opts._timeout = timedelta(seconds=timeout_s)
    backend = dist.ProcessGroupNCCL(store, index, size, opts)
    pg = _wrapped(backend, store)
    backend.eager_connect_single_device(device)
    return backend, pg


def shrink_nccl(backend: Any, store: dist.Store, excluded: Sequence[int]) -> tuple[Any, Any]:
    """``backend``'s communicator without its members ``excluded`` (their indices in it; every other member calls
    this with the same list), its pending operations aborted first: ``(backend, process group)`` of the child."""
    child = backend.shrink(list(excluded), SHRINK_ABORT, None)
    return child, _wrapped(child, dist.PrefixStore("shrunk/", store))


def _wrapped(backend: Any, store: dist.Store) -> Any:
    """An unregistered ``ProcessGroup`` whose CUDA backend is the NCCL ``backend`` (for coalesced sends and receives)."""
    pg = dist.ProcessGroup(store, backend.rank(), backend.size())
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    return pg


class Pollable(Protocol):
    """An NCCL work (or a CUDA event) as a polled wait sees it."""

    def is_completed(self) -> bool: ...
    def wait(self) -> Any: ...


def polled_wait(work: Pollable, detector: Detector, what: str, timeout_s: float, poll_s: float = 2e-4) -> None:
    """Wait for an NCCL ``work`` without blocking in NCCL or CUDA (see the module docstring): poll its completion,
    raise :class:`PeerFailure` once the detector knows a member dead or after ``timeout_s``; then make the current
    stream wait for it (a sticky CUDA error is raised as it is: this worker's GPU failed, not a peer)."""
    if detector.failed():
        raise PeerFailure(f"{what}: {detector.reason()} before waiting")
    deadline = time.monotonic() + timeout_s
    pause = poll_s
    while not work.is_completed():
        if detector.failed():
            raise PeerFailure(f"{what}: {detector.reason()}")
        if time.monotonic() > deadline:
            raise PeerFailure(f"{what}: not complete after {timeout_s:.0f} s (recycle.failure_timeout_s)")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    _waited(work, what)


def _waited(work: Pollable, what: str) -> None:
    """``work.wait()``: on NCCL the current stream waits for it; its error is a :class:`PeerFailure`, but for a sticky
    CUDA error, raised as it is (this worker's GPU failed, not a peer)."""
    try:
        work.wait()
    except RuntimeError as e:
        if sticky_device_error(e):
            raise
        raise PeerFailure(f"{what}: {e}") from e


class NcclGroup(Addressed):
    """An NCCL communicator over ``members`` (global ranks) for one membership epoch, with global-rank addressing:
    the operations of :class:`~ds_recycle.resilience.comm.EpochGroup`, on the worker's GPU (no staging)."""

    def __init__(self, store: dist.Store, name: str, members: Sequence[int], rank: int, timeout_s: float,
                 device: torch.device, connect: Connect | None = None) -> None:
        """``connect``: how the communicator is made (None: :func:`connect_nccl`)."""
        super().__init__(name, members, rank)
        self.device = device
        self.store = dist.PrefixStore(f"ds_recycle/nccl/{name}/", store)
        self.backend, self.pg = (connect or connect_nccl)(self.store, self.index[rank], len(self.members), timeout_s,
                                                          device)

    on_break: Callable[[], None] | None = None
    """What the watchdog's trip does (set by the epoch: its backstop, :meth:`NcclEpochComm.backstop`)."""

    def break_links(self) -> None:
        """The watchdog tripped: waits poll the detector and the training thread aborts the epoch as a whole; the
        epoch's backstop aborts it from here if that does not happen in time."""
        if self.on_break is not None:
            self.on_break()

    def post_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        """Post sends and receives together, as one NCCL group; every one's work is the group's."""
        if not ops:
            return []
        with self._posting(f"{len(ops)} transfers"):
            self.pg._start_coalescing(self.device)
            try:
                for send, tensor, peer in ops:
                    (self.pg.send if send else self.pg.recv)([tensor], self.index[peer], 0)
            finally:
                work = self.pg._end_coalescing(self.device)
        return [work] * len(ops)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self.post_p2p([(True, tensor, dst)])[0]

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self.post_p2p([(False, tensor, src)])[0]

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.index[src]
        opts.rootTensor = 0
        with self._posting(f"broadcast from rank {src}"):
            return self.pg.broadcast([tensor], opts)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        with self._posting("all-to-all"):
            return self.pg.alltoall_base(output, tensor, [], [], dist.AllToAllOptions())

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Work:
        with self._posting("all-gather"):
            return self.pg.allgather([outputs], [tensor])

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> Work:
        with self._posting("all-reduce"):
            return self.pg.allreduce([tensor], allreduce_options(op))


def _leave_as_lost(why: str) -> None:
    """The worker cannot go on in this process: it exits with the launcher's *lost* code (it comes back)."""
    from ds_recycle.resilience.checkpoint import LOST_EXIT_CODE

    sys.stderr.write(f"ds_recycle: {why}; leaving as lost (exit {LOST_EXIT_CODE}) for the launcher to restart this "
                     "worker and the job to take it back\n")
    sys.stderr.flush()
    os._exit(LOST_EXIT_CODE)


def abort_together(backends: Sequence[Any], deadline_s: float = ABORT_DEADLINE_S,
                   on_hang: Callable[[str], None] = _leave_as_lost) -> float:
    """Abort every communicator of ``backends`` inside one NCCL group, on a thread; returns the seconds it took.
    If it does not return within ``deadline_s``, ``on_hang`` is told why (by default the worker leaves as lost)."""
    started = time.monotonic()
    failure: list[BaseException] = []

    def abort() -> None:
        try:
            backends[0]._group_start()
            try:
                for backend in backends:
                    backend.abort()
            finally:
                backends[0]._group_end()
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
            failure.append(e)

    if backends:
        thread = threading.Thread(target=abort, name="ds-recycle-nccl-abort", daemon=True)
        thread.start()
        thread.join(deadline_s)
        if thread.is_alive():
            on_hang(f"aborting {len(backends)} NCCL communicators did not return within {deadline_s:.0f} s")
        elif failure:
            logger.warning("aborting the NCCL communicators raised %r (they are left behind)", failure[0])
    return time.monotonic() - started


@dataclass
class NcclEpochComm(EpochComm):
    """An :class:`~ds_recycle.resilience.transport.EpochComm` whose groups are NCCL communicators on ``device``
    (see the module docstring)."""

    abort_deadline_s: float = ABORT_DEADLINE_S
    retired_in_s: float | None = field(default=None, init=False)
    """How long :meth:`retire` took (None: not retired)."""

    @classmethod
    def build_nccl(cls, store: dist.Store, epoch: int, members: list[int], stage_members: list[int], rank: int,
                   timeout_s: float, detector: Detector, device: torch.device, tag: str = "",
                   tied_members: Mapping[str, list[int]] | None = None,
                   connect: Connect | None = None, shrunk: ShrunkGroups | None = None) -> NcclEpochComm:
        """Build the epoch's communicators collectively, as :meth:`EpochComm.build` builds gloo groups (the same
        arguments, and the GPU they live on); ``shrunk``: communicators shrunk from the failed epoch that every
        member agreed to take (:meth:`shrink`), used where one has a group's role and members."""
        prefix = f"e{epoch}{tag}"
        stage_name = f"{prefix}/stage-" + "-".join(str(r) for r in sorted(stage_members))
        taken: list[str] = []

        def group(role: str, name: str, ranks: Sequence[int]) -> NcclGroup:
            pair = shrunk.take(role, ranks) if shrunk is not None else None
            if pair is None:
                return NcclGroup(store, name, ranks, rank, timeout_s, device, connect)
            taken.append(role)
            return NcclGroup(store, name, ranks, rank, timeout_s, device, lambda *_: pair)
        p2p = group("p2p", f"{prefix}/p2p", members)
        norm = group("norm", f"{prefix}/norm", members)
        stage = group("stage", stage_name, stage_members)
        tied = {name: group(name, f"{prefix}/{name}", holders) for name, holders in sorted((tied_members or {}).items())}
        if shrunk is not None:
            shrunk.discard()  # any it holds that no group took
        comm = cls(epoch, sorted(members), p2p, norm, stage, detector, timeout_s, tied, device)
        comm._shrunk_roles = tuple(taken)
        return comm

    def roles(self) -> list[tuple[str, NcclGroup]]:
        """The communicators by role, in the one order every rank shrinks them in (p2p, norm, stage, tied by name)."""
        tied = sorted(self.tied.items())
        return [("p2p", self.p2p), ("norm", self.norm), ("stage", self.stage), *tied]  # type: ignore[list-item]

    def __post_init__(self) -> None:
        self._shrunk_roles: tuple[str, ...] = ()
        self._retire_lock = threading.Lock()
        self._stream_waits = 0
        self._backstop: threading.Timer | None = None
        for group in self.groups:
            group.on_break = self.backstop  # type: ignore[attr-defined]

    def wait(self, work: Any, what: str) -> None:
        polled_wait(work, self.detector, f"epoch {self.epoch}: {what}", self.timeout_s)

    def wait_on_stream(self, work: Any, what: str) -> None:
        """The current stream waits for ``work``; every :data:`RUN_AHEAD` of these the host polls the stream."""
        _waited(work, f"epoch {self.epoch}: {what}")
        self._stream_waits += 1
        if self._stream_waits >= RUN_AHEAD:
            self._stream_waits = 0
            event = torch.cuda.Event()
            event.record()
            polled_wait(_EventWork(event), self.detector, f"epoch {self.epoch}: the stream, at {what}",
                        self.timeout_s)

    def backstop(self) -> None:
        """The watchdog tripped: abort the epoch from a timer thread unless the training thread retires it within
        :data:`BACKSTOP_S` (it normally does, at its next wait)."""
        with self._retire_lock:
            if self.retired_in_s is not None or self._backstop is not None:
                return  # retired, or kept for a shrink (its own, longer, backstop)
            self._backstop = threading.Timer(BACKSTOP_S, self.retire)
            self._backstop.daemon = True
            self._backstop.start()

    def retire(self) -> None:
        """Abort every communicator of the epoch at once (idempotent, from any thread; see the module docstring)."""
        with self._retire_lock:
            if self.retired_in_s is not None:
                return
            self._cancel_backstop()
            self.retired_in_s = abort_together([g.backend for g in self.groups],  # type: ignore[attr-defined]
                                               self.abort_deadline_s)
        logger.info("epoch %d: %d NCCL communicators aborted in %.3f s", self.epoch, len(self.groups),
                    self.retired_in_s)

    @property
    def shrunk_roles(self) -> tuple[str, ...]:
        """The roles whose communicators this epoch took shrunk from the failed one (the rest were built)."""
        return self._shrunk_roles

    def _cancel_backstop(self) -> None:
        if self._backstop is not None:
            self._backstop.cancel()

    @property
    def shrinkable(self) -> bool:
        """Every communicator of the epoch can be shrunk (torch's ``supports_shrinking``: NCCL 2.27 or later)."""
        return all(getattr(g.backend, "supports_shrinking", False) is True  # type: ignore[attr-defined]
                   for g in self.groups)

    def hold(self) -> bool:
        """The epoch failed: keep it for :meth:`shrink` where it can be shrunk, else retire it now. Returns whether
        it is kept; a kept epoch is still aborted by the backstop :data:`SHRINK_WINDOW_S` from now."""
        if not self.shrinkable:
            self.retire()
            return False
        with self._retire_lock:
            if self.retired_in_s is not None:
                return False
            self._cancel_backstop()
            self._backstop = threading.Timer(SHRINK_WINDOW_S, self.retire)
            self._backstop.daemon = True
            self._backstop.start()
        return True

    def shrink(self, lost: Collection[int], all_kept: Callable[[bool], bool] | None = None) -> ShrunkGroups | None:
        """The members agreed that ``lost`` are gone: shrink every communicator that lost a member and keeps two
        (see the module docstring), then abort every communicator of the epoch together. Returns the children, or
        None where the epoch was retired already or a shrink failed (then the children made are aborted too).

        ``all_kept(kept)`` tells the other members whether this one still has the epoch (its backstop can no longer
        abort it then) and answers whether every member does: a shrink is collective, so none starts one unless
        all will (a member whose backstop aborted the epoch, its training thread stuck in CUDA, will not)."""
        with self._retire_lock:
            kept = self.retired_in_s is None
            self._cancel_backstop()
        if all_kept is not None and not all_kept(kept):
            self.retire()
            return None
        with self._retire_lock:
            if self.retired_in_s is not None:
                return None
            started = time.monotonic()
            cuts = [(role, g, [g.index[r] for r in g.members if r in lost]) for role, g in self.roles()]
            cuts = [(role, g, out) for role, g, out in cuts if out and len(g.members) - len(out) >= 2]
            children: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]] = {}
            failure: list[BaseException] = []

            def shrink_all() -> None:
                try:
                    for role, g, out in cuts:
                        left = tuple(r for r in g.members if r not in lost)
                        children[(role, left)] = shrink_nccl(g.backend, g.store, out)
                except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
                    failure.append(e)
            thread = threading.Thread(target=shrink_all, name="ds-recycle-nccl-shrink", daemon=True)
            thread.start()
            thread.join(self.timeout_s + self.abort_deadline_s)
            if thread.is_alive():
                _leave_as_lost(f"shrinking {len(cuts)} NCCL communicators did not return within "
                               f"{self.timeout_s + self.abort_deadline_s:.0f} s")
            shrunk = ShrunkGroups(children, self.abort_deadline_s)
            if failure:
                logger.warning("epoch %d: shrinking its NCCL communicators failed (%r); the next epoch's are built",
                               self.epoch, failure[0])
                shrunk.discard()
            shrink_s = time.monotonic() - started
            self.retired_in_s = abort_together([g.backend for g in self.groups],  # type: ignore[attr-defined]
                                               self.abort_deadline_s)
        logger.info("epoch %d: %d NCCL communicators shrunk in %.3f s, %d aborted in %.3f s", self.epoch,
                    len(children) if not failure else 0, shrink_s, len(self.groups), self.retired_in_s)
        return None if failure else shrunk


@dataclass
class ShrunkGroups:
    """Communicators shrunk from a failed epoch's (:meth:`NcclEpochComm.shrink`), by role and members, until the
    next epoch takes them (:meth:`NcclEpochComm.build_nccl`) or they are aborted (:meth:`discard`)."""

    pairs: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]]
    """``(role, members) -> (backend, process group)``."""
    abort_deadline_s: float = ABORT_DEADLINE_S

    def take(self, role: str, members: Sequence[int]) -> tuple[Any, Any] | None:
        """The communicator shrunk for ``role`` over exactly ``members`` (None: none), no longer held here."""
        return self.pairs.pop((role, tuple(sorted(members))), None)

    def discard(self) -> None:
        """Abort every communicator still held (together, as an epoch's)."""
        pairs, self.pairs = self.pairs, {}
        if pairs:
            abort_together([backend for backend, _ in pairs.values()], self.abort_deadline_s)


class _EventWork:
    """A CUDA event as a work :func:`polled_wait` can poll."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> bool:
        return True
