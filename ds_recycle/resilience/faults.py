"""Deterministic fault injection: kill worker (pipeline, stage) at iteration N in a chosen phase.

A fault is written ``PIPELINE:STAGE@ITERATION:PHASE`` on the command line (``--kill 1:0@5:forward``) or
``{"worker": [1, 0], "iteration": 5, "phase": "forward"}`` in the config. The engine calls
:meth:`FaultInjector.reached` as it enters each phase; the matching worker then dies by ``SIGKILL``,
exactly as a crashed process would (no clean-up, no goodbye to its peers).

Pure: the specs and their parsing. :mod:`ds_recycle.resilience.injection` fires them in a running engine.
"""
from __future__ import annotations

import enum
import logging
import os
import re
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["parse_slow", "JOIN_PHASES", "FaultInjector", "FaultSpec", "Phase", "parse_fault"]


class Phase(enum.Enum):
    """Where in an iteration a worker can be killed."""

    FORWARD = "forward"
    """While computing a forward pass (F)."""
    BACKWARD_INPUT = "backward-input"
    """While computing an input gradient (B)."""
    BACKWARD_WEIGHT = "backward-weight"
    """While computing weight gradients (W)."""
    LAST_BACKWARD_WEIGHT = "last-backward-weight"
    """At the worker's last W of the iteration (in a zero-bubble plan the last stages' deferred W's run while
    the first stage may have stepped already)."""
    SEND = "send"
    """While sending an activation or a gradient to a peer."""
    RECEIVE = "receive"
    """While waiting to receive an activation or a gradient."""
    ALL_REDUCE = "all-reduce"
    """During the stage's gradient all-reduce over its live replicas."""
    OPTIMIZER_STEP = "optimizer-step"
    """During the optimizer step, after the all-reduce."""
    IDLE = "idle"
    """At the start of the iteration, before the worker's first operation."""
    LAYER_MOVE = "layer-move"
    """In a re-partition at the start of the iteration, its layer transfers done, before the members agree the
    move is complete (nobody installs it)."""
    LAYER_MOVED = "layer-moved"
    """In a re-partition at the start of the iteration, after the members agreed, before this worker installs its
    layers (the others install theirs)."""
    END_OF_TRAINING = "end-of-training"
    """After the worker's last iteration (the fault's iteration is the job's number of steps), before its last
    optimizer step is final and it arrives at the end of training: the others recover and finish again."""
    ENDED = "ended"
    """After the members agreed that training is over (iteration as for ``end-of-training``), before the worker
    closes: the others end as they would have."""
    JOIN_REQUEST = "join-request"
    """A restarted worker, just after it filed its join request (for these ``join-*`` phases the fault's
    iteration is the restart count of the life in which the worker dies)."""
    JOIN_GROUPS = "join-groups"
    """A restarted worker admitted by the members, before it connects to the join's groups."""
    JOIN_TRANSFER = "join-transfer"
    """A restarted worker with its groups built, before it receives its stage's state."""
    JOIN_FIRST_ITERATION = "join-first-iteration"
    """A restarted worker that joined, at its first forward pass in the running job."""


JOIN_PHASES = frozenset({Phase.JOIN_REQUEST, Phase.JOIN_GROUPS, Phase.JOIN_TRANSFER, Phase.JOIN_FIRST_ITERATION})
"""Phases of a restarted worker's admission."""


@dataclass(frozen=True)
class FaultSpec:
    """Kill worker ``(pipeline, stage)`` the first time it reaches ``phase`` in ``iteration``."""

    pipeline: int
    stage: int
    iteration: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.pipeline}:{self.stage}@{self.iteration}:{self.phase.value}"


_FAULT = re.compile(r"^(\d+):(\d+)@(\d+):([a-z-]+)$")


def parse_fault(text: str) -> FaultSpec:
    """Parse ``PIPELINE:STAGE@ITERATION:PHASE``; the error names what is wrong and the fix."""
    m = _FAULT.match(text.strip())
    phases = ", ".join(p.value for p in Phase)
    if not m:
        raise ValueError(f"fault {text!r} is not PIPELINE:STAGE@ITERATION:PHASE; e.g. 1:0@5:forward "
                         f"(phases: {phases})")
    try:
        phase = Phase(m.group(4))
    except ValueError:
        raise ValueError(f"fault {text!r}: unknown phase {m.group(4)!r}; use one of {phases}") from None
    return FaultSpec(int(m.group(1)), int(m.group(2)), int(m.group(3)), phase)


_SLOW = re.compile(r"^(\d+):(\d+)@(\d+)\*(\d+(?:\.\d*)?)$")


def parse_slow(text: str) -> tuple[tuple[int, int], int, float]:
    """Parse ``PIPELINE:STAGE@ITERATION*FACTOR`` (a worker that runs FACTOR times slower from ITERATION on) into
    ``((pipeline, stage), iteration, factor)``; the error names what is wrong and the fix."""
    m = _SLOW.match(text.strip())
    if not m:
        raise ValueError(f"slowdown {text!r} is not PIPELINE:STAGE@ITERATION*FACTOR; e.g. 1:1@4*2.0")
    factor = float(m.group(4))
    if not 1.0 <= factor <= 100.0:
        raise ValueError(f"slowdown {text!r}: factor {factor} is outside [1, 100]")
    return (int(m.group(1)), int(m.group(2))), int(m.group(3)), factor


class FaultInjector:
    """Holds the faults aimed at this worker and fires the first one whose moment comes."""

    def __init__(self, faults: Iterable[FaultSpec], pipeline: int, stage: int) -> None:
        self.pending = sorted((f for f in faults if (f.pipeline, f.stage) == (pipeline, stage)),
                              key=lambda f: f.iteration)

    def reached(self, iteration: int, phase: Phase) -> None:
        """Called by the engine as it enters ``phase`` of ``iteration``; never returns if a fault matches."""
        for fault in self.pending:
            if fault.iteration == iteration and fault.phase is phase:
                logger.warning("fault injection: killing this worker (%s)", fault)
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os.kill(os.getpid(), signal.SIGKILL)

