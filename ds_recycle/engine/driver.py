"""The engine's hook surface: who runs its entry points, what it checks before each instruction, and how a new
membership epoch is installed in it.

A :class:`~ds_recycle.engine.engine.RecyclePipelineEngine` runs ``train_batch``, ``eval_batch``, checkpoints,
``finish`` and ``close`` through its :class:`Driver`. Without failure handling (``torchrun``, ``deepspeed``)
that is a :class:`LocalDriver`: the calls run as they are. Under ``ds-recycle launch`` it is the failure
handler (:class:`ds_recycle.resilience.handler.FailureHandler`), which runs the same calls through failures.
The handler changes the engine only through three calls:

- :meth:`~ds_recycle.engine.engine.RecyclePipelineEngine.install_epoch` with an :class:`EpochSetup` (the
  members' workers, the plan, the grid and the transport of a membership epoch);
- :meth:`~ds_recycle.engine.engine.RecyclePipelineEngine.attach_hooks` with :class:`EngineHooks` (a check
  before each instruction, and one before each optimizer step);
- :meth:`~ds_recycle.engine.engine.RecyclePipelineEngine.begin_repair` (what is left of the interrupted
  iteration), and the stage-state transfers of a rejoin or a roll-forward.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.schedule import PipeInstruction

from ds_recycle.engine.state import gather_state_dict
from ds_recycle.engine.transport import Transport
from ds_recycle.events import Event

__all__ = ["Driver", "EngineHooks", "EpochSetup", "LocalDriver"]

T = TypeVar("T")


class EngineHooks(Protocol):
    """Checks the engine runs as it goes (each may raise to stop the iteration)."""

    def before_instruction(self, instruction: PipeInstruction) -> None:
        """Before every instruction of a schedule."""
        ...

    def before_step(self) -> None:
        """Before the stage's optimizer step, once its gradients are reduced."""
        ...


@dataclass(frozen=True)
class EpochSetup:
    """What a membership epoch changes in the engine."""

    workers: Any
    """The members' :class:`~ds_recycle.runtime.grid.WorkerMap`."""
    plan: Any
    """The plan for their failure set."""
    grid: Any
    """The grid DeepSpeed and the module read (a :class:`~ds_recycle.runtime.grid.SurvivorGrid`)."""
    transport: Transport
    """The epoch's transport."""
    reporter: int | None = None
    """The rank that holds the loss and writes the metrics, when the members agreed on it (a joiner learns it
    from its ticket); None: the engine's stays, unless it left the last stage."""


class Driver(Protocol):
    """Runs the engine's entry points (see the module docstring)."""

    def train_batch(self) -> torch.Tensor:
        """One iteration; its mean loss on every live rank."""
        ...

    def run(self, action: Callable[[], T], what: str) -> T:
        """``action()`` at the current iteration boundary (an evaluation pass)."""
        ...

    def save_checkpoint(self, directory: str, next_iteration: int, write: Callable[[], None] | None,
                        latest: Callable[[], None] | None, named_by_engine: bool) -> None:
        """Each stage's first live replica calls ``write``, then one rank ``latest``; ``None``: ds_recycle's own
        layout. ``named_by_engine``: called by ``engine.save_checkpoint`` (DeepSpeed's layout)."""
        ...

    @property
    def joined_at(self) -> int | None:
        """The iteration at which this process joined a running job (None: it started with the job)."""
        ...

    def resumed_at(self, start: int | None, directory: str) -> None:
        """Training resumes from a checkpoint in ``directory`` at ``start`` (None: none was there)."""
        ...

    def finish(self, keep_final_state: bool = False) -> None:
        """Training is over: the last step is final on every member (``keep_final_state``: for
        :meth:`gather_final_state`, kept before the members agree that training ended)."""
        ...

    def drain_events(self) -> list[Event]:
        """The events since the last call."""
        ...

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        """Every stage's parameters on the reporter (None elsewhere)."""
        ...

    def close(self) -> None:
        """Release the job's groups (once, at the end)."""
        ...


class _Engine(Protocol):
    """What :class:`LocalDriver` uses of the engine."""

    loss: torch.Tensor
    transport: Transport
    workers: Any
    module: torch.nn.Module
    stage_id: int
    global_rank: int
    reporter_rank: int

    def run_iteration(self) -> torch.Tensor | None: ...

    def finish_local(self) -> Any: ...

    def finish_step(self) -> None: ...


class LocalDriver:
    """No failure handling: every call runs as it is, on ``torch.distributed``'s groups."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    def train_batch(self) -> torch.Tensor:
        self.engine.run_iteration()
        return self.engine.loss

    def run(self, action: Callable[[], T], what: str) -> T:
        return action()

    def save_checkpoint(self, directory: str, next_iteration: int, write: Callable[[], None] | None,
                        latest: Callable[[], None] | None, named_by_engine: bool) -> None:
        if write is None or latest is None:
            raise RuntimeError("checkpoints in ds_recycle's own layout are written under ds-recycle launch; "
                               "use engine.save_checkpoint (DeepSpeed's layout)")
        eng = self.engine
        eng.finish_step()
        if eng.global_rank == eng.workers.stage_ranks(eng.stage_id)[0]:
            write()
        eng.transport.barrier("checkpoint barrier")
        if eng.global_rank == min(eng.workers.ranks.values()):
            latest()
        eng.transport.barrier("checkpoint barrier")

    @property
    def joined_at(self) -> int | None:
        return None

    def resumed_at(self, start: int | None, directory: str) -> None:
        return None

    def finish(self, keep_final_state: bool = False) -> None:
        self.engine.finish_local()

    def drain_events(self) -> list[Event]:
        return []

    def gather_final_state(self) -> dict[str, torch.Tensor] | None:
        eng = self.engine
        eng.finish_local()
        return gather_state_dict(eng.module, contributes=eng.global_rank == eng.workers.stage_ranks(eng.stage_id)[0],
                                 dst=eng.reporter_rank)

    def close(self) -> None:
        self.engine.finish_local()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
