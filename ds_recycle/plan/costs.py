"""The cost model: per-stage durations of F, B, W and O, the time of one point-to-point transfer, and the workers
slower than their stage (fail-slow)."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.ops import Worker

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
    slow: tuple[tuple[int, int, float], ...] = ()
    """Workers slower than their stage's costs, ``(pipeline, stage, factor)``: each of that worker's ops lasts
    ``factor`` times its stage's cost (a throttled GPU, a noisy neighbour). Sorted, one entry per worker."""

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
        slow = tuple(sorted((int(p), int(st), float(f)) for p, st, f in self.slow))
        for p, st, f in slow:
            if not 0 <= st < len(self.F) or p < 0:
                raise PlanError(f"costs.slow: worker ({p}, {st}) is outside the {len(self.F)} stages")
            if not math.isfinite(f) or f <= 0:
                raise PlanError(f"costs.slow: worker ({p}, {st}) has factor {f}: give a finite factor > 0")
        if len({(p, st) for p, st, _ in slow}) != len(slow):
            raise PlanError(f"costs.slow names a worker twice: {slow}")
        object.__setattr__(self, "slow", slow)

    @property
    def stages(self) -> int:
        """Number of stages the model describes."""
        return len(self.F)

    def of(self, kind: str, stage: int) -> float:
        """Duration of an op of ``kind`` ("F", "B", "W" or "O") at ``stage`` (on a worker of normal speed)."""
        return getattr(self, kind)[stage]

    def factor(self, worker: Worker) -> float:
        """How many times its stage's costs ``worker``'s ops last (1 unless :attr:`slow` names it)."""
        for p, st, f in self.slow:
            if (p, st) == tuple(worker):
                return f
        return 1.0

    def duration(self, kind: str, worker: Worker) -> float:
        """Duration of an op of ``kind`` on ``worker``: its stage's cost times the worker's :meth:`factor`."""
        return getattr(self, kind)[worker[1]] * self.factor(worker)

    def slow_workers(self) -> dict[Worker, float]:
        """:attr:`slow` as ``{worker: factor}``."""
        return {(p, st): f for p, st, f in self.slow}

    def with_slow(self, slow: Mapping[Worker, float]) -> CostModel:
        """The same stage costs with ``slow`` as the slow workers (factors of 1 left out)."""
        return dataclasses.replace(self, slow=tuple((p, st, f) for (p, st), f in sorted(slow.items()) if f != 1.0))

    @classmethod
    def uniform(cls, stages: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, o: float = 0.0,
                comm: float = 0.0) -> CostModel:
        """The same costs at every stage."""
        if stages < 1:
            raise PlanError(f"stages = {stages}: need at least 1")
        return cls((f,) * stages, (b,) * stages, (w,) * stages, (o,) * stages, comm)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CostModel:
        """Parse the plan format's ``costs`` object; keys other than F, B, W, O, comm and slow are ignored."""
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
        slow = obj.get("slow", [])
        if not isinstance(slow, list) or not all(isinstance(e, list) and len(e) == 3 and
                                                 all(isinstance(v, (int, float)) for v in e) for e in slow):
            raise PlanError(f"costs.slow = {slow!r}: must be a list of [pipeline, stage, factor]")
        return cls(F=tuple(obj["F"]), B=tuple(obj["B"]), W=tuple(obj["W"]), O=tuple(obj["O"]), comm=obj["comm"],
                   slow=tuple((int(p), int(st), float(f)) for p, st, f in slow))

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
        out: dict[str, Any] = {"F": list(self.F), "B": list(self.B), "W": list(self.W), "O": list(self.O),
                               "comm": self.comm}
        if self.slow:
            out["slow"] = [list(e) for e in self.slow]
        return out

    def work(self, stage: int) -> float:
        """F + B + W at ``stage``: one micro-batch's compute there."""
        return self.F[stage] + self.B[stage] + self.W[stage]
