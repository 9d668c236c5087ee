"""Fault injection in a running engine: the faults aimed at this worker, fired where the engine reaches them.

The failure handler installs :meth:`Faults.hooks` in the engine only on a worker that a fault is aimed at
(:attr:`Faults.armed`): every other worker runs the production failure check alone, with no fault lookups per
instruction. The specs themselves are :mod:`ds_recycle.resilience.faults`.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import PipeInstruction

from ds_recycle.engine import instructions as ins
from ds_recycle.engine.driver import EngineHooks
from ds_recycle.resilience.faults import JOIN_PHASES, FaultInjector, FaultSpec, Phase
from ds_recycle.resilience.store import StoreKeys

if TYPE_CHECKING:
    from ds_recycle.config.job import JobConfig
    from ds_recycle.engine.engine import RecyclePipelineEngine

__all__ = ["Faults", "fault_key", "faults_of", "kill_time", "slowdowns_of"]


def faults_of(cfg: JobConfig) -> list[FaultSpec]:
    """The config's ``recycle.faults`` that kill, as fault specs."""
    return [FaultSpec(f.worker[0], f.worker[1], f.iteration, Phase(f.phase)) for f in cfg.recycle.faults
            if f.slow is None]


def slowdowns_of(cfg: JobConfig) -> list[tuple[tuple[int, int], int, float]]:
    """The config's ``recycle.faults`` that slow a worker down: ``(worker, from iteration, factor)``."""
    return [(f.worker, f.iteration, f.slow) for f in cfg.recycle.faults if f.slow is not None]


def fault_key(keys: StoreKeys, rank: int) -> str:
    """Where a worker killed by injection writes the Unix time of its kill (recovery measures from it)."""
    return f"{keys.root}/fault/{rank}"


def kill_time(store: dist.Store, keys: StoreKeys, rank: int) -> float | None:
    """The Unix time at which ``rank`` killed itself by injection (None: it did not, or not in this generation)."""
    key = fault_key(keys, rank)
    return float(store.get(key)) if store.check([key]) else None


_PHASES: dict[type, Phase] = {
    ins.ForwardMicroBatch: Phase.FORWARD, ins.BackwardInput: Phase.BACKWARD_INPUT,
    ins.BackwardWeight: Phase.BACKWARD_WEIGHT, ins.SendActivationTo: Phase.SEND, ins.SendGradTo: Phase.SEND,
    ins.RecvActivationFrom: Phase.RECEIVE, ins.RecvGradFrom: Phase.RECEIVE,
    ins.StaggeredOptimizerStep: Phase.ALL_REDUCE,
}
"""The phase each instruction enters (the optimizer step's is :meth:`EngineHooks.before_step`)."""


class Faults:
    """The faults aimed at this worker in this life, fired when the engine reaches their moment.

    A fault of a training phase fires in the worker's first life only (a restarted worker must not die again at
    the same spot); a fault of a join phase fires in the life its iteration names (a joiner's admission). Before
    it kills, the worker writes the time of its kill to the store (:func:`kill_time`).
    """

    def __init__(self, specs: Iterable[FaultSpec], worker: tuple[int, int], life: int, store: dist.Store,
                 keys: StoreKeys, rank: int, engine: RecyclePipelineEngine,
                 slowdowns: Iterable[tuple[tuple[int, int], int, float]] = ()) -> None:
        specs = list(specs)
        self.slowdowns = sorted((it, factor) for w, it, factor in slowdowns if w == worker and not life)
        """``(iteration, factor)`` this worker's accelerator turns slow at, first life only (a restarted worker
        runs on a fresh one)."""
        self.training = FaultInjector([] if life else specs, *worker)
        self.joining = FaultInjector([f for f in specs if f.phase in JOIN_PHASES and f.iteration == life], *worker)
        self.store, self.keys, self.rank, self.engine = store, keys, rank, engine
        self.joined_at: int | None = None
        """The iteration at which this life joined the running job (its first forward fires ``join-first-iteration``)."""

    @property
    def armed(self) -> bool:
        """Some fault is aimed at this worker in this life."""
        return bool(self.training.pending or self.joining.pending or self.slowdowns)

    def fire(self, phase: Phase) -> None:
        """The engine enters ``phase`` of its current iteration: kill this worker if a fault says so."""
        if phase is Phase.FORWARD and self.joined_at is not None and self.engine.iteration == self.joined_at:
            self.fire_join(Phase.JOIN_FIRST_ITERATION)
        it = self.engine.iteration
        while self.slowdowns and self.slowdowns[0][0] <= it:
            self.engine.throttle = self.slowdowns.pop(0)[1]
        if any(f.iteration == it and f.phase is phase for f in self.training.pending):
            self.store.set(fault_key(self.keys, self.rank), repr(time.time()))
            self.training.reached(it, phase)

    def fire_join(self, phase: Phase) -> None:
        """This joiner reaches ``phase`` of its admission."""
        if any(f.phase is phase for f in self.joining.pending):
            self.store.set(fault_key(self.keys, self.rank), repr(time.time()))
            self.joining.reached(self.joining.pending[0].iteration, phase)

    def hooks(self, check: EngineHooks) -> EngineHooks:
        """``check`` (the failure check before each instruction), then the faults' phases."""
        return _FaultHooks(check, self)

    def is_last_w(self, mb: Any) -> bool:
        """Whether ``mb``'s W is this worker's last of the iteration (looked at only while such a fault waits)."""
        it = self.engine.iteration
        if not any(f.iteration == it and f.phase is Phase.LAST_BACKWARD_WEIGHT for f in self.training.pending):
            return False
        ws = [cmd.kwargs["micro_batch"] for step in self.engine._train_schedule().steps() for cmd in step
              if isinstance(cmd, ins.BackwardWeight)]
        return bool(ws) and tuple(ws[-1]) == tuple(mb)


class _FaultHooks:
    """:class:`EngineHooks` with fault injection around the production check (only where a fault is aimed)."""

    def __init__(self, check: EngineHooks, faults: Faults) -> None:
        self.check, self.faults = check, faults

    def before_instruction(self, instruction: PipeInstruction) -> None:
        self.check.before_instruction(instruction)
        phase = _PHASES.get(type(instruction))
        if phase is not None:
            self.faults.fire(phase)
            if phase is Phase.BACKWARD_WEIGHT and self.faults.is_last_w(instruction.kwargs["micro_batch"]):
                self.faults.fire(Phase.LAST_BACKWARD_WEIGHT)

    def before_step(self) -> None:
        self.check.before_step()
        self.faults.fire(Phase.OPTIMIZER_STEP)
