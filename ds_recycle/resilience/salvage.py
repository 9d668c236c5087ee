"""Salvage of the interrupted iteration: keep what the survivors finished, redo only what is missing.

After a failure each member reports (through the store) what it holds of the iteration in flight: the
snapshots it could restore, whether its optimizer instruction had started, the micro-batches its stage
serves under the old plan and those whose weight gradient it has already accumulated. Every member then
computes the same decision from the same reports (:func:`decide`):

- **salvage** when every member is in the same iteration, none has started its optimizer step (the gradient
  reduction consumes the per-pipeline sums), and the new plan keeps every micro-batch a survivor served at its
  stage on that survivor (so its partial gradient sums stay whole). The result is a
  :class:`~ds_recycle.engine.schedule.Repair`: the weight gradients already accumulated stay, and the rest of
  the iteration runs as a filtered schedule of the new plan (every unfinished micro-batch is forwarded again,
  its B runs from its lowest unfinished stage up, its W only where missing);
- **redo** otherwise: every member restores the snapshot taken at the start of the iteration and runs it
  again under the new plan.

Either way no gradient is lost, doubled or half-applied: a weight gradient is accumulated once per (stage,
micro-batch), in the same per-pipeline order as in a failure-free run.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ds_recycle.engine.schedule import PlanLike, Repair
from ds_recycle.runtime.grid import WorkerMap

__all__ = ["Decision", "Report", "decide", "redo_point"]

MicroBatch = tuple[int, int]


@dataclass(frozen=True)
class Report:
    """One member's holdings after a failure."""

    earliest: int
    """Earliest iteration whose start snapshot it holds (-1: none)."""
    latest: int
    """Latest such iteration: the one it was running (or about to run)."""
    in_flight: int
    """The iteration its progress record belongs to (-1: none started)."""
    stepping: bool
    stage: int
    served: tuple[MicroBatch, ...]
    """Micro-batches its stage ran on it under the old plan, this iteration."""
    w_done: tuple[MicroBatch, ...]
    """Micro-batches whose weight gradient it has accumulated this iteration."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Report:
        raw: dict[str, Any] = json.loads(text)
        return cls(raw["earliest"], raw["latest"], raw["in_flight"], raw["stepping"], raw["stage"],
                   tuple((int(d), int(i)) for d, i in raw["served"]),
                   tuple((int(d), int(i)) for d, i in raw["w_done"]))


@dataclass(frozen=True)
class Decision:
    """What the members do with the interrupted iteration ``iteration``."""

    iteration: int
    members: tuple[int, ...]
    """The members that take part (a member without the needed snapshot leaves)."""
    repair: Repair | None
    """None: restore the snapshot of ``iteration`` and redo it whole."""
    why: str
    """Why the iteration is redone rather than salvaged (empty when salvaged)."""

    @property
    def kept_weight_gradients(self) -> int:
        return 0 if self.repair is None else sum(len(v) for v in self.repair.w_done.values())


def redo_point(held: Mapping[int, tuple[int, int]]) -> tuple[int, list[int]]:
    """The interrupted iteration, and the members that can take part: ``held`` maps each agreed member to
    the (earliest, latest) iterations whose start state it holds (-1, -1: none).

    It is the earliest iteration some member had not finished (the smallest ``latest``); a member without
    that snapshot (a worker that joined during the interrupted iteration) leaves. Every member computes the
    same answer from the same store values.
    """
    holding = {q: span for q, span in held.items() if span[1] >= 0}
    if not holding:
        raise RuntimeError(f"no member holds a snapshot to redo from: {dict(held)}")
    redo = min(latest for _, latest in holding.values())
    return redo, sorted(q for q, (earliest, latest) in holding.items() if earliest <= redo <= latest)


def decide(reports: Mapping[int, Report], new_plan: PlanLike, workers: WorkerMap, salvage: bool = True) -> Decision:
    """The members' common decision; ``reports`` and ``workers`` cover exactly the members that take part
    (see :func:`redo_point`), ``new_plan`` is the plan for their failure set. ``salvage=False``
    (``recycle.salvage``) always redoes."""
    redo = min(r.latest for r in reports.values())
    members = tuple(sorted(reports))
    why = _why_not_salvage(reports, redo, new_plan, workers) if salvage else "salvage is off (recycle.salvage)"
    if why:
        return Decision(redo, members, None, why)
    w_done: dict[int, frozenset[MicroBatch]] = {}
    for r in reports.values():
        w_done[r.stage] = w_done.get(r.stage, frozenset()) | frozenset(r.w_done)
    return Decision(redo, members, Repair(new_plan.stages, w_done), "")


def _why_not_salvage(reports: Mapping[int, Report], redo: int, new_plan: PlanLike, workers: WorkerMap) -> str:
    for q, r in reports.items():
        if r.latest != redo or r.in_flight != redo:
            return f"rank {q} is not in iteration {redo} (snapshot {r.latest}, progress of {r.in_flight})"
        if r.stepping:
            return f"rank {q} had started the optimizer step of iteration {redo}"
        worker = workers.worker_of_rank(q)
        moved = [mb for mb in r.served if new_plan.worker_of(r.stage, mb) != worker]
        if moved:
            return f"the new plan moves micro-batches {moved[:4]} of stage {r.stage} away from rank {q}"
    return ""
