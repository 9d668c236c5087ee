"""The validator: every rule of the plan format, with the failing op and a picture of the grid.

    validate_plan(plan)          # raises PlanValidationError (its .rule is the rule's number)
    validate_document(json_obj)  # the same, plus rule 7 on the document's own "makespan" field
    validate_plan(plan, layers)  # plus rule 8: a re-partitioned plan's costs are its layers' sums

Rule 8 (re-partitioned plans): the plan's ``partition`` covers the model's layers (``0`` to the layer count,
every stage at least one layer) and each stage's F, B, W and O are the sums of the ``LayerCosts`` of the layers
the partition gives it. A plan without a partition (the job's own) has nothing for rule 8 to check.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ds_recycle.plan.errors import PlanError, PlanValidationError
from ds_recycle.plan.ops import OpKind, Worker
from ds_recycle.plan.partition import LayerCosts, check_partition
from ds_recycle.plan.plan import Plan

__all__ = ["validate_plan", "validate_document", "check_channels"]

_F, _B, _W, _O = OpKind.F, OpKind.B, OpKind.W, OpKind.O


def validate_plan(plan: Plan, layers: LayerCosts | None = None) -> None:
    """Check rules 1 to 6 (7 holds by construction of :attr:`Plan.makespan`), and rule 8 when ``layers``
    (the model's per-layer costs) is given."""
    eps = 1e-9 * max(1.0, plan.makespan)
    _check_workers(plan)
    where = _check_ops_once(plan)
    _check_durations(plan, eps)
    _check_order(plan, eps)
    _check_dependencies(plan, where, eps)
    _check_optimizer(plan, eps)
    _check_memory(plan)
    if layers is not None:
        _check_partition(plan, layers)


def validate_document(obj: Mapping[str, Any], layers: LayerCosts | None = None) -> Plan:
    """Parse and validate a plan-format document; returns the plan."""
    plan = Plan.from_json(obj)
    validate_plan(plan, layers)
    if abs(float(obj.get("makespan", -1.0)) - plan.makespan) > 1e-9 * max(1.0, plan.makespan):
        raise PlanValidationError(7, f"makespan {obj.get('makespan')!r} is not the largest end {plan.makespan}")
    return plan


def _fail(plan: Plan, rule: int, message: str, worker: Worker | None = None, index: int | None = None) -> None:
    op = None
    mark = None
    if worker is not None and index is not None:
        op = str(plan.workers[worker][index])
        mark = (worker, index)
        message = f"{message} (op {op} at position {index} on worker {worker})"
    raise PlanValidationError(rule, message, op, plan.grid(mark))


def _check_workers(plan: Plan) -> None:
    for p, s in plan.failed:
        if (p, s) in plan.workers:
            _fail(plan, 1, f"failed worker {(p, s)} has ops")
    for p, s in plan.workers:
        if not (0 <= p < plan.pipelines and 0 <= s < plan.stages):
            _fail(plan, 1, f"worker {(p, s)} is outside {plan.pipelines} pipelines x {plan.stages} stages")
    for p in range(plan.pipelines):
        for s in range(plan.stages):
            if (p, s) not in plan.failed and (p, s) not in plan.workers:
                _fail(plan, 1, f"live worker {(p, s)} has no entry")


def _check_ops_once(plan: Plan) -> dict[tuple[OpKind, int, int, tuple[int, int]], tuple[Worker, int]]:
    """Rule 1; returns where each (kind, stage, iteration, mb) runs."""
    where: dict[tuple, tuple[Worker, int]] = {}
    for w, ops in plan.workers.items():
        for i, op in enumerate(ops):
            if op.kind is _O:
                continue
            o, idx = op.mb  # type: ignore[misc]  # not O: has a micro-batch
            if not (0 <= op.iteration < plan.iterations and 0 <= o < plan.pipelines
                    and 0 <= idx < plan.microbatches):
                _fail(plan, 1, "iteration or micro-batch outside the plan's shape", w, i)
            key = (op.kind, w[1], op.iteration, op.mb)
            if key in where:
                _fail(plan, 1, f"{op.kind.value} of {op.mb} at stage {w[1]} runs twice (also on {where[key][0]})",
                      w, i)
            where[key] = (w, i)
    for k in range(plan.iterations):
        for s in range(plan.stages):
            for o in range(plan.pipelines):
                for idx in range(plan.microbatches):
                    mb = (o, idx)
                    f, b, wh = where.get((_F, s, k, mb)), where.get((_B, s, k, mb)), where.get((_W, s, k, mb))
                    if f is None or b is None or wh is None or not f[0] == b[0] == wh[0]:
                        _check_triple(plan, where, k, s, mb)
    return where


def _check_triple(plan: Plan, where: dict, k: int, s: int, mb: tuple[int, int]) -> None:
    """Fail with the reason the F, B and W of ``mb`` at stage ``s`` are not one worker's (called on a miss)."""
    homes = []
    for kind in (_F, _B, _W):
        if (kind, s, k, mb) not in where:
            _fail(plan, 1, f"no {kind.value} of micro-batch {mb} at stage {s} in iteration {k}")
        homes.append(where[(kind, s, k, mb)])
    _fail(plan, 1, f"F, B, W of {mb} at stage {s} run on different workers {[h[0] for h in homes]}", *homes[1])


def _check_durations(plan: Plan, eps: float) -> None:
    for w, ops in plan.workers.items():
        s, factor = w[1], plan.costs.factor(w)
        for i, op in enumerate(ops):
            cost = plan.costs.duration(op.kind.value, w)
            if abs((op.end - op.start) - cost) > eps:
                slow = f" x the worker's slow factor {factor}" if factor != 1.0 else ""
                _fail(plan, 2, f"lasts {op.end - op.start} but costs.{op.kind.value}[{s}]{slow} = {cost}", w, i)


def _check_order(plan: Plan, eps: float) -> None:
    for w, ops in plan.workers.items():
        for i in range(1, len(ops)):
            if ops[i].start < ops[i - 1].end - eps:
                _fail(plan, 3, f"starts at {ops[i].start} before the previous op ends at {ops[i - 1].end}", w, i)


def _check_dependencies(plan: Plan, where: dict, eps: float) -> None:
    last, comm = plan.stages - 1, plan.costs.comm
    for w, ops in plan.workers.items():
        s = w[1]
        for i, op in enumerate(ops):
            if op.kind is _O:
                continue
            if op.kind is _F:
                dep, gap = ((_F, s - 1), comm) if s > 0 else (None, 0.0)
            elif op.kind is _B:
                dep, gap = ((_B, s + 1), comm) if s < last else ((_F, s), 0.0)
            else:
                dep, gap = (_B, s), 0.0
            if dep is None:
                continue
            dw, di = where[(dep[0], dep[1], op.iteration, op.mb)]
            ready = plan.workers[dw][di].end + gap
            if op.start < ready - eps:
                _fail(plan, 4, f"starts at {op.start}, before its input is ready at {ready} "
                               f"({dep[0].value} at stage {dep[1]} on {dw} ends {ready - gap}, comm {gap})", w, i)


def _check_optimizer(plan: Plan, eps: float) -> None:
    o_start: dict[tuple[int, int], float] = {}
    fbw_end: dict[tuple[int, int], float] = defaultdict(float)
    for w, ops in plan.workers.items():
        for op in ops:
            if op.kind is not _O:
                fbw_end[(w[1], op.iteration)] = max(fbw_end[(w[1], op.iteration)], op.end)
    for w, ops in plan.workers.items():
        o_index = {}
        for i, op in enumerate(ops):
            if op.kind is not _O:
                continue
            if op.iteration in o_index:
                _fail(plan, 5, f"second O of iteration {op.iteration}", w, i)
            o_index[op.iteration] = i
            _check_o_group(plan, o_start, fbw_end, w, i, eps)
        for k in range(plan.iterations):
            if k not in o_index:
                _fail(plan, 5, f"worker {w} has no O in iteration {k}")
        for i, op in enumerate(ops):
            prev = o_index.get(op.iteration - 1)
            if prev is not None and op.start < ops[prev].end - eps:
                _fail(plan, 5, f"starts before this worker's O of iteration {op.iteration - 1} ends", w, i)


def _check_o_group(plan: Plan, o_start: dict, fbw_end: dict, w: Worker, i: int, eps: float) -> None:
    op = plan.workers[w][i]
    group = (-1 if plan.optimizer == "synchronous" else w[1], op.iteration)
    if group in o_start and abs(o_start[group] - op.start) > eps:
        scope = "of the iteration" if group[0] < 0 else f"of stage {w[1]}"
        _fail(plan, 5, f"O starts at {op.start}, but another O {scope} starts at {o_start[group]}", w, i)
    o_start.setdefault(group, op.start)
    if op.start < fbw_end[(w[1], op.iteration)] - eps:
        _fail(plan, 5, f"O starts at {op.start} before the stage's last F/B/W ends at "
                       f"{fbw_end[(w[1], op.iteration)]}", w, i)


def _check_memory(plan: Plan) -> None:
    if plan.memory_limit is None:
        return
    for w, ops in plan.workers.items():
        held = 0
        for i, op in enumerate(ops):
            if op.kind is _F:
                held += 1
                if held > plan.memory_limit:
                    _fail(plan, 6, f"holds {held} micro-batches, over memory_limit {plan.memory_limit}", w, i)
            elif op.kind is _W:
                held -= 1


def _check_partition(plan: Plan, layers: LayerCosts) -> None:
    """Rule 8."""
    if plan.partition is None:
        return
    try:
        parts = check_partition(plan.partition, layers.layers, plan.stages, "plan partition")
    except PlanError as err:
        _fail(plan, 8, str(err))
    want = layers.stage_costs(parts)
    for kind in ("F", "B", "W", "O"):
        for s in range(plan.stages):
            got, sums = plan.costs.of(kind, s), want.of(kind, s)
            if abs(got - sums) > 1e-9 * max(1.0, abs(sums)):
                _fail(plan, 8, f"costs.{kind}[{s}] = {got} but layers {parts[s]} to {parts[s + 1] - 1} sum to {sums}: "
                               f"a re-partitioned plan's stage costs are its layers' sums")


def check_channels(plan: Plan) -> None:
    """Check that every worker-to-worker channel carries its transfers in the same order at both ends.

    Not a rule of the plan format, but what lets the engine match point-to-point transfers by order
    alone: for each sender and receiver, the F outputs (B gradients) leave the sender in the order the
    receiver runs the F (B) that consume them. Raises :class:`PlanValidationError` (rule 0).
    """
    for kind, step in ((_F, 1), (_B, -1)):
        sent: dict[tuple[Worker, Worker], list] = defaultdict(list)
        got: dict[tuple[Worker, Worker], list] = defaultdict(list)
        for w, ops in plan.workers.items():
            s = w[1]
            for op in ops:
                if op.kind is not kind or op.mb is None:
                    continue
                if 0 <= s + step < plan.stages:
                    sent[(w, plan.worker_of(s + step, op.mb))].append((op.iteration, op.mb))
                if 0 <= s - step < plan.stages:
                    got[(plan.worker_of(s - step, op.mb), w)].append((op.iteration, op.mb))
        for channel, order in sent.items():
            if got[channel] != order:
                i = next(j for j, (a, b) in enumerate(zip(order, got[channel])) if a != b)
                raise PlanValidationError(0, f"{kind.value} transfers on channel {channel[0]} -> {channel[1]} are "
                                             f"sent in order {order[i:i + 4]}... but consumed in order "
                                             f"{got[channel][i:i + 4]}...", None, plan.grid())
