"""What every simulated system shares: its context, its node bookkeeping, its state-machine hooks.

A system reacts to three things: the job start (the nodes present at time 0), a node removed (it
fails at once) and a node ready (added by the trace, usable `node_start_s` later). It can schedule its
own timed callbacks (a rejoin after a state copy). Before any hook runs, the simulator has advanced
the system's ledger to the hook's time, so a hook only changes state: pause, rate, loss.
"""
from __future__ import annotations

import abc
import enum
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ds_recycle.cluster.assumptions import Assumptions
from ds_recycle.cluster.ledger import CheckpointPolicy, Ledger, Phase
from ds_recycle.cluster.timing import PipelineTimer

__all__ = ["SystemKind", "SimContext", "System", "EventQueue"]


class SystemKind(enum.Enum):
    """The systems the simulator compares (the `--systems` names)."""

    RECYCLE = "recycle"
    """ReCycle: re-route to data-parallel peers, planner-made adapted schedules."""
    RECYCLE_REPARTITION = "recycle-repartition"
    """ReCycle, then layers moved between neighbouring stages while a failure lasts (beyond the paper)."""
    OOBLECK = "oobleck"
    """Oobleck: re-instantiate heterogeneous pipelines from templates, redistribute the batch."""
    BAMBOO = "bamboo"
    """Bamboo: redundant computation on the predecessor node; failover, restart on adjacent losses."""
    CHECKPOINT = "checkpoint"
    """Checkpoint-restart (DeepSpeed, torchrun): roll back, restart, shrink or wait for nodes."""
    DROP = "drop"
    """Replica dropping as torchft does: pipelines with a failed node leave, the batch shrinks."""
    RECOVER = "recover"
    """Replica dropping with the lost replicas' quotas redistributed to survivors, as ReCoVer does."""


class EventQueue:
    """Timed callbacks in time order (ties in insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def push(self, t: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), callback))

    def pop(self) -> tuple[float, Callable[[float], None]]:
        t, _, callback = heapq.heappop(self._heap)
        return t, callback

    def __bool__(self) -> bool:
        return bool(self._heap)

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf


@dataclass
class SimContext:
    """What a system may use: the planner-backed timer, the assumptions, its queue."""

    timer: PipelineTimer
    assumptions: Assumptions
    queue: EventQueue


class System(abc.ABC):
    """A fault-tolerance system as a state machine over node events; see the module docstring."""

    kind: ClassVar[SystemKind]

    def __init__(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self.timer = ctx.timer
        self.a = ctx.assumptions
        self.shape = ctx.timer.shape
        self.idle: list[str] = []
        self.ledger = Ledger(self.reference_rate(), self.checkpoint_policy())
        self.notes: list[tuple[float, str]] = []

    # -- what the subclasses define ---------------------------------------------------------------
    @abc.abstractmethod
    def reference_rate(self) -> float:
        """Samples/s of this system with every node up: the effective-time fraction's reference."""

    @abc.abstractmethod
    def start(self, t: float, nodes: Sequence[str]) -> None:
        """The job starts on `nodes`."""

    @abc.abstractmethod
    def on_remove(self, t: float, node: str) -> None:
        """`node` fails at `t`."""

    @abc.abstractmethod
    def on_ready(self, t: float, node: str) -> None:
        """`node` can take work from `t`."""

    # -- shared helpers -------------------------------------------------------------------------------
    def checkpoint_policy(self) -> CheckpointPolicy | None:
        return CheckpointPolicy(self.a.checkpoint_interval_s, self.a.checkpoint_cost_s)

    def note(self, t: float, text: str) -> None:
        self.notes.append((t, text))

    def full_batch_rate(self, stages: int, pipelines: int) -> tuple[float, float]:
        """(samples/s, iteration s) of the baseline schedule keeping the global batch of D x M
        micro-batches on `pipelines` pipelines of `stages` nodes (gradient accumulation)."""
        if pipelines < 1:
            return 0.0, math.inf
        m = math.ceil(self.shape.pipelines * self.shape.microbatches / pipelines)
        it = self.timer.baseline_iteration_s(stages, pipelines, m)
        return self.timer.samples_per_iteration / it, it

    def restart(self, extra_s: float = 0.0) -> None:
        """Pause for a restart from the checkpoint (launch, init, load) plus `extra_s`."""
        self.ledger.pause(Phase.RESTARTING, self.a.restart_s + extra_s)

    def reconfigure(self, seconds: float) -> None:
        self.ledger.pause(Phase.RECONFIGURING, seconds)
