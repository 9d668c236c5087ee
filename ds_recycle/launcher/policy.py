"""What the launcher does when a worker exits, and the job's exit status: plain functions over exit codes.

The rule (``--strict`` off, the default):

* exit code 0: the worker finished; the others carry on.
* killed by a signal, or exit code 75 (:data:`~ds_recycle.launcher.worker.LOST_EXIT_CODE`): the worker is
  *lost*, a tolerated failure. The others are never signalled because of it: surviving it is their job. With
  ``--restart_failed_after S`` the rank is started again S seconds later (at most ``--max_restarts`` times);
  without it, the rank stays down until ``ds-recycle restart`` asks for it (:mod:`.restart_requests`).
* any other non-zero code: an *error*. The job has failed. The others get ``--error_grace`` seconds to exit by
  themselves (a survivor that notices may save state and exit), then SIGTERM, then SIGKILL ``--kill_grace``
  seconds later. Why stop them at all: a rank-local error (a bad path, a bug on one rank) would otherwise leave
  the other ranks blocked in their next collective until its timeout (30 minutes for DeepSpeed's groups). Why
  not stop them at once: the survivors may notice by themselves, and their own report is the better one. A
  worker that fails for a reason the job should survive (e.g. a device error it caught) should exit with code
  75 so that it counts as lost, not as an error.

With ``--strict`` (what `deepspeed` and `torchrun` do), any non-zero exit stops every other worker at once.

The job's status is 0 when no rank ended in an error (with ``--strict``: no rank ended other than finished)
and at least one rank finished; 1 otherwise. A rank's *final* exit counts, so a lost rank that was restarted
and then finished counts as finished. A rank with no recorded exit (its node never started) counts as an error.
A job that was stopped (``--strict``, an error, a request in ``ds_recycle/stop``, a lost store) has status
1 on every node, since it did not complete; when the launcher itself is stopped by SIGINT/SIGTERM, its status
is 128 + the signal number.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from ds_recycle.launcher.worker import ExitKind, WorkerExit, exit_kind

__all__ = ["ExitPolicy", "Action", "decide", "job_status"]


@dataclass(frozen=True)
class ExitPolicy:
    """The launcher's failure options (see the module docstring for the rule they parameterize)."""

    strict: bool = False
    """Any worker death or error stops the whole job at once (vanilla launcher semantics)."""
    error_grace_s: float = 30.0
    """After an error exit, seconds the other workers get to exit by themselves before SIGTERM."""
    kill_grace_s: float = 5.0
    """Seconds between the SIGTERM of a stop and the SIGKILL of whatever still runs."""
    restart_after_s: float | None = None
    """Start a lost rank again after this many seconds; None: never restart."""
    max_restarts: int = 3
    """Restarts allowed per rank."""

    def __post_init__(self) -> None:
        for name in ("error_grace_s", "kill_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is negative; give 0 or more seconds")
        if self.restart_after_s is not None and self.restart_after_s < 0:
            raise ValueError(f"--restart_failed_after {self.restart_after_s} is negative; give 0 or more seconds")
        if self.max_restarts < 0:
            raise ValueError(f"--max_restarts {self.max_restarts} is negative; give 0 or more")


class Action(enum.Enum):
    """What the supervisor does after one worker's exit."""

    CONTINUE = "continue"
    """Nothing: the other workers carry on."""
    RESTART = "restart"
    """Start the same rank again after ``restart_after_s``."""
    STOP_NOW = "stop now"
    """SIGTERM every other worker now (``--strict``)."""
    STOP_AFTER_GRACE = "stop after grace"
    """The job failed; SIGTERM the others if they are still running ``error_grace_s`` from now."""


def decide(exit: WorkerExit, policy: ExitPolicy) -> Action:
    """The supervisor's reaction to ``exit`` (``exit.restart_count`` restarts of that rank happened before)."""
    kind = exit_kind(exit.returncode)
    if kind is ExitKind.FINISHED:
        return Action.CONTINUE
    if policy.strict:
        return Action.STOP_NOW
    if kind is ExitKind.ERROR:
        return Action.STOP_AFTER_GRACE
    can_restart = policy.restart_after_s is not None and exit.rank is not None
    return Action.RESTART if can_restart and exit.restart_count < policy.max_restarts else Action.CONTINUE


def job_status(final: Mapping[int, int | None], strict: bool, require_finished: bool = True) -> int:
    """0 or 1 from each rank's final return code (None: no exit was recorded for that rank)."""
    if any(code is None for code in final.values()):
        return 1
    kinds = [exit_kind(code) for code in final.values() if code is not None]
    if ExitKind.ERROR in kinds or (strict and ExitKind.LOST in kinds):
        return 1
    if require_finished and ExitKind.FINISHED not in kinds:
        return 1
    return 0
