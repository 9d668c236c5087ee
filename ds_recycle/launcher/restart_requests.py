"""Restarts on command, as data and plain functions: when a launcher may restart a rank it is asked to restart.

``ds-recycle restart RANK`` writes a request into the job's store (:mod:`ds_recycle.runtime.job_store`); the
launcher that runs RANK answers it within one store poll (0.25 s) by restarting the rank at once, through the
same path as a timed ``--restart_failed_after`` restart, or by refusing. :func:`judge_restart_request` is the
rule; the answer travels back as a :class:`RestartResult`.

The rule: a rank is restarted on command iff its process is gone because it was *lost* (killed by a signal, or
exit code 75), no timed restart of it is already due, the job is not being stopped, and it has been restarted
fewer than ``--max_restarts`` times (timed and commanded restarts count together). Everything else is refused
with a :class:`Refusal` and a sentence that says why and what would work.
"""
from __future__ import annotations

import enum
import json
import os
import socket
import time
from dataclasses import dataclass

from ds_recycle.launcher.policy import ExitPolicy
from ds_recycle.launcher.worker import ExitKind, WorkerExit, describe_returncode

__all__ = ["RankState", "Refusal", "RestartResult", "explain_refusal", "judge_restart_request", "new_request_id"]


class Refusal(enum.Enum):
    """Why a launcher did not restart a rank it was asked to restart."""

    RUNNING = "running"
    """The rank's process is running (or has not been started yet): there is nothing to restart."""
    RESTART_DUE = "restart due"
    """A timed restart (``--restart_failed_after``) of the rank is already scheduled."""
    FINISHED = "finished"
    """The rank's program completed (exit code 0); a finished rank is not started again."""
    FAILED = "failed"
    """The rank ended in an error exit, which fails the job; only lost ranks are restarted."""
    OUT_OF_RESTARTS = "out of restarts"
    """The rank has been restarted ``--max_restarts`` times already."""
    JOB_STOPPING = "job stopping"
    """The job is being stopped (a stop request, ``--strict``, an error's grace period, a signal)."""


@dataclass(frozen=True)
class RankState:
    """What a launcher knows about one of its ranks when a restart request for it arrives."""

    rank: int
    running_pid: int | None
    """The pid of the rank's running process; None when no process of the rank runs."""
    last_exit: WorkerExit | None
    """The rank's latest exit; None when it has not exited since it was (last) started, or never started."""
    restart_count: int
    """Restarts of the rank so far (timed and commanded)."""
    restart_due_in_s: float | None = None
    """Seconds until a timed restart of the rank; None when none is scheduled."""
    job_stopping: str | None = None
    """Why the job is being stopped or is failing; None while it runs normally."""


def judge_restart_request(state: RankState, policy: ExitPolicy) -> Refusal | None:
    """None when the rank must be restarted now; otherwise why not (checked in the order of :class:`Refusal`)."""
    if state.running_pid is not None or state.last_exit is None:
        return Refusal.RUNNING
    if state.restart_due_in_s is not None:
        return Refusal.RESTART_DUE
    kind = state.last_exit.kind
    if kind is ExitKind.FINISHED:
        return Refusal.FINISHED
    if kind is ExitKind.ERROR:
        return Refusal.FAILED
    if state.restart_count >= policy.max_restarts:
        return Refusal.OUT_OF_RESTARTS
    if state.job_stopping is not None:
        return Refusal.JOB_STOPPING
    return None


def explain_refusal(refusal: Refusal, state: RankState, policy: ExitPolicy) -> str:
    """One sentence for the user: the state that caused ``refusal`` and what would work instead."""
    rank, last = state.rank, state.last_exit
    how = describe_returncode(last.returncode) if last is not None else "no exit"
    if refusal is Refusal.RUNNING:
        where = f"as pid {state.running_pid}" if state.running_pid is not None else "(not started yet)"
        return f"rank {rank} is running {where}; only a rank whose process is gone can be restarted"
    if refusal is Refusal.RESTART_DUE:
        return (f"rank {rank} is restarted automatically in {state.restart_due_in_s or 0.0:.1f} s "
                f"(--restart_failed_after); wait for it")
    if refusal is Refusal.FINISHED:
        return f"rank {rank} finished ({how}); a finished rank is not started again"
    if refusal is Refusal.FAILED:
        return (f"rank {rank} ended in an error ({how}), which fails the job; only a lost rank (killed by a "
                f"signal, or exit code 75) is restarted")
    if refusal is Refusal.OUT_OF_RESTARTS:
        return (f"rank {rank} was restarted {state.restart_count} time(s) already, the limit of this job "
                f"(--max_restarts {policy.max_restarts}); start the job with a higher --max_restarts")
    return f"the job is being stopped ({state.job_stopping}); no rank is restarted"


@dataclass(frozen=True)
class RestartResult:
    """A launcher's answer to one restart request, stored as JSON at ``ds_recycle/restart_result/<rank>``."""

    request_id: str
    """The id the request was written with; a requester reads only the answer that carries its own id."""
    rank: int
    refusal: Refusal | None
    """None: the rank was restarted."""
    message: str
    """What happened, in one sentence (the refusal's reason, or the new process)."""
    pid: int | None = None
    """The pid of the restarted process (None when refused)."""
    restart_count: int = 0
    """The rank's restart count after the answer."""

    @property
    def restarted(self) -> bool:
        return self.refusal is None

    def encode(self) -> str:
        return json.dumps({"request_id": self.request_id, "rank": self.rank,
                           "refusal": None if self.refusal is None else self.refusal.value,
                           "message": self.message, "pid": self.pid, "restart_count": self.restart_count})

    @classmethod
    def decode(cls, text: str) -> RestartResult:
        """Parse :meth:`encode`'s output; ValueError naming the text when it is not a restart result."""
        try:
            data = json.loads(text)
            refusal = None if data["refusal"] is None else Refusal(data["refusal"])
            return cls(str(data["request_id"]), int(data["rank"]), refusal, str(data["message"]),
                       None if data["pid"] is None else int(data["pid"]), int(data["restart_count"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"not a restart result: {text!r} ({err})") from err


def new_request_id() -> str:
    """A request id unique across requesters: ``host:pid:nanoseconds``."""
    return f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
