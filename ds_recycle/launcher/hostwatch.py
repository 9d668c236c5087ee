"""Hosts as units of failure: node heartbeats, the watch that declares a silent node lost, and host events.

Every launcher that does not host the store holds a *lease* on it (:class:`Lease`): a thread of its own bumps
``ds_recycle/node_hb/<k>`` every 0.25 s through a store client of its own, whose timeout is the *fence time*
(half of ``--node_timeout``). Whoever hosts the store (node 0's launcher, or ``ds-recycle store``) runs the
:class:`NodeWatch`; on an etcd store (``--store etcd://...``) no launcher hosts it, so every launcher holds a
lease and watches the other nodes, and one watcher declares each loss (:meth:`NodeWatch._claim`). A node whose
heartbeat counter has not moved for ``--node_timeout`` seconds (its host died, or its link is cut) is declared
lost: every rank of that node without an exit key gets exit code 75
(lost) through ``compare_set``, the exit counter moves (so the workers' failure handler sees the loss within
milliseconds, as for a single dead worker), then ``ds_recycle/node_lost/<k>`` is written and a ``host_lost``
event recorded.

No split brain: when no heartbeat of a launcher has completed for the fence time, the lease's watch thread
SIGKILLs the node's workers at once, before the watch can declare the node lost (fence time < node timeout),
so its workers never train on or write a checkpoint after the others went on without them. The cut-off
launcher then only reads the store, and exits with code 75 (lost) when the store has not answered for
``--store_timeout`` seconds. Once the store answers again it waits until the watch has declared its node lost
(so the watch never writes an exit key over a restarted rank), restarts its unfinished ranks as restarted ones
(they rejoin the running job, or enter the fallback's new generation), deletes ``node_lost/<k>`` and records
``host_partitioned`` and ``host_back``. A launcher started for a node that already beat before (the host was
lost and its launcher is started again, by hand with ``ds-recycle launch --no_ssh --node_rank K`` or by node 0
over ssh) does the same from its start.

Keys (UTF-8 text): ``ds_recycle/node_hb/<k>`` (counter), ``ds_recycle/layout`` (the job's layout, written by
node 0, read by a ``ds-recycle store`` service), ``ds_recycle/node_timeout``, ``ds_recycle/node_lost/<k>``
(why), ``ds_recycle/host_events`` (counter) and ``ds_recycle/host_event/<n>`` (one JSON event: ``kind`` in
``host_lost``, ``host_partitioned``, ``host_back``; ``node``, ``host``, ``ranks``, ``time_s``, and details).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import Store

from ds_recycle.events import Event, HostEvent, HostLostEvent, parse_event
from ds_recycle.launcher.hosts import Layout
from ds_recycle.launcher.worker import LOST_EXIT_CODE
from ds_recycle.runtime import job_store as keys

__all__ = ["HOST_EVENTS_KEY", "LAYOUT_KEY", "NODE_TIMEOUT_KEY", "HostEvents", "Lease", "NodeWatch", "fence_time",
           "node_declare_key", "node_hb_key", "node_lost_key", "node_ranks", "record_host_event"]

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=HostEvent)

LAYOUT_KEY = "ds_recycle/layout"
NODE_TIMEOUT_KEY = "ds_recycle/node_timeout"
HOST_EVENTS_KEY = "ds_recycle/host_events"
_BEAT_S = 0.25


def node_hb_key(node_rank: int) -> str:
    return f"ds_recycle/node_hb/{node_rank}"


def node_lost_key(node_rank: int) -> str:
    return f"ds_recycle/node_lost/{node_rank}"


def node_declare_key(node_rank: int) -> str:
    return f"ds_recycle/node_declare/{node_rank}"


def host_event_key(index: int) -> str:
    return f"ds_recycle/host_event/{index}"


def fence_time(node_timeout_s: float) -> float:
    """How long a launcher's store operation may take before it fences its workers: half the node timeout."""
    return node_timeout_s / 2


def node_ranks(layout: Layout, node_rank: int) -> list[int]:
    first = layout.offset(node_rank)
    return list(range(first, first + len(layout.nodes[node_rank].slots)))


def record_host_event(store: Store, kind: type[E], layout: Layout, node_rank: int, **details: Any) -> E:
    """Append one host event (:mod:`ds_recycle.events`) to the store's list (read by the metrics reporter) and
    log it."""
    event = kind(node=node_rank, host=layout.nodes[node_rank].host, ranks=tuple(node_ranks(layout, node_rank)),
                 **details)
    index = store.add(HOST_EVENTS_KEY, 1)
    store.set(host_event_key(index), json.dumps(event.to_dict()))
    logger.warning("host event %s: node %d (%s) %s", event.kind, node_rank, event.host, details,
                   extra={"event": event.kind, **event.to_dict()})
    return event


class HostEvents:
    """Reads the host events recorded since the last call (the metrics reporter drains it every iteration)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._seen = 0

    def drain(self) -> list[Event]:
        count = self.store.add(HOST_EVENTS_KEY, 0)
        events = [parse_event(json.loads(self.store.get(host_event_key(i)).decode()))
                  for i in range(self._seen + 1, count + 1)]
        self._seen = count
        return events


class NodeWatch:
    """Declares nodes whose heartbeat stopped lost (see the module docstring); run by whoever hosts the store, or
    by every launcher of a job on etcd."""

    def __init__(self, layout: Layout, node_timeout_s: float, watched: Sequence[int], me: str = "store",
                 restart_start_up: bool = True) -> None:
        """``me``: who watches (a node's rank, or ``store`` for the store's host), recorded in the claims;
        ``restart_start_up``: a node lost before the start-up was over restarts it (False under ``--strict``)."""
        self.layout = layout
        self.me = me
        self.restart_start_up = restart_start_up
        self.node_timeout_s = node_timeout_s
        self.watched = tuple(watched)
        self._last: dict[int, tuple[int, float]] = {}
        self.lost: set[int] = set()

    def poll(self, store: Store, now: float | None = None) -> list[int]:
        """Look at every watched node's heartbeat once; returns the nodes declared lost by this call."""
        now = time.monotonic() if now is None else now
        declared = []
        for k in self.watched:
            beats = store.add(node_hb_key(k), 0)
            if k in self.lost:
                if not store.check([node_lost_key(k)]):  # its launcher is back and restarted its ranks
                    self.lost.discard(k)
                    self._last[k] = (beats, now)
                continue
            if beats == 0:
                continue  # not connected yet: whether it ever connects is the connect timeout's business
            last = self._last.get(k)
            if last is None or beats != last[0]:
                self._last[k] = (beats, now)
            elif now - last[1] >= self.node_timeout_s:
                if self._claim(store, k, beats):
                    self._declare_lost(store, k, now - last[1])
                    declared.append(k)
                self.lost.add(k)  # declared here or by another watcher: followed until its launcher is back
        return declared

    def _claim(self, store: Store, k: int, beats: int) -> bool:
        """Whether this watcher declares node ``k`` (silent at heartbeat ``beats``): with several watchers (every
        launcher of a job on etcd watches the others) exactly one does, the one whose ``compare_set`` of
        ``node_declare/<k>`` wins. A claim for an earlier silence, or one left for longer than the node timeout by
        a watcher that died before writing ``node_lost/<k>``, is taken over; a node already declared is not
        declared again."""
        key = node_declare_key(k)
        mine = f"{beats} {self.me} {time.time():.3f}"
        held = store.compare_set(key, "", mine).decode()
        if held == mine:
            return True
        if store.check([node_lost_key(k)]):
            return False
        parts = held.split()
        stale = len(parts) != 3 or parts[0] != str(beats) or time.time() - float(parts[2]) > self.node_timeout_s
        return stale and store.compare_set(key, held, mine).decode() == mine

    def _declare_lost(self, store: Store, k: int, silent_s: float) -> None:
        marked = []
        for rank in node_ranks(self.layout, k):
            key = keys.exit_key(rank)
            if store.compare_set(key, "", str(LOST_EXIT_CODE)).decode() == str(LOST_EXIT_CODE):
                marked.append(rank)
        if marked:
            keys.publish_exit_count(store, self.layout.world_size)
            # lost before the start-up of the generation its ranks were started for was over: every rank starts
            # again (this node's once its launcher is back); a later generation, begun meanwhile, is not touched
            for rank in marked if self.restart_start_up else ():
                generation = keys.read_int(store, keys.started_for_key(rank)) or 0
                if keys.note_start_up_death(store, generation):
                    logger.warning("node %d was lost during the start-up of generation %d: every rank starts again "
                                   "as generation %d (node %d's ranks once its launcher is back)", k, generation,
                                   generation + 1, k, extra={"event": "start_up_restart", "node": k})
        reason = f"no heartbeat for {silent_s:.1f} s (host lost or cut off)"
        store.set(node_lost_key(k), reason)
        self.lost.add(k)
        record_host_event(store, HostLostEvent, self.layout, k, silent_s=round(silent_s, 3), marked_lost=tuple(marked),
                          node_timeout_s=self.node_timeout_s)


class Lease:
    """One launcher's hold on a store it does not host: heartbeat and fence in threads of their own.

    A TCP store client's operations do not time out when the network goes silent (measured: an ``add`` with a
    2 s client timeout blocked for the whole 11 s of a cut link, then completed), so no store operation of the
    supervisor's thread can detect a partition. The lease's *beat thread* bumps the heartbeat through its own
    client; its *watch thread* fences when no beat has completed for the fence time: it calls ``on_fence``
    (the supervisor SIGKILLs its node's workers) even while every other thread of the launcher is blocked in the
    store. While fenced, the beat thread only reads (the watch must see this node silent and declare it lost);
    a read that completes means the store answers again. After ``give_up_s`` without an answer the launcher
    process exits with code 75 (lost).
    """

    def __init__(self, addr: str, port: int, node_rank: int, node_timeout_s: float, give_up_s: float,
                 store_spec: str | None = None) -> None:
        """``store_spec``: the job's ``etcd://...`` store (None: the TCP store at ``addr:port``)."""
        self.addr, self.port, self.node_rank = addr, port, node_rank
        self.store_spec = store_spec
        self.node_timeout_s = node_timeout_s
        self.give_up_s = give_up_s
        self.fenced_at: float | None = None
        self.fenced_wall: float | None = None
        self.rejoin_since: float | None = None
        self.beating = True
        self.last_ok = time.monotonic()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def where(self) -> str:
        return self.store_spec or f"{self.addr}:{self.port}"

    def connect(self) -> Store:
        """The lease's own client of the (running) store; its calls give up after the fence time."""
        if self.store_spec is not None:
            from ds_recycle.runtime.etcd_store import EtcdStore

            fence = fence_time(self.node_timeout_s)
            return EtcdStore(self.store_spec, timeout=timedelta(seconds=fence), request_timeout_s=min(2.0, fence / 2))
        from ds_recycle.runtime.job_store import connect_store

        return connect_store(self.addr, self.port, fence_time(self.node_timeout_s))

    def fresh(self) -> bool:
        """This node's own heartbeat went through within the last quarter of the node timeout: its view of the
        others is current (a launcher that is itself cut off must not declare the others lost)."""
        return self.fenced_at is None and time.monotonic() - self.last_ok < self.node_timeout_s / 4

    def beat_before(self, store: Store) -> bool:
        """True when this node's launcher (an earlier one) beat before: its host was lost and this is a rejoin."""
        return store.add(node_hb_key(self.node_rank), 0) > 0

    def start(self, store: Store, on_fence: Callable[[], None], beating: bool = True) -> None:
        self.beating = beating
        self.last_ok = time.monotonic()
        for target, name in ((self._beat_loop, "lease beat"), (self._watch_loop, "lease watch")):
            thread = threading.Thread(target=target, args=(store, on_fence) if name == "lease watch" else (store,),
                                      name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, join_s: float = 2.0) -> bool:
        """End both threads; True when they ended within ``join_s``. False: one is blocked in a store call (a
        silent link never times out): the process must then leave with :func:`os._exit`, since the interpreter's
        shutdown ends such a thread inside the store's C++ code and aborts the process (SIGABRT)."""
        self._stop.set()
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _beat_loop(self, store: Store) -> None:
        key = node_hb_key(self.node_rank)
        while not self._stop.wait(_BEAT_S):
            try:
                if self.beating:
                    store.add(key, 1)
                else:
                    store.check([key])
            except Exception as err:  # noqa: BLE001 (etcd3gw's errors are not all RuntimeError or OSError)
                if self.store_spec is not None:
                    continue  # no member of the etcd cluster answered: silence, as a cut link (another may answer)
                if not isinstance(err, (RuntimeError, OSError)):
                    raise
                self.error = err  # the TCP store refused or reset: it is gone, not silent
                return
            self.last_ok = time.monotonic()

    def _watch_loop(self, store: Store, on_fence: Callable[[], None]) -> None:
        while not self._stop.wait(_BEAT_S):
            silent = time.monotonic() - self.last_ok
            if self.error is not None:
                return  # the store is gone: the supervisor's own store calls fail and stop the job
            if self.fenced_at is None and silent > fence_time(self.node_timeout_s):
                self.beating = False
                self.fenced_at, self.fenced_wall = time.monotonic(), time.time()
                logger.error("no answer from the store at %s for %.1f s: fencing (SIGKILL to this node's "
                             "workers); they rejoin as restarted ones once it answers", self.where, silent,
                             extra={"event": "fence", "node": self.node_rank})
                on_fence()
            elif self.fenced_at is not None and silent > self.give_up_s:
                logger.error("no answer from the store for %.0f s: this node leaves the job as lost", silent)
                on_fence()
                logging.shutdown()
                os._exit(LOST_EXIT_CODE)

    def reachable_since_fence(self) -> bool:
        return self.fenced_at is not None and self.last_ok > self.fenced_at

    def declared_lost(self, store: Store) -> bool:
        """The watch has declared this node lost (its ranks' exit keys are written): restarting is safe."""
        return store.check([node_lost_key(self.node_rank)])

    def waited_too_long(self) -> bool:
        """Waiting for the watch's declaration for over two node timeouts: another launcher of this node beats."""
        return self.rejoin_since is not None and time.monotonic() - self.rejoin_since > 2 * self.node_timeout_s + 5

    def resume(self) -> None:
        """Back in the job: beat again."""
        self.fenced_at = None
        self.rejoin_since = None
        self.beating = True
