"""The :class:`Plan`: every live worker's ops in execution order, with planned times; JSON in and out."""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.ops import MicroBatch, Op, OpKind, Worker
from ds_recycle.plan.parts import check_partition

__all__ = ["Plan", "FORMAT", "SCHEDULES", "OPTIMIZERS", "format_grid", "write_plan_json"]

FORMAT = "ds-recycle-plan/1"
SCHEDULES = ("1f1b", "zb-h1", "adaptive")
OPTIMIZERS = ("staggered", "synchronous")


@dataclass(frozen=True, eq=False)
class Plan:
    """A plan in the interchange format ``ds-recycle-plan/1`` (written by :meth:`to_json`, read by :meth:`from_json`,
    its rules checked by :mod:`ds_recycle.plan.validate`).

    ``workers`` maps each live worker ``(pipeline, stage)`` to its ops in execution order. The same
    worker runs a given micro-batch at a given stage in every iteration (:meth:`worker_of`).
    """

    stages: int
    pipelines: int
    microbatches: int
    iterations: int
    optimizer: str
    memory_limit: int | None
    costs: CostModel
    failed: frozenset[Worker]
    workers: Mapping[Worker, tuple[Op, ...]]
    schedule: str = "adaptive"
    partition: tuple[int, ...] | None = None
    """The layer boundaries the plan's costs were cut at (DeepSpeed's ``PipelineModule.parts``, ``S + 1`` of
    them), when the model was re-partitioned (:mod:`ds_recycle.plan.partition`); None: the job's own."""
    _route: dict[tuple[int, MicroBatch], Worker] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_route", {})
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer = {self.optimizer!r}: use one of {OPTIMIZERS}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule = {self.schedule!r}: use one of {SCHEDULES}")
        if self.partition is not None:
            object.__setattr__(self, "partition", check_partition(self.partition, None, self.stages, "plan partition"))
        for worker, ops in self.workers.items():
            for op in ops:
                if op.kind is OpKind.F and op.iteration == 0:
                    self._route[(worker[1], op.mb)] = worker  # type: ignore[index]

    @property
    def makespan(self) -> float:
        """The largest end time of any op."""
        return max((ops[-1].end for ops in self.workers.values() if ops), default=0.0)

    @property
    def time_per_iteration(self) -> float:
        """Makespan over iterations."""
        return self.makespan / self.iterations

    def worker_of(self, stage: int, mb: MicroBatch) -> Worker:
        """The worker ``(pipeline, stage)`` that runs micro-batch ``mb`` at ``stage`` (every iteration)."""
        try:
            return self._route[(stage, tuple(mb))]  # type: ignore[index]
        except KeyError:
            raise PlanError(f"no worker runs micro-batch {tuple(mb)} at stage {stage} in this plan") from None

    def rerouted(self) -> list[tuple[Worker, MicroBatch]]:
        """``(worker, mb)`` for every micro-batch a worker runs on behalf of another pipeline."""
        return sorted((w, mb) for (s, mb), w in self._route.items() if mb[0] != w[0])

    def relabel(self, perm: Sequence[int] | Mapping[int, int]) -> Plan:
        """The same plan with pipeline ``p`` renamed ``perm[p]`` (workers, owners and failures)."""
        def mb_of(op: Op) -> MicroBatch | None:
            return None if op.mb is None else (perm[op.mb[0]], op.mb[1])
        workers = {(perm[p], s): tuple(Op(o.kind, o.iteration, mb_of(o), o.start, o.end) for o in ops)
                   for (p, s), ops in self.workers.items()}
        return Plan(self.stages, self.pipelines, self.microbatches, self.iterations, self.optimizer,
                    self.memory_limit, self.costs, frozenset((perm[p], s) for p, s in self.failed),
                    dict(sorted(workers.items())), self.schedule, self.partition)

    def to_json(self) -> dict[str, Any]:
        """The plan-format document."""
        return {**self.to_json_header(),
                "workers": [{"pipeline": p, "stage": s, "ops": [_op_json(op) for op in ops]}
                            for (p, s), ops in sorted(self.workers.items())]}

    def to_json_header(self) -> dict[str, Any]:
        """The plan-format document without its ``workers``."""
        head = {
            "format": FORMAT, "stages": self.stages, "pipelines": self.pipelines,
            "microbatches": self.microbatches, "iterations": self.iterations, "optimizer": self.optimizer,
            "memory_limit": self.memory_limit, "costs": self.costs.to_json(),
            "failed": [list(w) for w in sorted(self.failed)], "makespan": self.makespan,
        }
        if self.partition is not None:
            head["partition"] = list(self.partition)
        return head

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], schedule: str = "adaptive") -> Plan:
        """Parse a plan-format document (the format has no schedule name: pass it if known)."""
        if obj.get("format") != FORMAT:
            raise PlanError(f"format = {obj.get('format')!r}: this reader understands {FORMAT!r}")
        try:
            workers = {(int(w["pipeline"]), int(w["stage"])): tuple(_op_from_json(o) for o in w["ops"])
                       for w in obj["workers"]}
            return cls(int(obj["stages"]), int(obj["pipelines"]), int(obj["microbatches"]),
                       int(obj["iterations"]), str(obj["optimizer"]), obj["memory_limit"],
                       CostModel.from_json(obj["costs"]), frozenset((int(p), int(s)) for p, s in obj["failed"]),
                       workers, schedule, None if obj.get("partition") is None else tuple(obj["partition"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"malformed plan document: {exc!r}. Fix: follow ds-recycle-plan/1") from exc

    def grid(self, mark: tuple[Worker, int] | None = None, width: int = 24) -> str:
        """The workers x op-order grid (see :func:`format_grid`)."""
        return format_grid(self.workers, mark, width)


def write_plan_json(plan: Plan, path: str | Path) -> None:
    """Write the document of :meth:`Plan.to_json`, one line per worker, formatting each op directly.

    The text is what ``json.dumps`` writes for the same objects (floats as ``repr``), without building a
    dictionary per op: a 50,000-op plan takes a tenth of the time.
    """
    doc = plan.to_json_header()
    lines = []
    for (p, s), ops in sorted(plan.workers.items()):
        text = ", ".join(
            f'{{"kind": "O", "iter": {op.iteration}, "start": {op.start!r}, "end": {op.end!r}}}' if op.mb is None else
            f'{{"kind": "{op.kind.value}", "iter": {op.iteration}, "mb": [{op.mb[0]}, {op.mb[1]}], '
            f'"start": {op.start!r}, "end": {op.end!r}}}' for op in ops)
        lines.append(f'{{"pipeline": {p}, "stage": {s}, "ops": [{text}]}}')
    head = json.dumps(doc)[:-1]
    Path(path).write_text(head + ', "workers": [\n' + ",\n".join(lines) + "\n]}\n", encoding="utf-8")


def _op_json(op: Op) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": op.kind.value, "iter": op.iteration}
    if op.mb is not None:
        out["mb"] = list(op.mb)
    out["start"], out["end"] = op.start, op.end
    return out


def _op_from_json(obj: Mapping[str, Any]) -> Op:
    mb = obj.get("mb")
    return Op(OpKind(obj["kind"]), int(obj["iter"]), None if mb is None else (int(mb[0]), int(mb[1])),
              float(obj["start"]), float(obj["end"]))


def format_grid(workers: Mapping[Worker, Sequence[Op]], mark: tuple[Worker, int] | None = None,
                width: int = 24) -> str:
    """One row per worker (``p<pipeline>s<stage>``), its ops in order; ``>op<`` marks ``mark``.

    At most ``width`` ops per row are shown: around the marked op if any, else the first ones.
    """
    lo = 0
    if mark is not None:
        lo = max(0, mark[1] - width // 2)
    rows = []
    for worker in sorted(workers, key=lambda w: (w[1], w[0])):
        ops = workers[worker]
        cells = []
        for i in range(lo, min(len(ops), lo + width)):
            text = str(ops[i])
            cells.append(f">{text}<" if mark == (worker, i) else text)
        more = " ..." if len(ops) > lo + width else ""
        head = "... " if lo else ""
        rows.append(f"p{worker[0]}s{worker[1]} | {head}{' '.join(cells)}{more}")
    return "\n".join(rows)


def iter_ops(workers: Mapping[Worker, Iterable[Op]]) -> Iterable[tuple[Worker, Op]]:
    """Every ``(worker, op)`` of a plan."""
    for worker, ops in workers.items():
        for op in ops:
            yield worker, op
