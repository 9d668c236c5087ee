"""The trace-driven simulation: one job, one trace, several systems side by side.

Each system is simulated on its own over the same events: trace removals at their time, trace
additions `node_start_s` later (nodes present at time 0 start the job at once), and the system's own
timed callbacks. Before each event the system's ledger is advanced to the event's time. The run ends at
`hours` (default: the trace's last event plus one mean gap between its removals, so the last failure
has its effect).

    result = simulate(trace, workload, JobShape(6, 5, 12), [SystemKind.RECYCLE, SystemKind.OOBLECK])
    result.systems[SystemKind.RECYCLE].effective_rate
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from ds_recycle.cluster.assumptions import Assumptions, ShrinkPolicy, resolve_assumptions
from ds_recycle.cluster.ledger import USEFUL, Phase, Segment
from ds_recycle.cluster.systems import SYSTEMS, EventQueue, SimContext, System, SystemKind
from ds_recycle.cluster.timing import BaselineSchedule, JobShape, PipelineTimer
from ds_recycle.cluster.trace import EventKind, Trace
from ds_recycle.cluster.workload import Workload

__all__ = ["SystemResult", "SimulationResult", "simulate", "default_hours", "job_mtbf_s"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SystemResult:
    """One system's run: its segments and the figures derived from them."""

    kind: SystemKind
    span_s: float
    reference_rate: float
    """Samples/s of this system with every node up (Bamboo: without its redundancy)."""
    segments: tuple[Segment, ...]
    notes: tuple[tuple[float, str], ...]

    @property
    def samples(self) -> float:
        return sum(s.rate * s.duration_s for s in self.segments if s.phase in USEFUL)

    @property
    def effective_rate(self) -> float:
        """Useful samples over the whole span (samples/s)."""
        return self.samples / self.span_s

    @property
    def effective_fraction(self) -> float:
        """Effective rate over the reference rate: the effective-time fraction."""
        return self.effective_rate / self.reference_rate if self.reference_rate > 0 else 0.0

    def breakdown(self) -> dict[Phase, float]:
        """Fraction of the span spent in each phase (sums to 1)."""
        out = {phase: 0.0 for phase in Phase}
        for s in self.segments:
            out[s.phase] += s.duration_s / self.span_s
        return out


@dataclass(frozen=True)
class SimulationResult:
    trace: Trace
    shape: JobShape
    workload: Workload
    assumptions: Assumptions
    span_s: float
    systems: dict[SystemKind, SystemResult]
    wall_s: float
    planner: dict[str, float] = field(default_factory=dict)

    def ratio(self, kind: SystemKind) -> float:
        """ReCycle's effective throughput over `kind`'s (inf when `kind` trained nothing)."""
        mine = self.systems[SystemKind.RECYCLE].effective_rate
        theirs = self.systems[kind].effective_rate
        return mine / theirs if theirs > 0 else math.inf


def job_mtbf_s(trace: Trace, span_s: float) -> float:
    """The trace's mean time between removals over the span (inf without removals)."""
    return span_s / trace.removals if trace.removals else math.inf


def default_hours(trace: Trace) -> float:
    """The trace's last event plus one mean gap between removals (at least one hour if none)."""
    last = trace.last_time_s
    if trace.removals == 0:
        return max(last, 3600.0) / 3600.0
    return (last + last / trace.removals) / 3600.0


def simulate(trace: Trace, workload: Workload, shape: JobShape, systems: Sequence[SystemKind], *,
             hours: float | None = None, baseline: BaselineSchedule = BaselineSchedule.ONE_F_ONE_B,
             assumptions: Assumptions | None = None,
             shrink_policy: ShrinkPolicy = ShrinkPolicy.SHRINK,
             timer: PipelineTimer | None = None,
             memory_limit: int | None = None) -> SimulationResult:
    """Run every system in `systems` over `trace` (see the module docstring). `memory_limit` caps
    the micro-batches a worker of ReCycle's adapted plans may hold (None: no limit)."""
    t0 = time.perf_counter()
    span_s = (hours if hours is not None else default_hours(trace)) * 3600.0
    if not span_s > 0:
        raise ValueError(f"--hours {hours}: the run must last. Fix: --hours > 0")
    timer = timer or PipelineTimer(workload, shape, baseline, memory_limit)
    if assumptions is None:
        assumptions = resolve_assumptions(workload, shape, job_mtbf_s(trace, span_s), shrink_policy)
    results = {kind: _run_one(kind, trace, timer, assumptions, span_s) for kind in systems}
    stats = timer.stats
    planner = {"recycle_lookups": stats.recycle_lookups, "recycle_plans": stats.recycle_plans,
               "recycle_plan_s": stats.recycle_plan_s, "baseline_plans": stats.baseline_plans,
               "baseline_plan_s": stats.baseline_plan_s}
    return SimulationResult(trace, shape, workload, assumptions, span_s, results,
                            time.perf_counter() - t0, planner)


def _run_one(kind: SystemKind, trace: Trace, timer: PipelineTimer, assumptions: Assumptions,
             span_s: float) -> SystemResult:
    queue = EventQueue()
    system = SYSTEMS[kind](SimContext(timer, assumptions, queue))
    initial = [e.node for e in trace.events if e.time_s == 0.0 and e.kind is EventKind.ADD]
    present = set(initial)
    removed_at_zero = {e.node for e in trace.events if e.time_s == 0.0 and e.kind is EventKind.REMOVE}
    system.start(0.0, [n for n in initial if n not in removed_at_zero])
    present -= removed_at_zero
    starting: set[str] = set()
    for event in trace.events:
        if event.time_s == 0.0 or event.time_s >= span_s:
            continue
        if event.kind is EventKind.REMOVE:
            queue.push(event.time_s, partial(_remove, system, present, starting, node=event.node))
        else:
            queue.push(event.time_s, partial(_add, system, queue, present, starting, assumptions,
                                              node=event.node))
    while queue and queue.peek_time() < span_s:
        t, callback = queue.pop()
        system.ledger.advance(t)
        callback(t)
    system.ledger.advance(span_s)
    return SystemResult(kind, span_s, system.reference_rate(), tuple(system.ledger.segments),
                        tuple(system.notes))


def _remove(system: System, present: set[str], starting: set[str], t: float, node: str) -> None:
    if node in starting:
        starting.discard(node)
        return
    if node in present:
        present.discard(node)
        system.on_remove(t, node)


def _add(system: System, queue: EventQueue, present: set[str], starting: set[str],
         a: Assumptions, t: float, node: str) -> None:
    starting.add(node)

    def ready(when: float) -> None:
        if node in starting:
            starting.discard(node)
            present.add(node)
            system.on_ready(when, node)

    queue.push(t + a.node_start_s, ready)
