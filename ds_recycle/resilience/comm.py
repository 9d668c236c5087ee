"""Process groups that a dead peer cannot hang: one gloo group per membership epoch, bounded waits.

After a failure, every group that contained the dead rank is poisoned (gloo peers of the dead rank
error out, the others block until the group's timeout). So ds_recycle never reuses a group across a
membership change: each epoch builds fresh gloo groups over a prefix of the launcher's store, with
ranks renumbered among the members, and abandons the old ones (kept referenced, never destroyed, so
that no destructor waits on a blocked gloo thread).

Every wait is :func:`bounded_wait`: it blocks until the operation completes, the worker's watchdog
(:mod:`ds_recycle.resilience.watchdog`) declares a member exited or hung, or the deadline passes; the last
two raise :class:`PeerFailure` (within about a millisecond of a launcher's exit report, within
``heartbeat_stale_s`` of a hung member's last heartbeat).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ds_recycle.resilience.store import StoreKeys, incarnation

if TYPE_CHECKING:
    from ds_recycle.resilience.watchdog import Watchdog

logger = logging.getLogger(__name__)

__all__ = ["EpochGroup", "FailureProbe", "PeerFailure", "ThreadedWork", "Work", "bounded_wait"]


_BREAK_TAG = 2**31 - 1
"""The tag of :meth:`EpochGroup.break_links`'s receive: no message ever carries it."""


class PeerFailure(RuntimeError):
    """A peer died or a wait ran past its bound: the membership must be agreed again."""


class Work(Protocol):
    """What gloo returns for an asynchronous operation."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: timedelta = ...) -> bool: ...


@dataclass
class FailureProbe:
    """Answers "has a member of the current epoch exited?" from the launcher's exit keys.

    With a :attr:`watchdog` that has looked at the epoch's members, the answer is its flag (no store call).
    Otherwise the exit counter is read on every check (one cheap store round trip); only when it moved are the
    members' exit keys looked at, so the exit of a rank that is already out of the membership (or a
    report that arrives after this rank noticed the failure by itself) is not mistaken for a new failure.
    """

    store: dist.Store
    members: tuple[int, ...] = ()
    keys: StoreKeys = field(default_factory=StoreKeys)
    incarnations: dict[int, int] = field(default_factory=dict)
    """Each member's restart count when the epoch began: a member restarted since then died in between, even
    when its exit key is already gone again (the launcher deletes it when it restarts the rank)."""
    watchdog: Watchdog | None = None
    """The worker's watchdog, armed with the same members: its trip counts as a failure here too."""
    _count: int = -1

    def arm(self, members: Sequence[int]) -> FailureProbe:
        """Watch ``members`` from now on (at the start of an epoch)."""
        self.members = tuple(members)
        self.incarnations = {r: incarnation(self.store, self.keys, r) for r in self.members}
        self._count = -1
        return self

    def failed(self) -> bool:
        """With a watchdog that has looked at this epoch's members already: its flag only (no store call)."""
        if self.watchdog is not None:
            if self.watchdog.tripped():
                return True
            if self.watchdog.current():
                return False
        count = int(self.store.add(self.keys.exits, 0))
        if count == self._count:
            return False
        self._count = count
        return any(self.store.check([self.keys.exit(r)]) or incarnation(self.store, self.keys, r) != n
                   for r, n in self.incarnations.items())


class _Waiter:
    """One daemon thread that calls ``wait()`` on the point-to-point works handed to it, one after the other.

    It lives as long as no wait on it is abandoned: a work whose peer died may block it until the group's own
    timeout, so :func:`bounded_wait` retires a waiter it gives up on, and the next work gets a new one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[ThreadedWork] = deque()
        threading.Thread(target=self._run, name="gloo-wait", daemon=True).start()

    def submit(self, handle: ThreadedWork) -> None:
        with self._cond:
            self._queue.append(handle)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                handle = self._queue.popleft()
            handle._wait_inner()


_waiter_lock = threading.Lock()
_waiter: _Waiter | None = None


def _current_waiter() -> _Waiter:
    global _waiter
    with _waiter_lock:
        if _waiter is None:
            _waiter = _Waiter()
        return _waiter


def _retire_waiter(waiter: _Waiter | None) -> None:
    global _waiter
    with _waiter_lock:
        if waiter is not None and _waiter is waiter:
            _waiter = None


class ThreadedWork:
    """Any gloo work made waitable on an event, without a thread of its own.

    Gloo's point-to-point works report ``is_completed() == False`` until someone calls ``wait()``, a
    ``wait(timeout)`` that expires closes the connection, and they have no future; so they cannot be waited
    for with a deadline from the training thread. They are handed to the process's long-lived waiter thread
    (:class:`_Waiter`), which blocks in their ``wait()`` one after the other (the training thread waits for
    them in the order it wraps them). Collectives complete a future: its callback sets the event, no thread
    involved. If a peer is stuck for good, the waiter stays blocked inside the abandoned group until the
    group's own timeout, and is retired (see :func:`bounded_wait`).
    """

    def __init__(self, work: Work) -> None:
        self._work = work
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._waiters: list[threading.Event] = []
        self._error: BaseException | None = None
        self.waiter: _Waiter | None = None
        """The thread waiting for it (None: a collective whose future tells)."""
        try:
            future = work.get_future()  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # point-to-point: "getFuture not implemented"
            self.waiter = _current_waiter()
            self.waiter.submit(self)
        else:
            future.add_done_callback(lambda _: self._complete())

    def _wait_inner(self) -> None:
        try:
            self._work.wait()
        except BaseException as e:  # reported to the waiting thread by wait()
            self._error = e
        finally:
            self._complete()

    def _complete(self) -> None:
        with self._lock:
            self._done.set()
            waiters = list(self._waiters)
        for event in waiters:
            event.set()

    def notify(self, event: threading.Event) -> None:
        """Set ``event`` when the work completes (at once if it has)."""
        with self._lock:
            self._waiters.append(event)
            if self._done.is_set():
                event.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error
        if self.waiter is None:
            self._work.wait()  # completed: returns at once, or raises the collective's error
        return True


def bounded_wait(work: Work, probe: FailureProbe | None, timeout_s: float, what: str,
                 poll_s: float = 0.01) -> None:
    """Wait for ``work``; raise :class:`PeerFailure` on a member's failure or after ``timeout_s``.

    When ``probe`` has a :class:`~ds_recycle.resilience.watchdog.Watchdog`, the epoch's groups are in its guard:
    the training thread blocks in gloo's own ``wait()`` (no thread hand-off, no polling), bounded by the group's
    timeout (``timeout_s``, the same bound), and a trip breaks the groups (:meth:`EpochGroup.break_links`), which
    makes the wait raise at once. Without a watchdog the thread sleeps on an event set by the work's completion
    (see :class:`ThreadedWork`) and wakes every ``poll_s`` to read the probe.
    """
    if probe is not None and probe.watchdog is not None:
        watchdog = probe.watchdog
        if probe.failed():
            raise PeerFailure(f"{what}: {_reason(watchdog)} before waiting")
        try:
            work.wait()
        except RuntimeError as e:  # a broken group, the dead pair's error, or the group's timeout
            cause = _reason(watchdog) if watchdog.tripped() else str(e)
            raise PeerFailure(f"{what}: {cause}") from e
        return
    if work.is_completed():
        _finish(work, what)
        return
    deadline = time.monotonic() + timeout_s
    threaded = work if isinstance(work, ThreadedWork) else ThreadedWork(work)
    wake = threading.Event()
    threaded.notify(wake)
    try:
        while not threaded.is_completed():
            if probe is not None and probe.failed():
                raise PeerFailure(f"{what}: a worker exited while waiting")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerFailure(f"{what}: no completion within {timeout_s} s "
                                  "(raise the timeout if peers are slow)")
            wake.wait(min(remaining, poll_s))
    except PeerFailure:
        if not threaded.is_completed():
            _retire_waiter(threaded.waiter)  # it may stay blocked in the dead group: later works get a new one
        raise
    _finish(threaded, what)


def _reason(watchdog: Watchdog) -> str:
    return watchdog.declared.reason if watchdog.declared else "a worker exited"


def _finish(work: Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo reports the dead pair ("Connection closed by peer", "Read error")
        raise PeerFailure(f"{what}: {e}") from e


class EpochGroup:
    """A gloo group over ``members`` (global ranks) for one membership epoch, with global-rank addressing.

    Whoever replaces a group keeps a reference to the old one until the job ends: destroying a gloo
    group closes its connections, which members still blocked in it would take for a new failure.
    """

    def __init__(self, store: dist.Store, name: str, members: Sequence[int], rank: int, timeout_s: float) -> None:
        self.members = sorted(members)
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not a member of group {name} {self.members}")
        self.name = name
        self.index = {r: i for i, r in enumerate(self.members)}
        self.index_of_self = self.index[rank]
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
                work = (self.pg.recv_anysource([torch.zeros(1)], _BREAK_TAG) if source is None
                        else self.pg.recv([torch.zeros(1)], source, _BREAK_TAG))
            except RuntimeError:
                continue
            try:
                work.wait(timedelta(milliseconds=1))
            except RuntimeError:
                return  # expired: the context closed its pairs

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        with self._posting(f"send to rank {dst}"):
            return self.pg.send([tensor], self.index[dst], tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        with self._posting(f"receive from rank {src}"):
            return self.pg.recv([tensor], self.index[src], tag)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.index[src]
        opts.rootTensor = 0
        with self._posting(f"broadcast from rank {src}"):
            return self.pg.broadcast([tensor], opts)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        """Member ``j`` (in rank order) receives the ``j``-th equal slice of every member's ``tensor``."""
        with self._posting("all-to-all"):
            return self.pg.alltoall_base(output, tensor, [], [], dist.AllToAllOptions())

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Work:
        """Every member's ``tensor`` into ``outputs``, in rank order."""
        with self._posting("all-gather"):
            return self.pg.allgather([outputs], [tensor])

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> Work:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> Work:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        with self._posting("all-reduce"):
            return self.pg.allreduce([tensor], opts)

    @contextlib.contextmanager
    def _posting(self, what: str) -> Iterator[None]:
        """Gloo refuses to even post an operation on a pair whose peer died: that too is a :class:`PeerFailure`."""
        try:
            yield
        except RuntimeError as e:
            raise PeerFailure(f"group {self.name}: {what}: {e}") from e
