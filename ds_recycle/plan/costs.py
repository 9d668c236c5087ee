"""The cost model: per-stage durations of F, B, W and O, and the time of one point-to-point transfer."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_recycle.plan.errors import PlanError

__all__ = ["CostModel"]

_KINDS = ("F", "B", "W", "O")


@dataclass(frozen=True)
class CostModel:
    """Durations per stage, in any one unit (seconds, milliseconds or "one forward").

    ``F``, ``B``, ``W`` and ``O`` hold one value per stage; ``comm`` is the time to move an activation or a
    gradient between two workers (the same for every pair). This is the plan format's ``costs`` object.
    """

    F: tuple[float, ...]
    B: tuple[float, ...]
    W: tuple[float, ...]
    O: tuple[float, ...]
    comm: float = 0.0

    def __post_init__(self) -> None:
        for kind in _KINDS:
            values = getattr(self, kind)
            object.__setattr__(self, kind, tuple(float(v) for v in values))
            if len(getattr(self, kind)) != len(self.F):
                raise PlanError(f"costs.{kind} has {len(values)} stages but costs.F has {len(self.F)}: "
                                f"give one value per stage for each of F, B, W, O")
            for s, v in enumerate(getattr(self, kind)):
                if not math.isfinite(v) or v < 0:
                    raise PlanError(f"costs.{kind}[{s}] = {v}: durations must be finite and >= 0")
        if not self.F:
            raise PlanError("costs.F is empty: give one value per stage")
        if not math.isfinite(self.comm) or self.comm < 0:
            raise PlanError(f"costs.comm = {self.comm}: must be finite and >= 0")
        object.__setattr__(self, "comm", float(self.comm))

    @property
    def stages(self) -> int:
        """Number of stages the model describes."""
        return len(self.F)

    def of(self, kind: str, stage: int) -> float:
        """Duration of an op of ``kind`` ("F", "B", "W" or "O") at ``stage``."""
        return getattr(self, kind)[stage]

    @classmethod
    def uniform(cls, stages: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, o: float = 0.0,
                comm: float = 0.0) -> CostModel:
        """The same costs at every stage."""
        if stages < 1:
            raise PlanError(f"stages = {stages}: need at least 1")
        return cls((f,) * stages, (b,) * stages, (w,) * stages, (o,) * stages, comm)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CostModel:
        """Parse the plan format's ``costs`` object; keys other than F, B, W, O, comm are ignored."""
        if not isinstance(obj, dict):
            raise PlanError(f"costs must be a JSON object, got {type(obj).__name__}")
        missing = [k for k in (*_KINDS, "comm") if k not in obj]
        if missing:
            raise PlanError(f"costs is missing {missing}: give per-stage lists F, B, W, O and a number comm")
        for kind in _KINDS:
            if not isinstance(obj[kind], list) or not all(isinstance(v, (int, float)) for v in obj[kind]):
                raise PlanError(f"costs.{kind} = {obj[kind]!r}: must be a list of numbers, one per stage")
        if not isinstance(obj["comm"], (int, float)):
            raise PlanError(f"costs.comm = {obj['comm']!r}: must be a number")
        return cls(F=tuple(obj["F"]), B=tuple(obj["B"]), W=tuple(obj["W"]), O=tuple(obj["O"]), comm=obj["comm"])

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        """Read a cost-profile file: the ``costs`` object alone, as JSON."""
        try:
            obj = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cost file {str(path)!r}: {exc}. Fix: give a JSON file with F, B, W, O, comm") from exc
        return cls.from_json(obj)

    def to_json(self) -> dict[str, Any]:
        """The plan format's ``costs`` object."""
        return {"F": list(self.F), "B": list(self.B), "W": list(self.W), "O": list(self.O), "comm": self.comm}

    def work(self, stage: int) -> float:
        """F + B + W at ``stage``: one micro-batch's compute there."""
        return self.F[stage] + self.B[stage] + self.W[stage]
