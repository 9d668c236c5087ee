"""Iteration times, all from the planner (`ds_recycle.plan`): one planner, not two.

- ReCycle: `PlanCache(S, Dg, M, costs).time_per_iteration(failed)` of the adaptive planner (staggered
  optimizer, one iteration planned, `memory_limit` as given, default none), keyed by the normalized
  failure set, so a failure set seen before costs a dictionary lookup.
- Every other system: the time per iteration of the planner's failure-free plan of the schedule that
  system runs (`1f1b` as DeepSpeed runs it, by default) for its current pipeline depth `n`, pipeline
  count and micro-batches per pipeline, memoised.

Scaling to thousands of GPUs: ReCycle re-routes inside *re-routing groups* of `Dg` pipelines
(`group`, default min(D, 8)). With D <= Dg the planner sees the job's real failure set. With more
pipelines the job is G = ceil(D / Dg) groups of (about) Dg pipelines; since pipelines are
interchangeable, the system spreads each stage's failures over the groups as evenly as it can (it
chooses which pipelines form a group at each re-plan), and the job's iteration time is the slowest
group's: all replicas of a stage still all-reduce together. This under-estimates ReCycle when failures
could have been spread over more peers than Dg, so it is conservative; it keeps every plan the size
the planner is fast at (S x Dg x M) and independent of D.
"""
from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field

from ds_recycle.cluster.workload import Workload
from ds_recycle.plan import CostModel, PlanCache, StageLostError, make_plan, normalize_failures
from ds_recycle.plan.partition import LayerCosts, Partition, RepartitionChoice, choose_partition

__all__ = ["BaselineSchedule", "JobShape", "PipelineTimer", "StageLostError"]

logger = logging.getLogger(__name__)

Worker = tuple[int, int]  # (pipeline, stage)


class BaselineSchedule(enum.Enum):
    """The failure-free pipeline schedule the non-ReCycle systems run."""

    ONE_F_ONE_B = "1f1b"
    """DeepSpeed's 1F1B (B and W fused, synchronous optimizer): what DeepSpeed, Oobleck, Bamboo and
    torchft-style jobs run."""
    ZB_H1 = "zb-h1"
    """The zero-bubble schedule ReCycle itself runs failure-free: isolates resilience from the schedule."""


@dataclass(frozen=True)
class JobShape:
    """The job: `stages` x `pipelines` nodes, `microbatches` per pipeline per iteration."""

    stages: int
    pipelines: int
    microbatches: int
    group: int = 8
    """ReCycle's re-routing group size Dg (see the module docstring)."""

    def __post_init__(self) -> None:
        for name in ("stages", "pipelines", "microbatches", "group"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: must be at least 1")

    @property
    def nodes(self) -> int:
        return self.stages * self.pipelines

    @property
    def group_sizes(self) -> tuple[int, ...]:
        g = min(self.group, self.pipelines)
        count = math.ceil(self.pipelines / g)
        base, extra = divmod(self.pipelines, count)
        return tuple(base + (1 if i < extra else 0) for i in range(count))


@dataclass
class PlannerStats:
    """How much planning the simulation did (for the report's speed figures)."""

    recycle_lookups: int = 0
    recycle_plans: int = 0
    recycle_plan_s: float = 0.0
    baseline_plans: int = 0
    baseline_plan_s: float = 0.0
    keys: set[object] = field(default_factory=set)


class PipelineTimer:
    """Planner-backed iteration times of one job shape and workload."""

    def __init__(self, workload: Workload, shape: JobShape,
                 baseline: BaselineSchedule = BaselineSchedule.ONE_F_ONE_B,
                 memory_limit: int | None = None) -> None:
        self.workload, self.shape, self.baseline = workload, shape, baseline
        self.memory_limit = memory_limit
        self.stats = PlannerStats()
        self._caches: dict[int, PlanCache] = {}
        self._recycle_memo: dict[object, float] = {}
        self._baseline_memo: dict[tuple[int, int, int], float] = {}
        self._partition_memo: dict[object, float] = {}
        self._choice_memo: dict[object, RepartitionChoice] = {}

    def with_baseline(self, baseline: BaselineSchedule) -> PipelineTimer:
        """A timer for another baseline schedule sharing this one's ReCycle plans and statistics."""
        other = PipelineTimer(self.workload, self.shape, baseline, self.memory_limit)
        other.stats, other._caches, other._recycle_memo = self.stats, self._caches, self._recycle_memo
        if baseline is self.baseline:
            other._baseline_memo = self._baseline_memo
        return other

    @property
    def samples_per_iteration(self) -> int:
        return self.shape.pipelines * self.shape.microbatches * self.workload.micro_batch

    # -- ReCycle ----------------------------------------------------------------------------------
    def recycle_iteration_s(self, failed: frozenset[Worker]) -> float:
        """Time per iteration of ReCycle's adapted plan; raises StageLostError if a stage is gone."""
        return max(self._group_time(size, fs) for size, fs in self._groups(failed))

    def _groups(self, failed: frozenset[Worker]) -> list[tuple[int, frozenset[Worker]]]:
        """Each re-routing group's size and failure set (see the module docstring); StageLostError if a stage
        lost every replica."""
        S, D = self.shape.stages, self.shape.pipelines
        counts = [0] * S
        for _, s in failed:
            counts[s] += 1
        for s, f in enumerate(counts):
            if f >= D:
                raise StageLostError(s, D)
        sizes = self.shape.group_sizes
        if len(sizes) == 1:
            return [(D, failed)]
        return list(zip(sizes, _spread(counts, sizes)))

    def _group_time(self, size: int, failed: frozenset[Worker]) -> float:
        key, _ = normalize_failures(failed, self.shape.stages, size)
        memo_key = (size, key)
        self.stats.recycle_lookups += 1
        hit = self._recycle_memo.get(memo_key)
        if hit is not None:
            return hit
        cache = self._caches.get(size)
        if cache is None:
            costs = self.workload.costs_at(self.shape.stages, self.shape.pipelines)
            cache = self._caches[size] = PlanCache(self.shape.stages, size,
                                                   self.shape.microbatches, costs,
                                                   memory_limit=self.memory_limit)
        t0 = time.perf_counter()
        value = cache.time_per_iteration(failed)
        self.stats.recycle_plan_s += time.perf_counter() - t0
        self.stats.recycle_plans += 1
        self._recycle_memo[memo_key] = value
        logger.debug("recycle plan Dg=%s failed=%s: %.4f s/iteration", size, sorted(failed), value)
        return value

    # -- ReCycle + re-partition --------------------------------------------------------------------
    def layers(self) -> tuple[LayerCosts, Partition]:
        """The workload's per-layer costs and the job's own partition (see :meth:`Workload.layers_at`)."""
        return self.workload.layers_at(self.shape.stages, self.shape.pipelines)

    def partition_iteration_s(self, failed: frozenset[Worker], parts: Partition) -> float:
        """Time per iteration of ReCycle's adapted plan with the model cut at ``parts``."""
        return self._costs_iteration_s(failed, self.layers()[0].stage_costs(parts))

    def _costs_iteration_s(self, failed: frozenset[Worker], costs: CostModel) -> float:
        S = self.shape.stages
        worst = 0.0
        for size, fs in self._groups(failed):
            key = (size, normalize_failures(fs, S, size)[0], costs)
            hit = self._partition_memo.get(key)
            if hit is None:
                t0 = time.perf_counter()
                hit = make_plan(S, size, self.shape.microbatches, costs, fs,
                                memory_limit=self.memory_limit).time_per_iteration
                self.stats.recycle_plan_s += time.perf_counter() - t0
                self.stats.recycle_plans += 1
                self._partition_memo[key] = hit
            worst = max(worst, hit)
        return worst

    def repartition_choice(self, failed: frozenset[Worker], current: Partition, horizon: int) -> RepartitionChoice:
        """:func:`~ds_recycle.plan.partition.choose_partition` for this job (every re-routing group planned)."""
        key = (normalize_failures(failed, self.shape.stages, self.shape.pipelines)[0], current, horizon)
        hit = self._choice_memo.get(key)
        if hit is None:
            layers = self.layers()[0]
            hit = choose_partition(layers, self.shape.stages, self.shape.pipelines, self.shape.microbatches,
                                   failed, current, horizon=horizon,
                                   timer=lambda costs: self._costs_iteration_s(failed, costs))
            self._choice_memo[key] = hit
        return hit

    # -- everyone else ------------------------------------------------------------------------------
    def baseline_iteration_s(self, stages: int, pipelines: int, microbatches: int) -> float:
        """Time per iteration of the baseline schedule of one pipeline of `stages` nodes running
        `microbatches` micro-batches, its all-reduce taken over `pipelines` replicas."""
        key = (stages, pipelines, microbatches)
        hit = self._baseline_memo.get(key)
        if hit is not None:
            return hit
        costs = self.workload.costs_at(stages, max(pipelines, 1))
        t0 = time.perf_counter()
        plan = make_plan(stages, 1, microbatches, costs, schedule=self.baseline.value,
                         optimizer="synchronous")
        self.stats.baseline_plan_s += time.perf_counter() - t0
        self.stats.baseline_plans += 1
        value = float(plan.time_per_iteration)
        self._baseline_memo[key] = value
        return value


def _spread(counts: list[int], sizes: tuple[int, ...]) -> list[frozenset[Worker]]:
    """Spread each stage's failures over the groups as evenly as possible, and inside a group over
    different pipelines (a rotating pointer), the way independent failures mostly fall."""
    groups: list[set[Worker]] = [set() for _ in sizes]
    pointer = [0] * len(sizes)
    turn = 0
    for s, f in enumerate(counts):
        for _ in range(f):
            for _try in range(len(sizes)):
                g = turn % len(sizes)
                turn += 1
                if sum(1 for _, st in groups[g] if st == s) < sizes[g]:
                    break
            d = pointer[g] % sizes[g]
            while (d, s) in groups[g]:
                d = (d + 1) % sizes[g]
            groups[g].add((d, s))
            pointer[g] = d + 1
    return [frozenset(g) for g in groups]
