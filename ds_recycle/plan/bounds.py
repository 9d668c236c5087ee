"""The plan format's lower bound on the makespan, and the best possible time of an adapted plan."""
from __future__ import annotations

import math
from collections.abc import Iterable

from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import PlanError, StageLostError
from ds_recycle.plan.ops import Worker

__all__ = ["lower_bound", "routed_lower_bound", "round_trip_bound", "critical_path_bound", "stage_spans",
           "best_lower_bound",
           "failures_per_stage", "check_shape"]


def check_shape(stages: int, pipelines: int, microbatches: int, costs: CostModel, iterations: int = 1) -> None:
    """Raise :class:`PlanError` naming the argument if the shape is impossible."""
    for name, value in (("stages", stages), ("pipelines", pipelines), ("microbatches", microbatches),
                        ("iterations", iterations)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} = {value!r}: must be an integer >= 1")
    if costs.stages != stages:
        raise PlanError(f"the cost model has {costs.stages} stages but the plan has {stages}: "
                        f"give one cost per stage")


def failures_per_stage(failed: Iterable[Worker], stages: int, pipelines: int) -> list[int]:
    """``f_s`` for each stage; checks every failed worker exists and no stage is wholly lost."""
    counts = [0] * stages
    for worker in set(map(tuple, failed)):
        p, s = worker
        if not (0 <= p < pipelines and 0 <= s < stages):
            raise PlanError(f"failed worker {p}:{s} is outside {pipelines} pipelines x {stages} stages "
                            f"(pipeline:stage, 0-based)")
        counts[s] += 1
    for s, f in enumerate(counts):
        if f >= pipelines:
            raise StageLostError(s, pipelines)
    return counts


def lower_bound(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                failed: Iterable[Worker] = (), iterations: int = 1) -> float:
    """``max_s [sum_{j<s}(F_j + comm) + ceil(K*D*M/(D - f_s)) * (F_s+B_s+W_s) + K*O_s]``."""
    check_shape(stages, pipelines, microbatches, costs, iterations)
    f = failures_per_stage(failed, stages, pipelines)
    best, prefix = 0.0, 0.0
    for s in range(stages):
        load = math.ceil(iterations * pipelines * microbatches / (pipelines - f[s]))
        best = max(best, prefix + load * costs.work(s) + iterations * costs.O[s])
        prefix += costs.F[s] + costs.comm
    return best


def routed_lower_bound(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                       failed: Iterable[Worker] = (), iterations: int = 1) -> float:
    """The plan format's bound when each micro-batch keeps its worker in every iteration (as plans do).

    The busiest worker of stage s then runs ``ceil(D*M/(D - f_s))`` micro-batches in *each* iteration:
    ``max_s [sum_{j<s}(F_j + comm) + K*ceil(D*M/(D - f_s)) * (F_s+B_s+W_s) + K*O_s]``. It is at least
    :func:`lower_bound`, and above it when ``D - f_s`` does not divide ``D*M`` (the busiest peer carries one
    extra micro-batch every iteration, not once over K iterations).
    """
    check_shape(stages, pipelines, microbatches, costs, iterations)
    f = failures_per_stage(failed, stages, pipelines)
    best, prefix = 0.0, 0.0
    for s in range(stages):
        load = iterations * math.ceil(pipelines * microbatches / (pipelines - f[s]))
        best = max(best, prefix + load * costs.work(s) + iterations * costs.O[s])
        prefix += costs.F[s] + costs.comm
    return best


def round_trip_bound(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                     failed: Iterable[Worker] = (), iterations: int = 1) -> float:
    """A bound the plan format's formula leaves out: stage 0 waits for a round trip every iteration.

    No B at stage 0 can start before one micro-batch has gone forward through every stage and backward to
    stage 0, and stage 0 starts iteration k+1 only after its O of iteration k. So, with
    ``n_0 = ceil(D*M/(D - f_0))`` micro-batches on the busiest live worker of stage 0 (routing is the same
    every iteration):
    ``K * [F_0 + sum_{j>0}(F_j + B_j + 2*comm) + n_0 * (B_0 + W_0) + O_0]``.
    """
    check_shape(stages, pipelines, microbatches, costs, iterations)
    f = failures_per_stage(failed, stages, pipelines)
    trip = costs.F[0] + sum(costs.F[j] + costs.B[j] + 2 * costs.comm for j in range(1, stages))
    n0 = math.ceil(pipelines * microbatches / (pipelines - f[0]))
    return iterations * (trip + n0 * (costs.B[0] + costs.W[0]) + costs.O[0])


def critical_path_bound(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                        failed: Iterable[Worker] = (), iterations: int = 1, *, optimizer: str = "staggered",
                        memory_limit: int | None = None) -> float:
    """Per-stage critical paths: the busiest worker of each stage, its first and last micro-batch's round trips.

    With ``n_s = ceil(D*M/(D - f_s))`` micro-batches on the busiest live worker of stage s (each iteration),
    ``head_s = sum_{j<s}(F_j + comm)`` and ``tail_s = sum_{j>s}(F_j + B_j + 2*comm)`` (from the end of an F
    at stage s to the earliest start of its B there), one iteration of that worker, from its first F to its
    O, lasts at least the largest of

    * ``n_s * (F_s + B_s + W_s)`` (all its work),
    * ``F_s + tail_s + n_s * (B_s + W_s)`` (no B before the first F's round trip),
    * ``n_s * F_s + tail_s + B_s + W_s`` (the last F's round trip, then its B and W),
    * with a memory limit L < n_s: ``F_s + tail_s + (n_s - L) * F_s + n_s * (B_s + W_s)`` (nothing is freed
      before the first W, which follows the first F's round trip, so at most L F run before it).

    Staggered optimizer: ``max_s [head_s + K * (that + O_s)]``. Synchronous: every stage waits for the
    slowest before the common O, and iteration k+1 starts over from stage 0, so
    ``K * max_s [head_s + that] + (K - 1) * O_0 + max_s O_s``. The round-trip bound is the second line at s=0.
    """
    check_shape(stages, pipelines, microbatches, costs, iterations)
    head, span = stage_spans(stages, pipelines, microbatches, costs, failed, memory_limit)
    if optimizer == "synchronous":
        return (iterations * max(head[s] + span[s] for s in range(stages))
                + (iterations - 1) * costs.O[0] + max(costs.O))
    return max(head[s] + iterations * (span[s] + costs.O[s]) for s in range(stages))


def stage_spans(stages: int, pipelines: int, microbatches: int, costs: CostModel, failed: Iterable[Worker] = (),
                memory_limit: int | None = None) -> tuple[list[float], list[float]]:
    """``(head_s, span_s)`` of :func:`critical_path_bound`: the earliest first op of stage s, and the least time
    from the first F of an iteration to the O on the busiest live worker of stage s."""
    f = failures_per_stage(failed, stages, pipelines)
    F, B, W, comm = costs.F, costs.B, costs.W, costs.comm
    head = [sum(F[j] + comm for j in range(s)) for s in range(stages)]
    tail = [sum(F[j] + B[j] + 2 * comm for j in range(s + 1, stages)) for s in range(stages)]
    span = []
    for s in range(stages):
        n = math.ceil(pipelines * microbatches / (pipelines - f[s]))
        span.append(max(n * costs.work(s), F[s] + tail[s] + n * (B[s] + W[s]), n * F[s] + tail[s] + B[s] + W[s]))
        if memory_limit is not None and memory_limit < n:
            span[-1] = max(span[-1], F[s] + tail[s] + (n - memory_limit) * F[s] + n * (B[s] + W[s]))
    return head, span


def best_lower_bound(stages: int, pipelines: int, microbatches: int, costs: CostModel,
                     failed: Iterable[Worker] = (), iterations: int = 1, *, optimizer: str = "staggered",
                     memory_limit: int | None = None) -> float:
    """The tightest of the bounds above for plans that keep a micro-batch on one worker every iteration."""
    return max(routed_lower_bound(stages, pipelines, microbatches, costs, failed, iterations),
               round_trip_bound(stages, pipelines, microbatches, costs, failed, iterations),
               critical_path_bound(stages, pipelines, microbatches, costs, failed, iterations, optimizer=optimizer,
                                   memory_limit=memory_limit))
