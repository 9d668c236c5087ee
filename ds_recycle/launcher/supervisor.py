"""The launcher's loop: start this node's workers, react to each exit, stop the job when it must, report.

One :class:`Supervisor` runs per node, in the launcher's main thread. It sleeps until a child exits or a
signal arrives (``SIGCHLD`` through :func:`signal.set_wakeup_fd`, so a death is seen within milliseconds), or
until its next timer (a restart, the end of a grace period, the poll of the store). The reaction to each
exit is :func:`ds_recycle.launcher.policy.decide`, and the answer to each restart request (``ds-recycle
restart``) is :func:`ds_recycle.launcher.restart_requests.judge_restart_request`; this module only carries
them out. The store poll (every 0.25 s) runs the node watch where this launcher has one, and reads the stop
key, the restart-request and fence-request counters and the fallback's ``ds_recycle/restart_all``.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType

from torch.distributed import Store

from ds_recycle.events import HostBackEvent, HostPartitionedEvent
from ds_recycle.launcher import hostwatch
from ds_recycle.launcher.fencing import poll_fence_requests
from ds_recycle.launcher.hostwatch import Lease, NodeWatch
from ds_recycle.launcher.job import JobSpec
from ds_recycle.launcher.nodes import OtherNodes
from ds_recycle.launcher.policy import Action, decide, job_status
from ds_recycle.launcher.restart_requests import (
    RankState,
    Refusal,
    RestartResult,
    explain_refusal,
    judge_restart_request,
)
from ds_recycle.launcher.worker import ExitKind, Worker, WorkerExit, describe_returncode, exit_kind
from ds_recycle.runtime import job_store as keys

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

_STOP_KEY_POLL_S = 0.25
_MAX_SLEEP_S = 0.5
_OUTPUT_DRAIN_S = 2.0
#: extra time a remote node's launcher gets after the kill grace to stop its own workers and report them
_REMOTE_SLACK_S = 3.0
#: ssh's own exit status when the connection failed or was lost (the remote command's status otherwise)
_SSH_CONNECTION_LOST = 255


class _Wakeup:
    """Sleep until SIGCHLD/SIGINT/SIGTERM or a timeout; records SIGINT/SIGTERM. Polls when not in the main thread."""

    _SIGNALS = (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self._fds: tuple[int, int] | None = None
        self._saved: dict[signal.Signals, object] = {}
        self._saved_fd = -1

    def __enter__(self) -> _Wakeup:
        if threading.current_thread() is threading.main_thread():
            self._fds = os.pipe()
            for fd in self._fds:
                os.set_blocking(fd, False)
            self._saved_fd = signal.set_wakeup_fd(self._fds[1])
            for sig in self._SIGNALS:
                self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fds is not None:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            signal.set_wakeup_fd(self._saved_fd)
            for fd in self._fds:
                os.close(fd)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGCHLD:
            self.received.append(signal.Signals(signum))

    def wait(self, timeout_s: float) -> None:
        if self._fds is None:
            time.sleep(min(timeout_s, 0.01))
            return
        ready, _, _ = select.select([self._fds[0]], [], [], max(0.0, timeout_s))
        if ready:
            try:
                while os.read(self._fds[0], 512):
                    pass
            except BlockingIOError:
                pass


class Supervisor:
    """Runs one node's share of a job to the end and returns the launcher's exit status."""

    def __init__(self, job: JobSpec, store: Store, workers: Sequence[Worker], remotes: Sequence[Worker] = (),
                 hosts_store: bool = True, others: OtherNodes | None = None, watch: NodeWatch | None = None,
                 lease: Lease | None = None, lease_store: Store | None = None, rejoin: bool = False) -> None:
        """``remotes``: node 0's ssh children; ``others``: nodes started elsewhere (``--no_ssh``) to wait for;
        ``watch``: the node watch of the store's host; ``lease``: this node's lease on a store it does not host;
        ``lease_store``: the lease's own client; ``rejoin``: this node beat before (its host was lost): start its
        ranks as restarts once it is declared lost (see :mod:`.hostwatch`)."""
        self.job = job
        self.store = store
        self.workers = {w.spec.rank: w for w in workers if w.spec.rank is not None}
        self.remotes = list(remotes)
        self.hosts_store = hosts_store
        self.others = others
        self._others_pending = others is not None
        self._store_lost = False
        self.exits: list[WorkerExit] = []
        self._restart_at: dict[int, float] = {}
        self._error_deadline: float | None = None
        self._stop_reason: str | None = None
        self._kill_at: float | None = None
        self._remote_kill_at: float | None = None
        self._signal: signal.Signals | None = None
        self._next_stop_poll = 0.0
        self._requests_seen = 0
        self._fences_seen = 0
        self._restart_all_seen = 0
        self._restart_all_pending: set[int] = set()
        self._started_in: dict[int, int] = {}
        """rank -> the generation its running (or last) process was started in"""
        self._lingering = False
        self._t0 = time.monotonic()
        self.watch = watch
        self.lease = lease
        self.lease_ended = True
        """False after :meth:`run` when a lease thread was still blocked in the store (see :meth:`Lease.stop`)."""
        self.lease_store = lease_store if lease_store is not None else store
        self._rejoining = rejoin
        self._cut_off_s: float | None = None
        self._session_node: dict[int, int] = {}
        """pid of node 0's ssh session -> the node it started (nodes 1.. in layout order)"""

    # ---- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            with _Wakeup() as wake:
                if self.hosts_store:
                    self.store.set(keys.WORLD_SIZE_KEY, str(self.job.layout.world_size))
                    self.store.set(hostwatch.LAYOUT_KEY, self.job.layout.encode())
                    self.store.set(hostwatch.NODE_TIMEOUT_KEY, str(self.job.node_timeout_s))
                if self.lease is not None:
                    self.lease.start(self.lease_store, self._fence_now, beating=not self._rejoining)
                if self._rejoining and self.lease is not None:
                    self.lease.rejoin_since = time.monotonic()
                    logger.warning("node %d ran before (its host was lost): its ranks start as restarts once the "
                                   "store's node watch has declared it lost", self.job.node_rank)
                for worker in [] if self._rejoining else self._children():  # a returning node 0: the others run
                    env = {} if worker.spec.rank is None else self._note_generation(worker.spec.rank)
                    worker.start(extra_env=env)
                    logger.info("started %s as pid %s", worker.spec.name, worker.pid)
                self._session_node = {w.pid: k for k, w in enumerate(self.remotes, start=1) if w.pid is not None}
                while self._busy():
                    wake.wait(self._sleep_s())
                    self._on_signals(wake.received)
                    wake.received.clear()
                    self._reap()
                    self._fire_timers()
        except BaseException:
            logger.exception("the launcher failed; killing every worker")
            self._send_all(signal.SIGKILL, remotes=True)
            raise
        finally:
            self.lease_ended = self.lease is None or self.lease.stop()
        for worker in self._children():
            worker.join_output(_OUTPUT_DRAIN_S)
        return self._report()

    def _busy(self) -> bool:
        if any(w.running for w in self._children()) or self._restart_at or self._others_pending:
            return True
        if self._rejoining or (self._fenced() and self._stop_reason is None):
            return True  # cut off, reconnecting; or back, waiting to restart this node's ranks
        # several nodes: an error must still reach the other nodes (as ds_recycle/stop) when its grace ends
        if self._error_deadline is not None and len(self.job.layout.nodes) > 1:
            return True
        return self._waits_for_restart_command()

    def _waits_for_restart_command(self) -> bool:
        """A node other than 0 whose workers have all exited stays up while one of its ranks could be restarted
        on command and some rank of the job still runs elsewhere (node 0 already waits for every rank)."""
        was, self._lingering = self._lingering, False
        if self.hosts_store or self.others is not None or self._store_lost or self._stop_reason is not None:
            return False
        restartable = [r for r in sorted(self.workers)
                       if judge_restart_request(self._rank_state(r), self.job.policy) is None]
        try:
            self._lingering = bool(restartable) and not self.store.check(
                [keys.exit_key(r) for r in range(self.job.layout.world_size)])
        except (RuntimeError, OSError):
            return False  # node 0 and its store are gone: so is the job
        if self._lingering and not was:
            logger.info("no worker of this node runs; rank(s) %s can be restarted on command (`ds-recycle restart`) "
                        "while other ranks of the job run", restartable)
        return self._lingering

    def _children(self) -> list[Worker]:
        return [*self.workers.values(), *self.remotes]

    def _sleep_s(self) -> float:
        timers = [*self._restart_at.values(), self._next_stop_poll]
        timers += [t for t in (self._error_deadline, self._kill_at, self._remote_kill_at) if t is not None]
        return min(_MAX_SLEEP_S, min(timers) - time.monotonic())

    # ---- events -----------------------------------------------------------------------------------------------
    def _on_signals(self, received: list[signal.Signals]) -> None:
        for sig in received:
            if self._signal is not None:
                logger.warning("second %s: killing every worker now", sig.name)
                self._send_all(signal.SIGKILL, remotes=True)
                continue
            self._signal = sig
            self._stop(f"the launcher received {sig.name}")

    def _reap(self) -> None:
        for worker in self._children():
            exit = worker.poll()
            if exit is not None:
                self._on_exit(exit)

    def _on_exit(self, exit: WorkerExit) -> None:
        self.exits.append(exit)
        log = logger.info if exit.kind is ExitKind.FINISHED or exit.stopped_by_launcher else logger.warning
        log("%s at t=%.2f s", exit.describe(), time.monotonic() - self._t0,
            extra={"event": "worker_exit", "rank": exit.rank, "pid": exit.pid, "returncode": exit.returncode,
                   "exit_kind": exit.kind.value, "restart_count": exit.restart_count})
        if exit.rank is not None:
            self._publish_exit(exit)
        if self._stop_reason is not None:
            return
        if self._fenced():
            return  # fenced: this node's ranks restart only once the store answers again (see _rejoin)
        node = self._session_node.get(exit.pid)
        if node is not None and exit.returncode == _SSH_CONNECTION_LOST and self._connected(node):
            logger.warning("%s: the ssh connection was lost; its ranks are judged by the node watch", exit.name)
            return
        if exit.kind is ExitKind.LOST and exit.rank is not None and not self.hosts_store_lost():
            self._restart_start_up(exit)
            seen = self._restart_all_seen  # workers ask for the fallback just before they leave: look now, or the
            try:  # job could end (every rank lost) before the next poll sees the request
                self._poll_restart_all()
            except (RuntimeError, OSError):
                pass
            if self._restart_all_seen != seen:
                return  # the fallback restarted this node's lost ranks, this one included
        if exit.rank in self._restart_all_pending and exit.kind is ExitKind.LOST:
            self._restart_for_fallback(exit.rank)
            return
        action = decide(exit, self.job.policy)
        if action is Action.RESTART:
            assert exit.rank is not None and self.job.policy.restart_after_s is not None
            self._restart_at[exit.rank] = time.monotonic() + self.job.policy.restart_after_s
            logger.info("restarting rank %d in %.1f s", exit.rank, self.job.policy.restart_after_s)
        elif action is Action.STOP_NOW:
            self._stop(f"--strict: {exit.name} {describe_returncode(exit.returncode)}")
        elif action is Action.STOP_AFTER_GRACE and self._error_deadline is None:
            self._error_deadline = time.monotonic() + self.job.policy.error_grace_s
            logger.error("job failed: %s %s; the other workers get %.1f s to exit by themselves", exit.name,
                         describe_returncode(exit.returncode), self.job.policy.error_grace_s)

    def hosts_store_lost(self) -> bool:
        """The store cannot be read from here now (lost, or this node is fenced off it)."""
        return self._store_lost or self._fenced()

    def _publish_exit(self, exit: WorkerExit) -> None:
        assert exit.rank is not None
        if self._store_lost or self._fenced():
            return  # fenced: the node watch writes this node's exits (a store call would block while cut off)
        try:
            self.store.set(keys.exit_key(exit.rank), str(exit.returncode))
            keys.publish_exit_count(self.store, self.job.layout.world_size)
        except (RuntimeError, OSError) as err:  # a remote node whose store (node 0) is gone
            logger.error("could not record the exit of rank %d in the store: %s", exit.rank, err)

    def _fire_timers(self) -> None:
        now = time.monotonic()
        for rank, due in sorted(self._restart_at.items()):
            if due <= now:
                del self._restart_at[rank]
                self._restart(rank)
        if self._error_deadline is not None and now >= self._error_deadline and self._stop_reason is None:
            self._stop(f"a worker failed {self.job.policy.error_grace_s:.1f} s ago")
        if self._kill_at is not None and now >= self._kill_at:
            self._kill_at = None
            if any(w.running for w in self.workers.values()):
                logger.warning("%.1f s after SIGTERM: SIGKILL to what still runs", self.job.policy.kill_grace_s)
                self._send_all(signal.SIGKILL)
        if self._remote_kill_at is not None and now >= self._remote_kill_at:
            self._remote_kill_at = None
            if any(w.running for w in self.remotes):
                logger.warning("remote launchers still run after the stop: SIGKILL to their ssh sessions")
                self._send_all(signal.SIGKILL, remotes=True)
        if now >= self._next_stop_poll:
            self._next_stop_poll = now + _STOP_KEY_POLL_S
            self._poll_store()

    def _poll_store(self) -> None:
        if self._fenced() and not self._rejoining:
            self._restart_at.clear()
            assert self.lease is not None
            if self._stop_reason is not None or not self.lease.reachable_since_fence():
                return  # no store call while cut off: it would block until the link is back
            self._back_after_fence(self.lease)
        if self._store_lost:
            return
        try:
            if self.watch is not None and (self.lease is None or self.lease.fresh()):
                self.watch.poll(self.store)  # (a launcher whose own beats stall must not judge the others)
            if self._stop_reason is None and self.store.check([keys.STOP_KEY]):
                self._stop("stop requested in the store: " + self.store.get(keys.STOP_KEY).decode())
            self._poll_restart_requests()
            self._fences_seen = poll_fence_requests(self.store, self.workers, self._fences_seen)
            self._poll_restart_all()
            self._poll_lost_sessions()
            if self.others is not None:
                self._poll_others(self.others)
            if self._rejoining and self.lease is not None:
                self._rejoin(self.lease)
        except (RuntimeError, OSError) as err:
            if self._fenced():
                return  # cut off (the lease fenced this node's workers): back once the store answers
            if not self.hosts_store or self.lease is not None:
                self._store_lost = True
                idle = self._lingering and not self._restart_at and not any(w.running for w in self.workers.values())
                if idle:  # only waiting for a restart command: node 0 ended, so did the job
                    logger.info("the store of node 0 is gone (%s); no worker of this node runs: done", err)
                elif self._stop_reason is None:
                    self._stop(f"lost the store of node 0 ({err})")

    def _poll_restart_all(self) -> None:
        """A fallback to the checkpoint (``ds_recycle/restart_all``): start every rank of this node again once lost."""
        generation = keys.read_int(self.store, keys.RESTART_ALL_KEY)
        if generation is None or generation <= self._restart_all_seen or self._stop_reason is not None:
            return
        self._restart_all_seen = generation
        logger.warning("the job falls back to its checkpoint (generation %d): restarting every rank of this node "
                       "once it is lost", generation)
        self._reap()
        self._restart_all_pending = set(self.workers)
        if self.store.check([keys.start_up_restart_key(generation)]):
            running = [w for w in self.workers.values() if w.running]
            if running:  # blocked in the old generation's start-up: they cannot leave by themselves
                logger.warning("SIGKILL to ranks %s (blocked in the start-up of generation %d)",
                               [w.spec.rank for w in running], generation - 1)
                for worker in running:
                    worker.send_signal(signal.SIGKILL)
        for rank, worker in sorted(self.workers.items()):
            last = next((e for e in reversed(self.exits) if e.rank == rank), None)
            if not worker.running and last is not None and last.kind is ExitKind.LOST:
                self._restart_for_fallback(rank)

    def _note_generation(self, rank: int) -> dict[str, str]:
        """The job's generation as ``rank`` starts: remembered, and told to the process (a process started for an
        older generation than the job's leaves at once instead of joining a start-up it does not belong to)."""
        try:
            self._started_in[rank] = 0 if self._store_lost else keys.generation(self.store)
            if not self._store_lost:  # a host's loss is counted against the generation its ranks were started for
                self.store.set(keys.started_for_key(rank), str(self._started_in[rank]))
        except (RuntimeError, OSError):
            return {}  # the store is gone: no restart can be asked of it either
        return {keys.GENERATION_ENV: str(self._started_in[rank])}

    def _restart_start_up(self, exit: WorkerExit) -> None:
        """A rank lost before its generation's start-up was over: every rank starts again (the others are blocked
        in group building, which no failure handler guards yet); see :func:`keys.request_start_up_restart`."""
        assert exit.rank is not None
        if self.job.policy.strict:
            return  # --strict: any loss stops the job
        generation = self._started_in.get(exit.rank, 0)
        try:
            if keys.note_start_up_death(self.store, generation):
                logger.warning("%s was lost during the start-up of generation %d: every rank starts again as "
                               "generation %d", exit.name, generation, generation + 1,
                               extra={"event": "start_up_restart", "rank": exit.rank, "generation": generation + 1})
        except (RuntimeError, OSError) as err:
            logger.error("could not ask for a restart of the start-up: %s", err)

    def _restart_for_fallback(self, rank: int) -> None:
        self._restart_all_pending.discard(rank)
        self._restart_at.pop(rank, None)
        if self.workers[rank].restart_count >= self.job.policy.max_restarts:
            logger.error("rank %d cannot restart for the fallback: it used its %d restarts (--max_restarts)", rank,
                         self.job.policy.max_restarts)
            return
        self._restart(rank)

    def _poll_others(self, others: OtherNodes) -> None:
        missing = others.missing_nodes() if self._stop_reason is None else []
        if missing:
            self._stop(f"node(s) {missing} did not connect to the store in time")
        if self._stop_reason is not None:
            others.give_up_after(self.job.policy.kill_grace_s + 2 * _STOP_KEY_POLL_S + 5.0)
        was_pending, self._others_pending = self._others_pending, others.pending()
        if was_pending and not self._others_pending:
            logger.info("done waiting for the ranks of nodes %s", list(others.node_ranks))

    def _poll_restart_requests(self) -> None:
        """Answer the requests for this node's ranks when the request counter has moved since the last look."""
        count = self.store.add(keys.RESTART_REQUESTS_KEY, 0)
        if count == self._requests_seen:
            return
        self._requests_seen = count
        self._reap()  # a rank that died a moment ago is judged by its exit, not as running
        for rank in sorted(self.workers):
            key = keys.restart_request_key(rank)
            if self.store.check([key]):
                self._answer_restart_request(rank, self.store.get(key).decode())
                self.store.delete_key(key)

    def _poll_lost_sessions(self) -> None:
        """Node 0 over ssh: answer requests for ranks of nodes whose session ended (every poll: such a request may
        come before the watch has declared the node lost, and is answered once it has)."""
        for session in self.remotes:
            node = self._session_node.get(session.pid or -1)
            if node is not None and not session.running:
                self._answer_lost_node_requests(node, session)

    def _answer_lost_node_requests(self, node: int, session: Worker) -> None:
        """Requests for ranks of a node whose ssh session has ended and which the watch declared lost (its host
        died): node 0 starts that node's launcher again over ssh; it restarts all the node's ranks as a returning
        launcher (see :mod:`.hostwatch`). A node not declared lost is left to answer for itself."""
        requests = {}
        for rank in hostwatch.node_ranks(self.job.layout, node):
            key = keys.restart_request_key(rank)
            if self.store.check([key]):
                requests[rank] = self.store.get(key).decode()
        if not requests or not self.store.check([hostwatch.node_lost_key(node)]):
            return
        refusal = Refusal.JOB_STOPPING if self._stop_reason is not None else None
        if refusal is None:
            session.start(session.restart_count + 1)
            self._session_node[session.pid or -1] = node
            message = (f"node {node}'s launcher started again over ssh as pid {session.pid}; it restarts ranks "
                       f"{hostwatch.node_ranks(self.job.layout, node)} once it runs")
        else:
            message = f"the job is being stopped ({self._stop_reason}); node {node} is not started again"
        logger.warning("restart request for rank(s) %s of lost node %d: %s", sorted(requests), node, message,
                       extra={"event": "restart_request", "node": node, "refusal": refusal and refusal.value})
        for rank, request_id in requests.items():
            result = RestartResult(request_id, rank, refusal, message, session.pid if refusal is None else None,
                                   session.restart_count)
            self.store.set(keys.restart_result_key(rank), result.encode())
            self.store.delete_key(keys.restart_request_key(rank))

    def _answer_restart_request(self, rank: int, request_id: str) -> None:
        state = self._rank_state(rank)
        refusal = judge_restart_request(state, self.job.policy)
        if refusal is None:
            self._restart(rank)
            worker = self.workers[rank]
            result = RestartResult(request_id, rank, None, f"restarted as pid {worker.pid} (restart "
                                   f"{worker.restart_count} of at most {self.job.policy.max_restarts})",
                                   worker.pid, worker.restart_count)
            logger.info("rank %d: %s, on request %s", rank, result.message, request_id,
                        extra={"event": "restart_request", "rank": rank, "request_id": request_id,
                               "refusal": None, "pid": worker.pid, "restart_count": worker.restart_count})
        else:
            result = RestartResult(request_id, rank, refusal, explain_refusal(refusal, state, self.job.policy),
                                   None, state.restart_count)
            logger.warning("refused the restart request %s for rank %d (%s): %s", request_id, rank,
                           refusal.value, result.message,
                           extra={"event": "restart_request", "rank": rank, "request_id": request_id,
                                  "refusal": refusal.value, "pid": None, "restart_count": state.restart_count})
        self.store.set(keys.restart_result_key(rank), result.encode())

    def _rank_state(self, rank: int) -> RankState:
        worker = self.workers[rank]
        last = next((e for e in reversed(self.exits) if e.rank == rank), None)
        if last is not None and last.restart_count != worker.restart_count:
            last = None  # the exit of an earlier run; the current run has not exited
        due = self._restart_at.get(rank)
        stopping = self._stop_reason
        if stopping is None and self._error_deadline is not None:
            stopping = f"a worker failed; the others are stopped in {self._error_deadline - time.monotonic():.1f} s"
        return RankState(rank, worker.pid if worker.running else None, last, worker.restart_count,
                         None if due is None else max(0.0, due - time.monotonic()), stopping)

    # ---- a host cut off, back, or started again (see :mod:`.hostwatch`) -----------------------------------------
    def _connected(self, node: int) -> bool:
        """Node ``node``'s launcher reached the store at some point (then an ssh failure is a lost session)."""
        try:
            return bool(self.store.check([keys.node_key(node)]))
        except (RuntimeError, OSError):
            return False

    def _fenced(self) -> bool:
        return self.lease is not None and self.lease.fenced_at is not None

    def _fence_now(self) -> None:
        """Called by the lease's watch thread when the store has been silent for the fence time."""
        for worker in self.workers.values():
            worker.send_signal(signal.SIGKILL)

    def _back_after_fence(self, lease: Lease) -> None:
        assert lease.fenced_at is not None
        self._cut_off_s = time.monotonic() - lease.fenced_at + lease.node_timeout_s / 2
        logger.warning("the store answers again (fenced %.1f s ago); waiting for the node watch to declare this "
                       "node lost before restarting its ranks", time.monotonic() - lease.fenced_at)
        self._rejoining = True
        lease.rejoin_since = time.monotonic()

    def _rejoin(self, lease: Lease) -> None:
        """Once the watch has declared this node lost, restart its unfinished ranks and record the host events."""
        if self._stop_reason is not None:
            self._rejoining = False
            return
        if not lease.declared_lost(self.store):
            if lease.waited_too_long():  # leave alone: the job (and the other launcher) must not be stopped
                self._rejoining = False
                self._stop_reason = (f"node {self.job.node_rank} is not declared lost: another launcher of this "
                                     f"node still beats, or the store is not watched")
                logger.error("giving up the rejoin: %s", self._stop_reason)
            return
        self._rejoining = False
        restarted = []
        for rank in sorted(self.workers):
            worker = self.workers[rank]
            if worker.running or keys.read_int(self.store, keys.exit_key(rank)) == 0:
                continue  # finished before the host was lost
            worker.restart_count = max(worker.restart_count, keys.read_int(self.store, keys.restarted_key(rank)) or 0)
            if worker.restart_count >= self.job.policy.max_restarts:
                logger.error("rank %d is not restarted: out of --max_restarts %d", rank, self.job.policy.max_restarts)
                continue
            self._restart(rank)
            restarted.append(rank)
        self.store.delete_key(hostwatch.node_lost_key(self.job.node_rank))
        self.store.delete_key(hostwatch.node_declare_key(self.job.node_rank))
        if self._cut_off_s is not None:
            hostwatch.record_host_event(self.store, HostPartitionedEvent, self.job.layout, self.job.node_rank,
                              cut_off_s=round(self._cut_off_s, 3), fenced_at=lease.fenced_wall)
        hostwatch.record_host_event(self.store, HostBackEvent, self.job.layout, self.job.node_rank, restarted_ranks=tuple(restarted),
                          after="partition" if self._cut_off_s is not None else "host restart")
        self._cut_off_s = None
        lease.resume()

    # ---- actions ----------------------------------------------------------------------------------------------
    def _restart(self, rank: int) -> None:
        worker = self.workers[rank]
        count = worker.restart_count + 1
        try:
            if self._store_lost:
                raise OSError("the store of node 0 is gone")
            self.store.set(keys.restarted_key(rank), str(count))
            self.store.delete_key(keys.exit_key(rank))  # the key means "this rank's process is gone"
        except (RuntimeError, OSError) as err:
            logger.error("could not record the restart of rank %d in the store: %s", rank, err)
        worker.start(count, {"DS_RECYCLE_RESTART_COUNT": str(count), "TORCHELASTIC_RESTART_COUNT": str(count),
                             **self._note_generation(rank)})
        logger.info("restarted rank %d as pid %s (restart %d)", rank, worker.pid, count)

    def _stop(self, reason: str) -> None:
        """Stop the whole job: tell the other nodes, SIGTERM every worker, SIGKILL after the kill grace."""
        self._stop_reason = reason
        self._restart_at.clear()
        self._error_deadline = None
        logger.warning("stopping the job: %s", reason)
        try:
            if not self._store_lost and not self.store.check([keys.STOP_KEY]):
                self.store.set(keys.STOP_KEY, f"node {self.job.node_rank}: {reason}")
        except (RuntimeError, OSError):
            pass
        self._send_all(signal.SIGTERM)  # remote launchers stop their own workers when they see the stop key
        self._kill_at = time.monotonic() + self.job.policy.kill_grace_s
        self._remote_kill_at = self._kill_at + _STOP_KEY_POLL_S + _REMOTE_SLACK_S

    def _send_all(self, sig: signal.Signals, remotes: bool = False) -> None:
        """Signal every rank worker of this node, and with ``remotes`` the ssh sessions of the other nodes."""
        for worker in [*self.workers.values(), *(self.remotes if remotes else ())]:
            worker.send_signal(sig)

    # ---- the end ----------------------------------------------------------------------------------------------
    def _final_codes(self) -> dict[int, int | None]:
        final: dict[int, int | None] = {}
        for exit in self.exits:
            if exit.rank is not None:
                final[exit.rank] = exit.returncode
        if self.remotes or self.others:  # node 0 of a multi-host job: the other nodes' ranks come from the store
            for rank in range(self.job.layout.world_size):
                if rank not in final:
                    final[rank] = self._stored_code(rank)
        return final

    def _stored_code(self, rank: int) -> int | None:
        try:
            return keys.read_int(self.store, keys.exit_key(rank))
        except (RuntimeError, OSError, ValueError):
            return None

    def _record_job_over(self, status: int) -> None:
        """On etcd every launcher reports the job: once every rank has exited, or the job was stopped as a whole,
        the namespace holds a job that is over (a launcher that only gave up on it leaves it as it is)."""
        everyone = [keys.exit_key(r) for r in range(self.job.layout.world_size)]
        try:
            if self.store.check(everyone) or self.store.check([keys.STOP_KEY]):
                self.store.set(keys.JOB_OVER_KEY, str(status))
        except (RuntimeError, OSError) as err:
            logger.warning("could not record the end of the job in the store: %s", err)

    def _report(self) -> int:
        final = self._final_codes()
        status = job_status(final, self.job.policy.strict, require_finished=self.hosts_store or self.others is not None)
        if self._stop_reason is not None:  # a job that had to be stopped did not complete
            status = max(status, 1)
        if self._signal is not None:
            status = 128 + int(self._signal)
        if self.others is not None and self.job.store is not None and not self.hosts_store_lost():
            self._record_job_over(status)
        for exit in sorted(self.exits, key=lambda e: (e.rank is None, e.rank or 0, e.restart_count)):
            logger.info("summary: %s", exit.describe())
        kinds = [ExitKind.ERROR if code is None else exit_kind(code) for code in final.values()]
        logger.log(logging.INFO if status == 0 else logging.ERROR,
                   "job %s with status %d: %d rank(s) finished, %d lost, %d failed%s",
                   "succeeded" if status == 0 else "failed", status, kinds.count(ExitKind.FINISHED),
                   kinds.count(ExitKind.LOST), kinds.count(ExitKind.ERROR),
                   f" (stopped: {self._stop_reason})" if self._stop_reason else "")
        return status

