"""Plans from integers: 1F1B, ZB-H1 and the adaptive planner, with or without failed workers.

    plan = make_plan(4, 2, 8, CostModel.uniform(4), failed=[(1, 2)], iterations=2)

* ``"1f1b"``: DeepSpeed's schedule: stage s runs at most ``S - s`` micro-batches ahead, in DeepSpeed's
  order when nothing failed (see :func:`policies_for`), B and W fused:
  W right after its B, and the gradient leaves the stage only after W, as DeepSpeed's single backward
  call does (so its times are later than rule 4 alone requires; ``simulate(..., fused_backward=True)``
  reproduces them). DeepSpeed steps all stages together: pass ``optimizer="synchronous"`` for that.
* ``"zb-h1"``: the zero-bubble ZB-H1 family ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
  B early, W deferred into idle time, and no worker holding more than S micro-batches (1F1B's first stage).
* ``"adaptive"``: the best (smallest makespan) of several greedy variants (:data:`ADAPTIVE_VARIANTS`),
  each obeying ``memory_limit``. ``memory_limit=None`` means no limit; the benchmark also reports plans
  under a limit.

Failed workers' micro-batches are re-routed to their live peers by :func:`ds_recycle.plan.routing.route`
in every schedule; when a stage has lost every worker, :class:`StageLostError` says so.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterable, Sequence

from ds_recycle.plan._gc import gc_paused
from ds_recycle.plan.bounds import check_shape, failures_per_stage, lower_bound
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import DeadlockError, PlanError
from ds_recycle.plan.listsched import Policy, list_schedule
from ds_recycle.plan.ops import Op, Worker
from ds_recycle.plan.plan import OPTIMIZERS, SCHEDULES, Plan
from ds_recycle.plan.routing import Routing, route
from ds_recycle.plan.search import Candidate, improve

__all__ = ["make_plan", "best_failure_free", "best_failure_free_time", "best_possible", "failure_free", "failure_free_time",
           "ADAPTIVE_VARIANTS", "VARIANTS_BY_SIZE", "policies_for"]

logger = logging.getLogger(__name__)

ADAPTIVE_VARIANTS: tuple[tuple[int | None, bool], ...] = ((None, False), (None, True), (1, False), (0, True),
                                                         (0, False), (1, True))
"""(warm-up cap beyond ``S - s`` or None for none, forward first) of each greedy variant tried, in order.

Ordered by how often each was the best over the benchmark grid (S in {4, 8}; 480 cases): the first
won 76% of them and was never more than 7.3% (0.44% on average) behind the best of all six."""

#: (most ops in the plan, variants tried without / with a memory limit): big plans try fewer variants so
#: that planning stays fast; beyond the last size, one variant (two under a memory limit)
VARIANTS_BY_SIZE: tuple[tuple[int, int, int], ...] = ((8_000, 6, 12), (30_000, 3, 4))


#: local search after the variants (adaptive plans of at most SEARCH_OPS_MOST ops; the size of a failure-free plan
#: is that of all its pipelines): evaluations = min(SEARCH_MOST, SEARCH_OPS // ops in the plan)
SEARCH_OPS = 100_000
SEARCH_MOST = 150
SEARCH_OPS_MOST = 8_000


def policies_for(schedule: str, stages: int, memory_limit: int | None,
                 first_stage_failed: bool = False, failures: bool = False) -> tuple[Policy, ...]:
    """The greedy variants a schedule tries, in order; the best is kept.

    A failure-free 1F1B without a memory limit is DeepSpeed's order itself (``TrainSchedule``): ``S - s``
    forwards, then B and F strictly alternating, then the last B's (:attr:`Policy.alternate`). Taking whichever of
    B and F is ready first instead, as 1F1B under failures or a memory limit does (strict alternation can
    deadlock there), is slower than DeepSpeed once stages differ in cost: 8.97 s against DeepSpeed's 7.53 s for
    the 8-stage GPT-3 2.7B profile with M = 8, and DeepSpeed's run took 7.68 s.

    Under a memory limit the adaptive planner also tries :attr:`Policy.free_early` versions, ordered by how
    often they won over the benchmark grid with a limit (S in {4, 8}; 252 cases). When the first stage lost a
    worker, each adaptive variant is followed by its :attr:`Policy.fuse_first` version: there the survivors
    carry the most work and are the bottleneck, and W at once after B keeps them from idling while W pile up
    (on the odd-shape suite: 71.4 -> 66.4 for S=5, D=3, M=6 with heavier end stages, the bound being 65.8).
    """
    if schedule == "1f1b":
        greedy = Policy(fused=True, warmup=0, memory_limit=memory_limit)
        return (greedy,) if failures or memory_limit is not None else (dataclasses.replace(greedy, alternate=True),)
    limit = _plan_memory_limit(schedule, stages, memory_limit)
    if schedule == "zb-h1":
        return tuple(Policy(warmup=w, forward_first=ff, memory_limit=limit, fit_w=True)
                     for w, ff in ((0, False), (0, True), (1, False)))
    base = [Policy(warmup=w, forward_first=ff, memory_limit=limit, fit_w=True) for w, ff in ADAPTIVE_VARIANTS]
    if limit is not None:
        early = [dataclasses.replace(p, free_early=True) for p in base]
        # base[4] is ZB-H1's warm-up cap (S - s): under a limit it often wins on deep pipelines (S = 16)
        base = [base[0], early[0], base[4], early[1], base[2], base[3], base[1], base[5]] + early[2:]
    if first_stage_failed:
        base = [q for p in base for q in (p, dataclasses.replace(p, fuse_first=True))]
    return tuple(base)


def _plan_memory_limit(schedule: str, stages: int, memory_limit: int | None) -> int | None:
    if schedule == "zb-h1":
        return stages if memory_limit is None else min(stages, memory_limit)
    return memory_limit


def make_plan(stages: int, pipelines: int, microbatches: int, costs: CostModel,
              failed: Iterable[Worker] = (), *, iterations: int = 1, schedule: str = "adaptive",
              optimizer: str = "staggered", memory_limit: int | None = None, variants: int | None = None,
              time_budget: float | None = None, search: int | None = None) -> Plan:
    """The plan of ``schedule`` for this shape and failure set (see the module docstring).

    ``variants``: how many greedy variants to try (default: all of them (six, twelve under a memory
    limit, twice that with a first-stage failure) up to 8,000 ops, three (four) up to 30,000, else one (two);
    see :data:`VARIANTS_BY_SIZE` and :func:`policies_for`). ``search``: local-search evaluations after them
    (default ``min(SEARCH_MOST, SEARCH_OPS // ops)`` for adaptive plans of at most ``SEARCH_OPS_MOST`` ops,
    else none; see :mod:`search`). ``time_budget``
    (seconds) stops trying further variants once spent (the
    first always runs); it makes the result depend on the machine's speed, so caches and tests leave it
    unset.
    Raises :class:`StageLostError` when every worker of some stage failed, :class:`PlanError` on bad input.
    """
    _check_arguments(stages, pipelines, microbatches, costs, iterations, schedule, optimizer, memory_limit)
    with gc_paused():
        return _make_plan(stages, pipelines, microbatches, costs, frozenset((int(p), int(s)) for p, s in failed),
                          iterations, schedule, optimizer, memory_limit, variants, time_budget, search)


def _make_plan(stages: int, pipelines: int, microbatches: int, costs: CostModel, failed: frozenset[Worker],
               iterations: int, schedule: str, optimizer: str, memory_limit: int | None, variants: int | None,
               time_budget: float | None, search: int | None, copy: bool = True) -> Plan:
    """make_plan after its checks; ``copy=False``: a failure-free plan of one pipeline, sized for all of them."""
    failures_per_stage(failed, stages, pipelines)
    ops_count = 3 * stages * pipelines * microbatches * iterations
    first_failed = any(s == 0 for _, s in failed)
    if variants is None:
        limited = memory_limit is not None
        variants = next((n[limited] for most, *n in VARIANTS_BY_SIZE if ops_count <= most), 1 + limited)
        if first_failed and ops_count <= VARIANTS_BY_SIZE[0][0]:
            variants *= 2  # each variant with and without the fused first stage: small plans are cheap
    if search is None:
        search = 0 if schedule != "adaptive" or ops_count > SEARCH_OPS_MOST else \
            min(SEARCH_MOST, SEARCH_OPS // ops_count)
    slow = costs.slow_workers()
    if not failed and not slow and pipelines > 1:  # pipelines never meet but in O, and are alike: plan one, copy it
        one = _make_plan(stages, 1, microbatches, costs, failed, iterations, schedule, optimizer, memory_limit,
                         variants, time_budget, search)
        return _replicate(one, pipelines) if copy else one
    sync = optimizer == "synchronous"
    policies = policies_for(schedule, stages, memory_limit, first_stage_failed=first_failed,
                            failures=bool(failed or slow))
    offload = _offload(stages, pipelines, microbatches, costs, failed, iterations, sync, policies[0]) if slow else {}
    routing = route(stages, pipelines, microbatches, failed, offload)
    span, workers, policy = _best_variant(stages, pipelines, microbatches, costs, routing, failed, iterations, sync,
                                          policies[:max(1, variants)], time_budget)
    if search > 0:
        rank = {(o, i): i * pipelines + o for o in range(pipelines) for i in range(microbatches)}
        found = improve(Candidate(routing, rank, workers, span), stages, pipelines, microbatches, costs, failed,
                        iterations, sync, policy, search)
        span, workers = found.makespan, found.workers
    logger.debug("plan S=%d D=%d M=%d K=%d failed=%s %s: makespan %.4g", stages, pipelines, microbatches,
                 iterations, sorted(failed), schedule, span)
    return Plan(stages, pipelines, microbatches, iterations, optimizer,
                _plan_memory_limit(schedule, stages, memory_limit), costs, failed, dict(sorted(workers.items())),
                schedule)


def _offload(stages: int, pipelines: int, microbatches: int, costs: CostModel, failed: frozenset[Worker],
             iterations: int, sync: bool, policy: Policy, rounds: int = 3) -> dict[Worker, int]:
    """How many of its own micro-batches each slow worker gives its stage's peers.

    Each slow worker's count starts at the best count with it the only slow worker (its own stage's optimum:
    starting every count at 0 would leave each worker's choice dominated by the others' slowness, every count
    tying); then, per slow worker in turn with the others' counts fixed, the count whose plan (``policy``'s greedy
    pass) is shortest, fewest on a tie, for up to ``rounds`` rounds or until no count changes.

    A slow worker keeps at least one: it holds its stage's parameters and optimizer state and steps with its peers
    whatever it runs, so it takes part in the reduction anyway; fencing it would cost a state transfer to take it
    back once it is fast again, and one micro-batch at half speed fits in the bubbles of almost any plan.
    """
    slow = sorted(w for w in costs.slow_workers() if w not in failed)

    def span(offload: dict[Worker, int], model: CostModel) -> float:
        routing = route(stages, pipelines, microbatches, failed, offload)
        try:
            workers = list_schedule(stages, pipelines, microbatches, model, routing, failed, iterations, sync, policy)
        except DeadlockError:
            return math.inf
        return max(ops[-1].end for ops in workers.values())

    def best_count(worker: Worker, fixed: dict[Worker, int], model: CostModel) -> int:
        return min((span({**fixed, worker: k}, model), k) for k in range(microbatches))[1]

    offload = {w: best_count(w, {}, costs.with_slow({w: costs.factor(w)})) for w in slow}
    for _ in range(rounds if len(slow) > 1 else 0):
        before = dict(offload)
        for w in slow:
            offload[w] = best_count(w, {v: k for v, k in offload.items() if v != w}, costs)
        if offload == before:
            break
    return offload


def _check_arguments(stages: int, pipelines: int, microbatches: int, costs: CostModel, iterations: int,
                     schedule: str, optimizer: str, memory_limit: int | None) -> None:
    check_shape(stages, pipelines, microbatches, costs, iterations)
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule = {schedule!r}: use one of {SCHEDULES}")
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer = {optimizer!r}: use one of {OPTIMIZERS}")
    if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit < 1):
        raise PlanError(f"memory_limit = {memory_limit!r}: use a positive number of micro-batches or None")


def _best_variant(stages: int, pipelines: int, microbatches: int, costs: CostModel, routing: Routing,
                  failed: frozenset[Worker], iterations: int, sync: bool, policies: Sequence[Policy],
                  time_budget: float | None) -> tuple[float, dict[Worker, tuple[Op, ...]], Policy]:
    """The smallest makespan of the greedy variants, its plan and its policy."""
    began, best = time.perf_counter(), None
    stalled: list[str] = []
    for policy in policies:
        try:
            workers = list_schedule(stages, pipelines, microbatches, costs, routing, failed, iterations, sync,
                                    policy)
        except DeadlockError as exc:  # a variant that cannot finish under the memory limit: try the next
            logger.warning("%s", exc)
            stalled.append(str(exc))
            continue
        span = max(ops[-1].end for ops in workers.values())
        if best is None or span < best[0] - 1e-12:
            best = (span, workers, policy)
        if time_budget is not None and time.perf_counter() - began > time_budget:
            break
    if best is None:
        limit = policies[0].memory_limit
        raise PlanError(f"no plan fits memory_limit={limit}: {stalled[0]}. Fix: raise --memory-limit")
    return best


def _replicate(one: Plan, pipelines: int) -> Plan:
    """The failure-free plan of ``pipelines`` pipelines from the plan of one: pipeline p runs its own copy."""
    workers = {(p, s): tuple(Op.trusted(op.kind, op.iteration, None if op.mb is None else (p, op.mb[1]),
                                        op.start, op.end) for op in ops)
               for p in range(pipelines) for (_, s), ops in one.workers.items()}
    return Plan(one.stages, pipelines, one.microbatches, one.iterations, one.optimizer, one.memory_limit, one.costs,
                frozenset(), dict(sorted(workers.items())), one.schedule)


def best_failure_free(stages: int, pipelines: int, microbatches: int, costs: CostModel, *,
                      iterations: int = 1, optimizer: str = "staggered",
                      memory_limit: int | None = None) -> Plan:
    """The failure-free plan with the smallest makespan among the zero-bubble and adaptive schedules."""
    return _replicate(_best_one(stages, pipelines, microbatches, costs, iterations, optimizer, memory_limit),
                      pipelines)


def best_failure_free_time(stages: int, pipelines: int, microbatches: int, costs: CostModel, *,
                           iterations: int = 1, optimizer: str = "staggered", memory_limit: int | None = None) -> float:
    """The makespan of :func:`best_failure_free` (without building its copies of the pipeline)."""
    return _best_one(stages, pipelines, microbatches, costs, iterations, optimizer, memory_limit).makespan


def failure_free(stages: int, pipelines: int, microbatches: int, costs: CostModel, *, iterations: int = 1,
                 schedule: str = "adaptive", optimizer: str = "staggered", memory_limit: int | None = None) -> Plan:
    """``make_plan`` without failures; the one-pipeline plan it copies is remembered."""
    return _replicate(_one(stages, pipelines, microbatches, costs, iterations, schedule, optimizer, memory_limit),
                      pipelines)


def failure_free_time(stages: int, pipelines: int, microbatches: int, costs: CostModel, *, iterations: int = 1,
                      schedule: str = "adaptive", optimizer: str = "staggered",
                      memory_limit: int | None = None) -> float:
    """The makespan of :func:`failure_free`: the reference every report of a failure set compares to."""
    return _one(stages, pipelines, microbatches, costs, iterations, schedule, optimizer, memory_limit).makespan


@functools.lru_cache(maxsize=64)
def _one(stages: int, pipelines: int, microbatches: int, costs: CostModel, iterations: int, schedule: str,
         optimizer: str, memory_limit: int | None) -> Plan:
    """The one-pipeline plan that :func:`make_plan` copies for ``pipelines`` failure-free pipelines."""
    _check_arguments(stages, pipelines, microbatches, costs, iterations, schedule, optimizer, memory_limit)
    with gc_paused():
        return _make_plan(stages, pipelines, microbatches, costs, frozenset(), iterations, schedule, optimizer,
                          memory_limit, None, None, None, copy=False)


def _best_one(stages: int, pipelines: int, microbatches: int, costs: CostModel, iterations: int, optimizer: str,
              memory_limit: int | None) -> Plan:
    plans = [_one(stages, pipelines, microbatches, costs, iterations, name, optimizer, memory_limit)
             for name in ("zb-h1", "adaptive")]
    return min(plans, key=lambda p: p.makespan)


def best_possible(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                  failed: Iterable[Worker] = (), iterations: int = 1, *, optimizer: str = "staggered",
                  memory_limit: int | None = None) -> float:
    """Larger of the lower bound and the makespan of the best failure-free plan of the same shape.

    "Best failure-free plan" is the best the planner finds without failures (zero-bubble and adaptive
    schedules, same optimizer and memory limit), so the figure is as good as the planner's own.
    """
    bound = lower_bound(stages, pipelines, microbatches, costs, failed, iterations)
    free = best_failure_free_time(stages, pipelines, microbatches, costs, iterations=iterations,
                             optimizer=optimizer, memory_limit=memory_limit)
    return max(bound, free)
