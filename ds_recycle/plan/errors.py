"""Errors of the planner: one base class, one subclass per way a plan can be impossible or wrong."""
from __future__ import annotations

__all__ = ["PlanError", "StageLostError", "PlanValidationError", "DeadlockError"]


class PlanError(ValueError):
    """A plan cannot be made, parsed or run as asked. The message names the value and the fix."""


class StageLostError(PlanError):
    """Every worker of a stage has failed: re-routing is impossible, only a checkpoint can recover."""

    def __init__(self, stage: int, pipelines: int) -> None:
        self.stage = stage
        super().__init__(
            f"every one of the {pipelines} workers of stage {stage} has failed: no live peer holds its "
            f"parameters, so re-routing cannot continue. Fix: fall back to the last checkpoint "
            f"(or keep at least one live worker per stage)")


class PlanValidationError(PlanError):
    """A plan breaks a rule of the plan format. ``rule`` is its number, ``op`` the failing op's text."""

    def __init__(self, rule: int, message: str, op: str | None = None, picture: str = "") -> None:
        self.rule, self.op = rule, op
        text = f"rule {rule}: {message}"
        if picture:
            text += "\n" + picture
        super().__init__(text)


class DeadlockError(PlanError):
    """The per-worker op orders cannot all run to the end: each stuck worker waits on another."""
