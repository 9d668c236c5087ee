"""The constraint-programming model of an adapted plan, solved with OR-Tools CP-SAT.

The model is the plan format itself, with the routing of orphans left to the solver:

* one fixed-size interval per F, B and W of every micro-batch, stage and iteration; a live worker keeps its
  own micro-batches (as every plan does); an orphan (a micro-batch whose own worker at that stage failed)
  gets one optional interval per live peer of the stage and a choice literal per peer, the same choice in
  every iteration (a plan runs a micro-batch at a stage on the same worker each iteration);
* one start per O group (stage and iteration; iteration alone with a synchronous optimizer), and one
  interval of that start on each live worker of the group;
* no-overlap per worker over its intervals, O included (rule 3);
* precedences with the communication delay (rule 4), O after every F, B and W of its group, every op of
  iteration k+1 after the O of iteration k on its stage (rule 5);
* with a memory limit L: one interval per held micro-batch, from the start of its F to the end of its W, on
  the worker that runs it, and a cumulative of capacity L per worker (rule 6);
* makespan ``C`` >= the end of every O, and >= :func:`bounds.best_lower_bound`; minimized.

Times are integers: costs are scaled by the smallest power of ten (up to 10^4) that makes every cost an
integer; when none does, costs are rounded at 10^4 and the result says ``rounded`` (the plan is then re-timed
with the exact costs, so it stays valid, but the proven bound is only approximate).

Symmetry: the micro-batches of one owner pipeline are interchangeable (relabel two of them, and their
routes, and nothing else changes), so the F of micro-batch i at stage 0 of iteration 0 is not later than the
F of micro-batch i+1; in later iterations too when the owner's micro-batches never leave their pipeline.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from ds_recycle.plan.bounds import stage_spans
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.ops import MicroBatch, Op, OpKey, OpKind, Worker

__all__ = ["SolverResult", "solve_cpsat", "time_scale", "PRESOLVE_MOST_OPS"]

#: CP-SAT presolves models of at most this many F, B and W ops (see solve_cpsat)
PRESOLVE_MOST_OPS = 300

logger = logging.getLogger(__name__)
_F, _B, _W, _O = OpKind.F, OpKind.B, OpKind.W, OpKind.O
_KINDS = (_F, _B, _W)


@dataclass(frozen=True)
class SolverResult:
    """The solver's answer: per-worker op orders (None if no solution), its bound, status and run time."""

    orders: dict[Worker, list[OpKey]] | None
    objective: float
    """Makespan of the solver's best solution, in the cost model's unit (inf if none)."""
    bound: float
    """The solver's proven lower bound on the makespan."""
    optimal: bool
    status: str
    seconds: float
    rounded: bool
    """Costs were rounded to integers at 10^4: ``bound`` is approximate."""


def time_scale(costs: CostModel, most: int = 10_000) -> tuple[int, bool]:
    """The smallest power of ten (<= ``most``) that makes every cost an integer; ``(most, True)`` if none."""
    values = [*costs.F, *costs.B, *costs.W, *costs.O, costs.comm]
    scale = 1
    while scale <= most:
        if all(abs(v * scale - round(v * scale)) <= 1e-9 * max(1.0, v * scale) for v in values):
            return scale, False
        scale *= 10
    return most, True


def _ceil(x: float) -> int:
    """The least integer time at or above a bound ``x`` computed in floating point (sums of scaled costs)."""
    return math.ceil(x - 1e-6 * max(1.0, abs(x)))


class _Model:
    """Variables of one instance; built by :func:`solve_cpsat`."""

    def __init__(self, stages: int, pipelines: int, microbatches: int, costs: CostModel,
                 failed: frozenset[Worker], iterations: int, synchronous: bool, memory_limit: int | None,
                 horizon: float, lower: float) -> None:
        self.S, self.D, self.M, self.K = stages, pipelines, microbatches, iterations
        self.failed, self.sync, self.limit = failed, synchronous, memory_limit
        self.scale, self.rounded = time_scale(costs)
        self.dur = {k: [round(v * self.scale) for v in getattr(costs, k.value)] for k in (_F, _B, _W, _O)}
        self.comm = round(costs.comm * self.scale)
        self.H = math.ceil(horizon * self.scale * (1 + 1e-9)) + 1
        self.m = cp_model.CpModel()
        self.start: dict[tuple[OpKind, int, int, MicroBatch], cp_model.IntVar] = {}
        self.choice: dict[tuple[int, MicroBatch, int], cp_model.IntVar] = {}
        self.candidates: dict[tuple[int, MicroBatch], list[int]] = {}
        self.intervals: dict[Worker, list[cp_model.IntervalVar]] = {}
        self.o_start: dict[tuple[int, int], cp_model.IntVar] = {}
        self.live = {s: [p for p in range(pipelines) if (p, s) not in failed] for s in range(stages)}
        self.C = self.m.new_int_var(max(0, _ceil(lower * self.scale)), self.H, "C")

    def group(self, s: int) -> int:
        return -1 if self.sync else s

    def build(self) -> None:
        self._routes()
        self._ops()
        self._optimizer()
        self._precedences()
        for ivs in self.intervals.values():
            self.m.add_no_overlap(ivs)
        if self.limit is not None:
            self._memory(self.limit)
        self._symmetry()
        self.m.minimize(self.C)

    def _routes(self) -> None:
        for s in range(self.S):
            for o in range(self.D):
                for i in range(self.M):
                    mb = (o, i)
                    if (o, s) not in self.failed:
                        self.candidates[(s, mb)] = [o]
                        continue
                    peers = self.live[s]
                    self.candidates[(s, mb)] = peers
                    lits = [self.m.new_bool_var(f"r{s}_{o}_{i}_{p}") for p in peers]
                    self.m.add_exactly_one(lits)
                    for p, lit in zip(peers, lits):
                        self.choice[(s, mb, p)] = lit
            # no balance constraint: the solver may load the peers unevenly if that is better

    def _ops(self) -> None:
        for k in range(self.K):
            for s in range(self.S):
                for o in range(self.D):
                    for i in range(self.M):
                        mb = (o, i)
                        for kind in _KINDS:
                            v = self.m.new_int_var(0, self.H, f"{kind.value}{s}_{k}_{o}_{i}")
                            self.start[(kind, s, k, mb)] = v
                            size = self.dur[kind][s]
                            for p in self.candidates[(s, mb)]:
                                lit = self.choice.get((s, mb, p))
                                name = f"i{kind.value}{s}_{k}_{o}_{i}_{p}"
                                if lit is None:
                                    iv = self.m.new_fixed_size_interval_var(v, size, name)
                                else:
                                    iv = self.m.new_optional_fixed_size_interval_var(v, size, lit, name)
                                self.intervals.setdefault((p, s), []).append(iv)

    def _optimizer(self) -> None:
        for k in range(self.K):
            for g in ((-1,) if self.sync else range(self.S)):
                self.o_start[(g, k)] = self.m.new_int_var(0, self.H, f"O{g}_{k}")
        for s in range(self.S):
            for p in self.live[s]:
                for k in range(self.K):
                    start = self.o_start[(self.group(s), k)]
                    iv = self.m.new_fixed_size_interval_var(start, self.dur[_O][s], f"iO{s}_{k}_{p}")
                    self.intervals.setdefault((p, s), []).append(iv)
                    self.m.add(self.C >= start + self.dur[_O][s])

    def cuts(self, head: list[float], span: list[float]) -> None:
        """Redundant bounds that the solver's relaxation does not see through the no-overlaps: a stage's O
        waits at least ``span_s`` (:func:`bounds.stage_spans`) after its first possible op of the iteration."""
        for s in range(self.S):
            g, least = self.group(s), _ceil(span[s] * self.scale)
            first = _ceil(head[s] * self.scale)
            self.m.add(self.o_start[(g, 0)] >= first + least)
            for k in range(1, self.K):
                self.m.add(self.o_start[(g, k)] >= self.o_start[(self.group(s), k - 1)] + self.dur[_O][s] + least)

    def _precedences(self) -> None:
        add, d, c = self.m.add, self.dur, self.comm
        for (kind, s, k, mb), v in self.start.items():
            if kind is _F and s > 0:
                add(v >= self.start[(_F, s - 1, k, mb)] + d[_F][s - 1] + c)
            elif kind is _B:
                if s < self.S - 1:
                    add(v >= self.start[(_B, s + 1, k, mb)] + d[_B][s + 1] + c)
                else:
                    add(v >= self.start[(_F, s, k, mb)] + d[_F][s])
            elif kind is _W:
                add(v >= self.start[(_B, s, k, mb)] + d[_B][s])
            add(self.o_start[(self.group(s), k)] >= v + d[kind][s])
            if k > 0:
                add(v >= self.o_start[(self.group(s), k - 1)] + d[_O][s])

    def _memory(self, limit: int) -> None:
        held: dict[Worker, list[cp_model.IntervalVar]] = {}
        for (kind, s, k, mb), f in self.start.items():
            if kind is not _F:
                continue
            end = self.m.new_int_var(0, self.H, f"h{s}_{k}_{mb[0]}_{mb[1]}")
            self.m.add(end == self.start[(_W, s, k, mb)] + self.dur[_W][s])
            size = self.m.new_int_var(0, self.H, f"hs{s}_{k}_{mb[0]}_{mb[1]}")
            for p in self.candidates[(s, mb)]:
                lit = self.choice.get((s, mb, p))
                name = f"ih{s}_{k}_{mb[0]}_{mb[1]}_{p}"
                iv = (self.m.new_interval_var(f, size, end, name) if lit is None
                      else self.m.new_optional_interval_var(f, size, end, lit, name))
                held.setdefault((p, s), []).append(iv)
        for ivs in held.values():
            self.m.add_cumulative(ivs, [1] * len(ivs), limit)

    def _symmetry(self) -> None:
        for o in range(self.D):
            moves = any((o, s) in self.failed for s in range(self.S))
            for k in range(1 if moves else self.K):
                for i in range(self.M - 1):
                    self.m.add(self.start[(_F, 0, k, (o, i))] <= self.start[(_F, 0, k, (o, i + 1))])

    def hint(self, workers: Mapping[Worker, tuple[Op, ...]]) -> None:
        """Warm start from a plan (the heuristic's), its micro-batches renamed to meet the symmetry rule."""
        name = self._names(workers)
        for (p, s), ops in workers.items():
            for op in ops:
                if op.kind is _O or op.mb is None:
                    continue
                mb = name[(op.iteration, op.mb)]
                self.m.add_hint(self.start[(op.kind, s, op.iteration, mb)], round(op.start * self.scale))
                if op.kind is _F and op.iteration == 0:
                    for q in self.candidates[(s, mb)]:
                        lit = self.choice.get((s, mb, q))
                        if lit is not None:
                            self.m.add_hint(lit, int(q == p))
        groups: dict[tuple[int, int], float] = {}
        for (_p, s), ops in workers.items():
            for op in ops:
                if op.kind is _O:
                    groups[(self.group(s), op.iteration)] = op.start
        for key, at in groups.items():
            self.m.add_hint(self.o_start[key], round(at * self.scale))
        end = max(ops[-1].end for ops in workers.values())
        self.m.add_hint(self.C, round(end * self.scale))

    def _names(self, workers: Mapping[Worker, tuple[Op, ...]]) -> dict[tuple[int, MicroBatch], MicroBatch]:
        """``(iteration, mb) -> mb'``: each owner's micro-batches numbered in the order the first stage starts
        their F (in iteration 0 for every iteration if the owner lost a worker, else per iteration), which is
        the order :meth:`_symmetry` imposes; a relabelling of interchangeable micro-batches, so still a plan."""
        first: dict[tuple[int, MicroBatch], float] = {}
        for (_p, s), ops in workers.items():
            if s == 0:
                for op in ops:
                    if op.kind is _F and op.mb is not None:
                        first[(op.iteration, op.mb)] = op.start
        name: dict[tuple[int, MicroBatch], MicroBatch] = {}
        for o in range(self.D):
            moves = any((o, s) in self.failed for s in range(self.S))
            for k in range(self.K):
                by = 0 if moves else k
                order = sorted(range(self.M), key=lambda i: (first[(by, (o, i))], i))
                for j, i in enumerate(order):
                    name[(k, (o, i))] = (o, j)
        return name

    def orders(self, solver: cp_model.CpSolver) -> dict[Worker, list[OpKey]]:
        """Every live worker's ops sorted by their solved start (O after the ops it closes)."""
        rank = {_F: 0, _B: 1, _W: 2, _O: 3}
        timed: dict[Worker, list[tuple[tuple[int, int, int], OpKey]]] = {}
        for (kind, s, k, mb), v in self.start.items():
            p = next(q for q in self.candidates[(s, mb)]
                     if (s, mb, q) not in self.choice or solver.boolean_value(self.choice[(s, mb, q)]))
            timed.setdefault((p, s), []).append(((solver.value(v), k, rank[kind]), (kind, k, mb)))
        for s in range(self.S):
            for p in self.live[s]:
                for k in range(self.K):
                    t = solver.value(self.o_start[(self.group(s), k)])
                    timed.setdefault((p, s), []).append(((t, k, rank[_O]), (_O, k, None)))
        return {w: [key for _, key in sorted(items, key=lambda x: x[0])] for w, items in sorted(timed.items())}


def solve_cpsat(stages: int, pipelines: int, microbatches: int, costs: CostModel, failed: frozenset[Worker], *,
                iterations: int, synchronous: bool, memory_limit: int | None, horizon: float, lower: float,
                hint: Mapping[Worker, tuple[Op, ...]] | None, time_limit: float, workers: int = 2,
                seed: int = 0) -> SolverResult:
    """Solve the model (see the module docstring) with makespan at most ``horizon``, at least ``lower``."""
    began = time.perf_counter()
    model = _Model(stages, pipelines, microbatches, costs, failed, iterations, synchronous, memory_limit,
                   horizon, lower)
    model.build()
    model.cuts(*stage_spans(stages, pipelines, microbatches, costs, failed, memory_limit))
    if hint is not None:
        model.hint(hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    # presolve can spend the whole limit on a larger model and lose the warm start with it (measured: no
    # solution at all in 8 s on S=4, D=8, M=4, K=2 with it; the greedy's at once without); on small ones it
    # proves memory-limited optima ~4x faster (S=2, D=2, M=3, limit 2: 0.14 s of CPU against 0.55 s)
    solver.parameters.cp_model_presolve = len(model.start) <= PRESOLVE_MOST_OPS
    status = solver.solve(model.m)
    name = solver.status_name(status)
    seconds = time.perf_counter() - began
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    bound: float = solver.best_objective_bound / model.scale if found else lower
    if status == cp_model.INFEASIBLE:  # nothing at or below the horizon: the horizon itself is the optimum
        bound = horizon
    logger.debug("CP-SAT S=%d D=%d M=%d K=%d: %s in %.2f s, objective %s, bound %.6g", stages, pipelines,
                 microbatches, iterations, name, seconds, solver.objective_value if found else None, bound)
    return SolverResult(model.orders(solver) if found else None,
                       solver.objective_value / model.scale if found else math.inf, bound,
                       status == cp_model.OPTIMAL and not model.rounded, name, seconds, model.rounded)
