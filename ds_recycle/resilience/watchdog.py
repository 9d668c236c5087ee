"""The watchdog: this worker's one failure detector. Nothing else on a worker reads exit records or heartbeats.

It declares a member failed while the training thread is blocked in a wait, answers "is the epoch failed?"
before each instruction and wait (:meth:`Watchdog.failed`), and "is this member dead?" during agreement
(:meth:`Watchdog.dead`).

A crashed worker is reported by its launcher (``ds_recycle/exit/<rank>`` and the ``exits`` counter); a
*hung* one (SIGSTOP, a wedged device call, a driver stuck in the kernel) is not: its process is alive, its
sockets are open, and every peer blocked in a send, receive or collective with it would wait for the group's
timeout (``recycle.failure_timeout_s``). The watchdog is two daemon threads per worker, each on its own
store client:

* the exit waiter blocks in ``queue_pop`` on this rank's ``ds_recycle/exit_queue/<rank>``, onto which the
  launchers push at every exit (:func:`~ds_recycle.runtime.job_store.publish_exit_count`), so it wakes the
  moment a worker's exit is reported; it then reads the exit counter and, when it moved, looks at the members'
  exit keys, restart counts and published hung declarations.
  :meth:`Watchdog.stop` (also run at interpreter exit) pushes a stop item to wake and join it: a thread left
  blocked in the store while the interpreter shuts down would abort the process when woken;
* the timer reads the heartbeat counter of one member every ``heartbeat_poll_s``: the next one in rank order
  among the members (a ring, so a job of N workers makes N reads per period, not N x (N - 1)). A counter
  that has not moved for ``stale_after_s`` (``recycle.heartbeat_stale_s``) of this thread's monotonic clock
  declares that member *hung*: the watchdog asks the member's launcher to fence it (``ds_recycle/fence/<rank>``,
  see :mod:`ds_recycle.launcher.fencing`: SIGKILL, then reported like any other death), publishes the
  declaration (``ds_recycle/hung/<rank>``, counted by ``ds_recycle/hung/count``), wakes every member's exit
  waiter (their queues), and trips; the others trip on the published declaration at once, before the fence
  takes effect. The timer also reads the exit and declaration counters (for an exit counted without its
  ``exited`` key, and for the members of a watch armed while the exit waiter was asleep).

The training thread reads only the watchdog's flags (:meth:`Watchdog.failed`): no store call per instruction or
wait once a thread has looked at the epoch's members (until then, one look on the training thread's own client).
During agreement, :meth:`Watchdog.dead` judges each member of the previous epoch that has not announced itself:
its exit key or a restart since the epoch began, a hung declaration, or its heartbeat silent for
``stale_after_s`` (every such member's heartbeat is read then, not only the ring neighbour's).

Tripping breaks the epoch's groups registered with :meth:`Watchdog.guard`, so a training thread blocked in
gloo's own wait (see :func:`~ds_recycle.resilience.comm.bounded_wait`) raises at once and the wait becomes a
:class:`~ds_recycle.resilience.comm.PeerFailure`; it also sets every event registered with
:meth:`Watchdog.waking` (for calls that block without a work, see :func:`run_guarded`). Nothing busy-polls: the
training thread blocks in gloo, the exit waiter blocks on the store, the timer sleeps between its reads.

A member stopped for less than ``stale_after_s`` and then resumed is declared nothing: its heartbeat thread
resumes with it and its counter moves again.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

import torch.distributed as dist

from ds_recycle.resilience.errors import PeerFailure
from ds_recycle.resilience.store import StoreKeys, incarnation
from ds_recycle.runtime import job_store as launcher_store

__all__ = ["Declaration", "Guarded", "Watchdog", "run_guarded", "watch_members"]

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 3600.0
"""How long one ``queue_pop`` of the exit waiter lasts before it is renewed (torch logs each expiry)."""
_STOP_ITEM = "stop"


@dataclass(frozen=True)
class Declaration:
    """Why the watchdog tripped."""

    rank: int
    hung: bool
    """True: its heartbeat stopped (it was fenced); False: its launcher reported it gone."""
    reason: str
    at: float
    """Unix time of the declaration."""


class Watchdog:
    """Watches the members of the current epoch from a daemon thread (see the module docstring)."""

    def __init__(self, store_factory: Callable[[], dist.Store], rank: int, stale_after_s: float,
                 keys: StoreKeys = StoreKeys(), heartbeat_poll_s: float = 0.25,
                 caller_store: dist.Store | None = None) -> None:
        self._store = store_factory()  # its own connection: the training thread's client is not thread-safe
        self._exit_store = store_factory()  # the exit waiter's, blocked in queue_pop most of the time
        self._exit_store.set_timeout(timedelta(seconds=EXIT_WAIT_S))
        self._caller_store = caller_store if caller_store is not None else store_factory()
        """The training thread's client: :meth:`failed` and :meth:`dead` run on that thread."""
        self._judged: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last moved), for dead()
        self.rank = rank
        self.stale_after_s = stale_after_s
        self.keys = keys
        self.heartbeat_poll_s = heartbeat_poll_s
        self._lock = threading.Lock()
        self._members: tuple[int, ...] = ()
        self._incarnations: dict[int, int] = {}
        self._epoch = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last moved)
        self._checked = 0  # the latest watch (epoch) whose members' exit keys a thread has looked at
        self._waiters: set[threading.Event] = set()
        self._guarded: tuple[Guarded, ...] = ()
        self.declared: Declaration | None = None
        """Why the current epoch's watch tripped (None: it has not)."""
        self.hung: set[int] = set()
        """Ranks declared hung (and fenced) since the watch was last armed."""
        self._caller_exits = -1  # the exit counter as failed() last read it on the caller's client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{rank}", daemon=True)
        self._exit_thread = threading.Thread(target=self._wait_exits, name=f"watchdog-exits-{rank}", daemon=True)

    # ---------------------------------------------------------------------------------------- training thread
    def start(self) -> Watchdog:
        self._thread.start()
        self._exit_thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2 * self.heartbeat_poll_s + 1)  # then its store client is free to wake the waiter
        if self._exit_thread.is_alive():
            with contextlib.suppress(Exception):  # the store is gone: so is whatever the waiter was blocked on
                self._store.queue_push(self.keys.exit_queue(self.rank), _STOP_ITEM)
            self._exit_thread.join(timeout=2.0)
        atexit.unregister(self.stop)

    def arm(self, members: Sequence[int], incarnations: dict[int, int]) -> None:
        """Watch ``members`` (each at its restart count in ``incarnations``) from now on; clears a trip."""
        with self._lock:
            self._epoch += 1
            self._members = tuple(sorted(members))
            self._incarnations = dict(incarnations)
            self._seen = {r: v for r, v in self._seen.items() if r in self._members}
            self.declared = None
            self.hung = set()
            self._guarded = ()  # the past epoch's groups are retired
            self._caller_exits = -1

    def tripped(self) -> bool:
        return self.declared is not None

    def current(self) -> bool:
        """The members of the latest :meth:`arm` have been looked at since: :meth:`tripped` tells all."""
        return self._checked == self._epoch

    def reason(self) -> str:
        return self.declared.reason if self.declared is not None else "a worker exited"

    def failed(self) -> bool:
        """A member of the current watch exited, was restarted or was declared hung (training thread only).

        Its flag alone once a thread has looked at the watch's members; before that (right after :meth:`arm`),
        the exit counter on the caller's client, and the members' keys when it moved.
        """
        if self.declared is not None:
            return True
        if self._checked == self._epoch:
            return False
        with self._lock:
            epoch, members, incarnations = self._epoch, self._members, dict(self._incarnations)
        store = self._caller_store
        count = int(store.add(self.keys.exits, 0))
        if count == self._caller_exits:
            return False
        self._caller_exits = count
        found = self._exited(store, members, incarnations)
        if found is not None:
            self._trip(epoch, found)
        return found is not None

    def dead(self, rank: int) -> bool:
        """During agreement (training thread): the member of the previous epoch ``rank`` is gone: declared hung
        by this watchdog, reported exited by its launcher, restarted since the epoch began, or its heartbeat has
        not moved for ``stale_after_s`` since this thread first read it."""
        if rank in self.hung:
            return True
        store = self._caller_store
        if store.check([self.keys.exit(rank)]):
            return True
        if rank in self._incarnations and incarnation(store, self.keys, rank) != self._incarnations[rank]:
            return True
        now = time.monotonic()
        count = int(store.add(self.keys.heartbeat(rank), 0))
        last = self._judged.get(rank)
        if last is None or count != last[0]:
            self._judged[rank] = (count, now)
            return False
        return now - last[1] > self.stale_after_s

    def guard(self, groups: Sequence[Guarded]) -> None:
        """A trip of the current watch breaks ``groups`` (at once if it has tripped already): a training thread
        blocked in one of their waits raises instead of sitting out the group's timeout."""
        with self._lock:
            self._guarded = tuple(groups)
            tripped = self.declared is not None
        if tripped:
            _break(groups)

    @contextlib.contextmanager
    def waking(self, event: threading.Event) -> Iterator[None]:
        """Inside, a trip sets ``event`` (at once if the watch has tripped already)."""
        with self._lock:
            self._waiters.add(event)
            if self.declared is not None:
                event.set()
        try:
            yield
        finally:
            with self._lock:
                self._waiters.discard(event)

    # ---------------------------------------------------------------------------------------- watcher thread
    def _run(self) -> None:
        exits_seen, checked_epoch = (-1, -1), 0
        while True:
            try:
                exits_seen, checked_epoch = self._check(self._store, exits_seen, checked_epoch)
                if self.declared is None:
                    with self._lock:
                        epoch, members, incarnations = self._epoch, self._members, dict(self._incarnations)
                    if members and epoch == checked_epoch:
                        found = self._stale(members, incarnations, time.monotonic())
                        if found is not None:
                            self._trip(epoch, found)
            except Exception:  # the store is gone: the job is over, nothing left to watch
                logger.debug("watchdog stopped: store unreachable")
                return
            if self._stop.wait(self.heartbeat_poll_s):
                return

    def _wait_exits(self) -> None:
        store, exits_seen, checked_epoch = self._exit_store, (-1, -1), 0
        queue = self.keys.exit_queue(self.rank)
        while not self._stop.is_set():
            try:
                exits_seen, checked_epoch = self._check(store, exits_seen, checked_epoch)
                store.queue_pop(queue)  # an exit count, or the stop item (a stale one of a past process is harmless)
            except dist.DistStoreError:  # no exit for EXIT_WAIT_S: wait again
                continue
            except Exception as e:
                logger.debug("watchdog exit waiter stopped: %s", e)  # the store is gone: the job is over
                return

    def _check(self, store: dist.Store, exits_seen: tuple[int, int],
               checked_epoch: int) -> tuple[tuple[int, int], int]:
        """Look at the members' exit keys and hung declarations if the exit or declaration counter moved or the
        watch was re-armed since ``checked_epoch``.

        Returns the counters read and the watch they were checked against.
        """
        with self._lock:
            epoch, members, incarnations = self._epoch, self._members, dict(self._incarnations)
        count = (int(store.add(self.keys.exits, 0)), int(store.add(self.keys.hung_declarations, 0)))
        if count == exits_seen and epoch == checked_epoch:
            return count, epoch
        if self.declared is None and members:
            found = self._exited(store, members, incarnations)
            if found is not None:
                self._trip(epoch, found)
        with self._lock:
            if self._epoch == epoch and self._checked != epoch:
                self._checked = epoch
        return count, epoch

    def _exited(self, store: dist.Store, members: tuple[int, ...],
                incarnations: dict[int, int]) -> Declaration | None:
        for r in members:
            if r in incarnations and (store.check([self.keys.exit(r)])
                                      or incarnation(store, self.keys, r) != incarnations[r]):
                return Declaration(r, False, f"rank {r} exited (its launcher reported it)", time.time())
        for r in members:
            if r != self.rank and r in incarnations and store.check([self.keys.hung(r)]):
                count, _, reason = store.get(self.keys.hung(r)).decode().partition(" ")
                if count == str(incarnations[r]):  # a declaration about this process, not an earlier one
                    return Declaration(r, True, reason, time.time())
        return None

    def _stale(self, members: tuple[int, ...], incarnations: dict[int, int], now: float) -> Declaration | None:
        for r in _watched(members, self.rank):
            count = int(self._store.add(self.keys.heartbeat(r), 0))
            last = self._seen.get(r)
            if last is None or count != last[0]:
                self._seen[r] = (count, now)
                continue
            silent = now - last[1]
            if silent > self.stale_after_s:
                _request_fence(self._store, r, incarnations.get(r, 0),
                               f"no heartbeat for {silent:.1f} s (declared by rank {self.rank})")
                found = Declaration(r, True, f"rank {r} hung: no heartbeat for {silent:.1f} s "
                                    f"(recycle.heartbeat_stale_s {self.stale_after_s:g}; declared by rank "
                                    f"{self.rank}), fenced", time.time())
                self._publish(found, incarnations.get(r, 0), members)
                return found
        return None

    def _publish(self, found: Declaration, restart_count: int, members: tuple[int, ...]) -> None:
        """Tell every member of the declaration now (each one's exit waiter wakes and finds it)."""
        self._store.set(self.keys.hung(found.rank), f"{restart_count} {found.reason}")
        self._store.add(self.keys.hung_declarations, 1)
        for m in members:
            if m not in (self.rank, found.rank):
                self._store.queue_push(self.keys.exit_queue(m), "hung")

    def _trip(self, epoch: int, found: Declaration) -> None:
        with self._lock:
            if epoch != self._epoch or self.declared is not None:
                return  # re-armed meanwhile: this finding belongs to a past epoch
            self.declared = found
            if found.hung:
                self.hung.add(found.rank)
            waiters, guarded = list(self._waiters), self._guarded
        logger.warning("watchdog: %s", found.reason,
                       extra={"event": "watchdog", "rank": found.rank, "hung": found.hung})
        _break(guarded)
        for event in waiters:
            event.set()


class Guarded(Protocol):
    """A group the watchdog breaks when it trips (:meth:`~ds_recycle.resilience.comm.EpochGroup.break_links`)."""

    def break_links(self) -> None: ...


def _break(groups: Sequence[Guarded]) -> None:
    for group in groups:
        try:
            group.break_links()
        except Exception:  # a group already torn down: nothing of it can block
            logger.debug("breaking a group failed", exc_info=True)


def _watched(members: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The member whose heartbeat ``rank`` reads: the next one in rank order, the first after the last (a ring)."""
    others = [r for r in members if r != rank]
    if not others:
        return ()
    later = [r for r in others if r > rank]
    return (later[0] if later else others[0],)


def _request_fence(store: dist.Store, rank: int, restart_count: int, reason: str) -> None:
    """Ask ``rank``'s launcher to SIGKILL its process of ``restart_count`` (idempotent: several members may ask)."""
    store.set(launcher_store.fence_key(rank), f"{restart_count} {reason}")
    store.add(launcher_store.FENCE_REQUESTS_KEY, 1)


T = TypeVar("T")


def run_guarded(build: Callable[[], T], watchdog: Watchdog, timeout_s: float, what: str) -> T:
    """``build()`` in a helper thread, abandoned when ``watchdog`` trips or ``timeout_s`` passes.

    For calls that block without a work to wait on, such as connecting a gloo group to members that may have
    died before connecting: the caller gets :class:`~ds_recycle.resilience.errors.PeerFailure` at once, and the
    abandoned thread ends when the call's own timeout expires (its error then goes to the debug log).
    """
    done = threading.Event()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as e:
            error.append(e)
            logger.debug("%s ended with %s", what, e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"guarded: {what}", daemon=True).start()
    with watchdog.waking(done):
        if not done.wait(timeout_s):
            raise PeerFailure(f"{what}: not done within {timeout_s} s")
    if result:
        return result[0]
    if error:
        raise error[0]
    raise PeerFailure(f"{what}: {watchdog.declared.reason if watchdog.declared else 'interrupted'}")


def watch_members(watchdog: Watchdog, store: dist.Store, keys: StoreKeys, members: Sequence[int],
                  known: dict[int, int] | None = None) -> dict[int, int]:
    """Arm ``watchdog`` with ``members`` at their current restart counts, or at ``known`` ones; those counts.

    A joiner's count comes from its join request (``known``): if that process died, or the launcher restarted
    the rank again, before the members connect to it, the watch trips at its first look.
    """
    counts = {r: (known or {}).get(r, incarnation(store, keys, r)) for r in members}
    watchdog.arm(members, counts)
    store.queue_push(keys.exit_queue(watchdog.rank), "arm")  # the exit waiter looks at the new members at once
    return counts
