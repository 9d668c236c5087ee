"""The mixed-integer model of an adapted plan, solved with HiGHS (``scipy.optimize.milp``).

Kept beside the CP-SAT model (:mod:`cpsat`, the default of :func:`exact.solve_exact`) to compare them: on
disjunctive scheduling, the big-M order binaries below give a weak linear relaxation, and HiGHS proves far
fewer instances optimal in the same time (see ``benchmarks/planner.py --only exact``).

The model keeps the greedy's routing (who runs which micro-batch: the balanced re-routing of
:mod:`routing`), and optimizes everything else exactly:

* a start time per F, B and W; one start time per O group (stage and iteration, or iteration when the
  optimizer is synchronous); the makespan ``C``, minimized;
* the dependencies of rule 4, the O rules of rule 5, and ``C >=`` every O's end;
* for every two ops of one worker and iteration, a binary order ``y`` with big-M disjunctions (rule 3);
* with a memory limit L, for every F of a worker: the micro-batches whose F started before it and whose W
  had not ended when it started number at most ``L - 1`` (rule 6), linearized over the order binaries;
* ``C <=`` the greedy's makespan (also the big-M), so the solver can only improve on the greedy.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.cpsat import SolverResult
from ds_recycle.plan.ops import OpKind, Worker
from ds_recycle.plan.routing import route

__all__ = ["solve_milp"]

logger = logging.getLogger(__name__)
_F, _B, _W, _O = OpKind.F, OpKind.B, OpKind.W, OpKind.O


class _Model:
    """Variables and rows of the MILP."""

    def __init__(self) -> None:
        self.names: list[object] = []
        self.integer: list[int] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, name: object, lo: float, hi: float, integer: bool = False) -> int:
        self.names.append(name)
        self.integer.append(int(integer))
        self.lb.append(lo)
        self.ub.append(hi)
        return len(self.names) - 1

    def row(self, coeffs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coeffs, lo, hi))

    def solve(self, objective: int, time_limit: float) -> Any:
        """scipy's ``OptimizeResult`` (``x``, ``fun``, ``status``, ``message``, ``mip_dual_bound``)."""
        data, rows, cols, lo, hi = [], [], [], [], []
        for r, (coeffs, a, b) in enumerate(self.rows):
            for c, v in coeffs.items():
                rows.append(r)
                cols.append(c)
                data.append(v)
            lo.append(a)
            hi.append(b)
        matrix = coo_matrix((data, (rows, cols)), shape=(len(self.rows), len(self.names))).tocsr()
        cost = np.zeros(len(self.names))
        cost[objective] = 1.0
        return milp(cost, constraints=LinearConstraint(matrix, lo, hi), integrality=np.array(self.integer),
                    bounds=Bounds(self.lb, self.ub), options={"time_limit": time_limit, "disp": False})


def solve_milp(stages: int, pipelines: int, microbatches: int, costs: CostModel, failed: frozenset[Worker], *,
               iterations: int, synchronous: bool, memory_limit: int | None, horizon: float,
               time_limit: float) -> SolverResult:
    """Solve the MILP (see the module docstring); the answer has the same shape as CP-SAT's."""
    began = time.perf_counter()
    optimizer = "synchronous" if synchronous else "staggered"
    model, start, c_var = _build(stages, pipelines, microbatches, costs, failed, iterations, optimizer,
                                 memory_limit, horizon)
    result = model.solve(c_var, time_limit)
    seconds = time.perf_counter() - began
    dual = float(getattr(result, "mip_dual_bound", 0.0) or 0.0)
    if result.x is None:
        logger.warning("MILP found no solution in %.1f s (%s)", time_limit, result.message)
        return SolverResult(None, float("inf"), dual, False, str(result.message), seconds, False)
    orders = {w: [key for key, _ in sorted(ops, key=lambda kv: (result.x[kv[1]], kv[0][0] is _O))]
              for w, ops in start.items()}
    return SolverResult(orders, float(result.fun), dual, result.status == 0, str(result.message), seconds, False)


def _build(S: int, D: int, M: int, costs: CostModel, failed: frozenset[Worker], K: int, optimizer: str,
           limit: int | None, horizon: float) -> tuple[_Model, dict, int]:
    model = _Model()
    routing = route(S, D, M, failed)
    start: dict[Worker, list[tuple[tuple, int]]] = {}
    var: dict[tuple, int] = {}
    for k in range(K):
        for s in range(S):
            for mb, p in sorted(routing[s].items()):
                for kind in (_F, _B, _W):
                    v = model.var((kind, s, k, mb), 0.0, horizon)
                    var[(kind, s, k, mb)] = v
                    start.setdefault((p, s), []).append(((kind, k, mb), v))
    sync = optimizer == "synchronous"
    groups = {(-1 if sync else s, k): model.var(("O", s, k), 0.0, horizon)
              for k in range(K) for s in ((-1,) if sync else range(S))}
    for (p, s) in start:
        for k in range(K):
            start[(p, s)].append(((_O, k, None), groups[(-1 if sync else s, k)]))
    c_var = model.var("C", 0.0, horizon)
    _dependencies(model, var, groups, costs, S, K, sync, c_var)
    _load_cuts(model, start, groups, costs, K, sync)
    _disjunctions(model, start, var, costs, horizon, limit)
    return model, start, c_var


def _dependencies(model: _Model, var: dict, groups: dict, costs: CostModel, S: int, K: int, sync: bool,
                  c_var: int) -> None:
    inf = np.inf
    for (kind, s, k, mb), v in var.items():
        dur = costs.of(kind.value, s)
        if kind is _F and s > 0:
            model.row({v: 1, var[(_F, s - 1, k, mb)]: -1}, costs.F[s - 1] + costs.comm, inf)
        elif kind is _B:
            if s < S - 1:
                model.row({v: 1, var[(_B, s + 1, k, mb)]: -1}, costs.B[s + 1] + costs.comm, inf)
            else:
                model.row({v: 1, var[(_F, s, k, mb)]: -1}, costs.F[s], inf)
        elif kind is _W:
            model.row({v: 1, var[(_B, s, k, mb)]: -1}, costs.B[s], inf)
        group = groups[(-1 if sync else s, k)]
        model.row({group: 1, v: -1}, dur, inf)
        if k > 0:
            model.row({v: 1, groups[(-1 if sync else s, k - 1)]: -1}, costs.O[s], inf)
    for (g, _k), v in groups.items():
        longest = max(costs.O) if g < 0 else costs.O[g]
        model.row({c_var: 1, v: -1}, longest, inf)


def _load_cuts(model: _Model, start: dict, groups: dict, costs: CostModel, K: int, sync: bool) -> None:
    """Valid cuts the big-M relaxation misses: a worker's O waits for all of its own work.

    The O of iteration 0 starts no earlier than the worker's first possible start (a micro-batch's F
    through the stages before it) plus the durations of all its F, B and W; the O of iteration k no earlier
    than the end of O of iteration k-1 plus that iteration's work.
    """
    for (_p, s), ops in start.items():
        prefix = sum(costs.F[j] + costs.comm for j in range(s))
        for k in range(K):
            work = sum(costs.of(key[0].value, s) for key, _ in ops if key[0] is not _O and key[1] == k)
            group = groups[(-1 if sync else s, k)]
            if k == 0:
                model.row({group: 1}, prefix + work, np.inf)
            else:
                model.row({group: 1, groups[(-1 if sync else s, k - 1)]: -1}, costs.O[s] + work, np.inf)


def _disjunctions(model: _Model, start: dict, var: dict, costs: CostModel, horizon: float,
                  limit: int | None) -> None:
    inf = np.inf
    big = 2 * horizon + 1.0
    for (_p, s), ops in start.items():
        fbw = [(key, v) for key, v in ops if key[0] is not _O]
        order: dict[tuple[int, int], int | None] = {}  # (a, b) -> binary "a before b"; None: always
        for (ka, va), (kb, vb) in itertools.combinations(fbw, 2):
            if ka[1] != kb[1]:
                continue  # different iterations are ordered by the O between them
            if ka[2] == kb[2]:
                order[(va, vb)] = None  # F, B, W of one micro-batch: fixed by the dependencies
                continue
            y = model.var(("y", va, vb), 0, 1, integer=True)
            da, db = costs.of(ka[0].value, s), costs.of(kb[0].value, s)
            model.row({va: 1, vb: -1, y: big}, -inf, big - da)
            model.row({vb: 1, va: -1, y: -big}, -inf, -db)
            order[(va, vb)] = y
        if limit is not None:
            _memory_rows(model, fbw, order, limit)


def _before(order: dict, a: int, b: int) -> tuple[dict[int, float], float]:
    """``[a before b]`` as a linear form ``(coefficients, constant)`` over the order binaries."""
    if (a, b) in order:
        y = order[(a, b)]
        return ({}, 1.0) if y is None else ({y: 1.0}, 0.0)
    y = order[(b, a)]
    return ({}, 0.0) if y is None else ({y: -1.0}, 1.0)


def _memory_rows(model: _Model, fbw: list, order: dict, limit: int) -> None:
    """Held at the start of F_x: sum over y of [F_y before F_x] and [W_y after F_x] <= limit - 1."""
    by_mb: dict[tuple, dict[OpKind, int]] = {}
    for (kind, k, mb), v in fbw:
        by_mb.setdefault((k, mb), {})[kind] = v
    for (k, mb), mine in by_mb.items():
        total: dict[int, float] = {}
        for (k2, other), theirs in by_mb.items():
            if k2 != k or other == mb:
                continue
            z = model.var(("z", mine[_F], theirs[_F]), 0.0, 1.0)
            c1, k1 = _before(order, theirs[_F], mine[_F])
            c2, k2c = _before(order, mine[_F], theirs[_W])
            coeffs = {z: 1.0}
            for c, v in itertools.chain(c1.items(), c2.items()):
                coeffs[c] = coeffs.get(c, 0.0) - v
            model.row(coeffs, k1 + k2c - 1.0, np.inf)
            total[z] = 1.0
        if total:
            model.row(total, -np.inf, limit - 1)
