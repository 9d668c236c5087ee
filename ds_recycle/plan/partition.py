"""Re-partitioning: which contiguous layers each stage holds while a failure lasts, and whether moving pays.

Re-routing keeps a job alive at once, but a stage that lost one of its ``D`` replicas does ``D / (D - 1)`` of
its work on each survivor while the other stages idle. Moving layers between neighbouring stages evens the
work out: the stage with fewer live replicas keeps fewer layers. Every pipeline keeps the same partition, so
the data-parallel reduction stays per layer; re-routing still covers the lost worker's micro-batches.

A *partition* is DeepSpeed's ``PipelineModule.parts``: ``S + 1`` layer boundaries, stage ``s`` holding layers
``parts[s]`` to ``parts[s + 1] - 1``. :class:`LayerCosts` gives per-layer durations (F, B, W, O) and the bytes
of model state a move transfers (parameters and optimizer state); :meth:`LayerCosts.stage_costs` turns a
partition into the planner's :class:`CostModel`, so the planner itself times every candidate.

    layers = LayerCosts.uniform(66, f=1, b=1, w=1, state_bytes=1e9, bandwidth=25e9)
    choice = choose_partition(layers, 4, 4, 8, failed=[(0, 1)], current=even_partition(66, 4))
    choice.partition, choice.moved_iteration_s, choice.move_s, choice.pays

The choice (:func:`choose_partition`): the partition that minimises the heaviest live worker's share of the
compute (each stage's layers' F + B + W over its live replicas), found exactly by dynamic programming, and the
partitions one boundary step away from it, each planned by the real planner, then a bounded climb from the fastest
of them (one to three boundaries a step at a time); the fastest plan wins. It moves
when the time it saves over ``horizon`` iterations exceeds the move's transfer (:func:`move_seconds`).

*Pinned* layers (``layer -> stage``) stay where they are in every partition considered: a ``TiedLayerSpec``'s
module is shared by several stages and is never moved (a GPT's tied embedding and head sit on the first and last
stage anyway, which always keep their first and last layer).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ds_recycle.plan.bounds import failures_per_stage
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.ops import Worker
from ds_recycle.plan.parts import Partition, check_partition

if TYPE_CHECKING:
    from ds_recycle.plan.plan import Plan

_KINDS = ("F", "B", "W", "O")

__all__ = ["Partition", "Pinned", "LayerCosts", "Move", "RepartitionChoice", "allowed", "check_partition",
           "even_partition", "balanced_partition", "granularity_bound", "layer_moves", "move_seconds",
           "choose_partition", "partitioned_plan"]


def even_partition(layers: int, stages: int) -> Partition:
    """Layers split as evenly as possible, the earlier stages taking the remainder."""
    if not 1 <= stages <= layers:
        raise PlanError(f"{stages} stages for {layers} layers: need 1 <= stages <= layers")
    base, extra = divmod(layers, stages)
    parts = [0]
    for s in range(stages):
        parts.append(parts[-1] + base + (1 if s < extra else 0))
    return tuple(parts)


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer durations and state, in the units of :class:`CostModel` (time) and bytes.

    ``F``, ``B``, ``W``, ``O`` hold one value per layer (``O``: the layer's share of the optimizer step and
    gradient reduction); ``state_bytes`` the bytes a worker receives to take the layer over (parameters and
    optimizer state, e.g. 16 bytes a parameter under mixed-precision Adam); ``bandwidth`` bytes per time unit
    between two workers; ``comm`` the activation transfer time (as :attr:`CostModel.comm`).
    """

    F: tuple[float, ...]
    B: tuple[float, ...]
    W: tuple[float, ...]
    O: tuple[float, ...]  # noqa: E741 - the plan format's kind names
    state_bytes: tuple[float, ...]
    bandwidth: float = math.inf
    comm: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.F)
        if n == 0:
            raise PlanError("layer costs: F is empty: give one value per layer")
        for kind in (*_KINDS, "state_bytes"):
            values = tuple(float(v) for v in getattr(self, kind))
            object.__setattr__(self, kind, values)
            if len(values) != n:
                raise PlanError(f"layer costs: {kind} has {len(values)} layers but F has {n}: one value per layer")
            for i, v in enumerate(values):
                if not math.isfinite(v) or v < 0:
                    raise PlanError(f"layer costs: {kind}[{i}] = {v}: must be finite and >= 0")
        if not self.bandwidth > 0:
            raise PlanError(f"layer costs: bandwidth = {self.bandwidth}: must be > 0 (bytes per time unit)")
        if not math.isfinite(self.comm) or self.comm < 0:
            raise PlanError(f"layer costs: comm = {self.comm}: must be finite and >= 0")

    @property
    def layers(self) -> int:
        return len(self.F)

    @classmethod
    def uniform(cls, layers: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, o: float = 0.0,
                state_bytes: float = 0.0, bandwidth: float = math.inf, comm: float = 0.0) -> LayerCosts:
        """``layers`` identical layers."""
        if layers < 1:
            raise PlanError(f"layers = {layers}: need at least 1")
        return cls((f,) * layers, (b,) * layers, (w,) * layers, (o,) * layers, (state_bytes,) * layers,
                   bandwidth, comm)

    def work(self, layer: int) -> float:
        """F + B + W of one micro-batch in ``layer``."""
        return self.F[layer] + self.B[layer] + self.W[layer]

    def stage_costs(self, parts: Sequence[int]) -> CostModel:
        """The planner's cost model of the model cut at ``parts``: each stage's sum over its layers."""
        parts = check_partition(parts, self.layers, len(parts) - 1)
        sums = {kind: tuple(math.fsum(getattr(self, kind)[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1))
                for kind in _KINDS}
        return CostModel(sums["F"], sums["B"], sums["W"], sums["O"], self.comm)

    def to_json(self) -> dict[str, Any]:
        return {"F": list(self.F), "B": list(self.B), "W": list(self.W), "O": list(self.O),
                "state_bytes": list(self.state_bytes), "bandwidth": self.bandwidth, "comm": self.comm}


Pinned = Mapping[int, int]
"""Layers that may not move: ``layer -> the stage that holds it``."""


def allowed(parts: Sequence[int], pinned: Pinned | None) -> bool:
    """Whether partition ``parts`` keeps every pinned layer on its stage."""
    return not pinned or all(parts[s] <= i < parts[s + 1] for i, s in pinned.items())


def _boundary_ranges(stages: int, layers: int, pinned: Pinned | None) -> list[tuple[int, int]]:
    """For each stage ``s``, the first layers it may start at (``lo`` to ``hi``) with every pinned layer kept."""
    ranges = []
    for s in range(stages):
        lo = max([i + 1 for i, t in (pinned or {}).items() if t < s], default=s)
        hi = min([i for i, t in (pinned or {}).items() if t >= s], default=layers - (stages - s))
        ranges.append((max(lo, s), min(hi, layers - (stages - s))))
    return ranges


def _live_per_stage(failed: Iterable[Worker], stages: int, pipelines: int,
                    slow: Mapping[Worker, float] | None = None) -> list[float]:
    """Each stage's live capacity in workers: a live worker counts 1, a slow one ``1 / factor``."""
    failed = frozenset(failed)
    live: list[float] = [float(pipelines - f) for f in failures_per_stage(failed, stages, pipelines)]
    for (p, s), factor in (slow or {}).items():
        if (p, s) not in failed and factor > 0:
            live[s] -= 1.0 - 1.0 / factor
    return live


def balanced_partition(costs: LayerCosts, stages: int, live: Sequence[float],
                       pinned: Pinned | None = None) -> Partition:
    """The contiguous partition minimising ``max_s work(s) / live[s]`` (ties: the smaller total of the
    per-worker shares), exact, by dynamic programming over (stage, last layer): ``O(S L^2)``; ``live[s]`` is stage
    ``s``'s capacity in workers (a slow worker counts less than 1); ``pinned`` layers stay on their stages."""
    n = costs.layers
    if not 1 <= stages <= n:
        raise PlanError(f"{stages} stages for {n} layers: need 1 <= stages <= layers")
    if len(live) != stages or not min(live) > 0:
        raise PlanError(f"live replicas per stage {list(live)}: give {stages} capacities, each above 0")
    for i, t in (pinned or {}).items():
        if not (0 <= i < n and 0 <= t < stages):
            raise PlanError(f"pinned layer {i} on stage {t}: the model has {n} layers on {stages} stages")
    ranges = _boundary_ranges(stages, n, pinned)
    prefix = [0.0]
    for i in range(n):
        prefix.append(prefix[-1] + costs.work(i))
    inf = (math.inf, math.inf)
    # best[s][j]: (heaviest share, sum of shares) of stages 0..s holding layers 0..j-1; cut[s][j]: start of stage s
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n - stages + 2):
        share = prefix[j] / live[0]
        best[0][j] = (share, share)
    for s in range(1, stages):
        for j in range(s + 1, n - (stages - s) + 2):
            lo, hi = ranges[s]
            for i in range(max(s, lo), min(j - 1, hi) + 1):
                prev = best[s - 1][i]
                if prev[0] == math.inf:
                    continue
                share = (prefix[j] - prefix[i]) / live[s]
                cand = (max(prev[0], share), prev[1] + share)
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    if best[stages - 1][n][0] == math.inf:
        raise PlanError(f"no partition of {n} layers over {stages} stages keeps the pinned layers {dict(pinned or {})} "
                        f"on their stages with a layer on every stage")
    parts = [n]
    j = n
    for s in range(stages - 1, 0, -1):
        j = cut[s][j]
        parts.append(j)
    parts.append(0)
    return tuple(reversed(parts))


def granularity_bound(costs: LayerCosts, stages: int, pipelines: int, failed: Iterable[Worker],
                      pinned: Pinned | None = None, slow: Mapping[Worker, float] | None = None) -> float:
    """Throughput kept at best against failure-free when layers can move: the failure-free heaviest worker's
    share over the heaviest share of the best partition of the live workers (no bubbles counted). With
    divisible work it is ``(S D - f) / (S D)``; whole layers make it lower."""
    failed = list(failed)
    full = balanced_partition(costs, stages, [pipelines] * stages, pinned)
    live = _live_per_stage(failed, stages, pipelines, slow)
    parts = balanced_partition(costs, stages, live, pinned)

    def heaviest(p: Partition, counts: Sequence[float]) -> float:
        return max(math.fsum(costs.work(i) for i in range(p[s], p[s + 1])) * pipelines / counts[s]
                   for s in range(stages))

    return heaviest(full, [pipelines] * stages) / heaviest(parts, live)


@dataclass(frozen=True)
class Move:
    """Layer ``layer`` goes from stage ``source`` to stage ``target`` (neighbours or not)."""

    layer: int
    source: int
    target: int


def layer_moves(before: Sequence[int], after: Sequence[int]) -> list[Move]:
    """Every layer whose stage differs between two partitions of the same model."""
    if len(before) != len(after) or before[-1] != after[-1]:
        raise PlanError(f"partitions {list(before)} and {list(after)} differ in stages or layers")

    def stage_of(parts: Sequence[int], layer: int) -> int:
        return next(s for s in range(len(parts) - 1) if parts[s] <= layer < parts[s + 1])

    return [Move(i, stage_of(before, i), stage_of(after, i)) for i in range(before[-1])
            if stage_of(before, i) != stage_of(after, i)]


def move_seconds(costs: LayerCosts, before: Sequence[int], after: Sequence[int]) -> float:
    """Transfer time of a re-partition: every live worker of a receiving stage pulls its new layers' state
    from a live holder at ``bandwidth``, all stages at once; the slowest receiver decides."""
    received: dict[int, float] = {}
    for mv in layer_moves(before, after):
        received[mv.target] = received.get(mv.target, 0.0) + costs.state_bytes[mv.layer]
    return max((b / costs.bandwidth for b in received.values()), default=0.0)


@dataclass(frozen=True)
class RepartitionChoice:
    """What :func:`choose_partition` decided and the figures it decided on."""

    current: Partition
    partition: Partition
    """The best partition found (``current`` when nothing beats it)."""
    current_iteration_s: float
    """Planned time per iteration staying on ``current`` (re-routing alone)."""
    moved_iteration_s: float
    """Planned time per iteration on ``partition``."""
    move_s: float
    """Transfer time of the move (:func:`move_seconds`)."""
    horizon: int
    candidates: int
    """Partitions planned."""

    @property
    def gain_s(self) -> float:
        """Time saved over the horizon, less the move."""
        return self.horizon * (self.current_iteration_s - self.moved_iteration_s) - self.move_s

    @property
    def pays(self) -> bool:
        """Whether moving saves time over the horizon (and the partition changes at all)."""
        return self.partition != self.current and self.gain_s > 0

    def describe(self) -> str:
        verdict = "move" if self.pays else "stay"
        return (f"{verdict}: {list(self.current)} -> {list(self.partition)}, "
                f"{self.current_iteration_s:.4g} -> {self.moved_iteration_s:.4g} per iteration, move "
                f"{self.move_s:.4g}, gain over {self.horizon} iterations {self.gain_s:.4g}")


PlanTimer = Callable[[CostModel], float]
"""Planned time per iteration of a cost model (for the failure set at hand)."""


def _neighbours(parts: Partition, pinned: Pinned | None, together: int = 1) -> list[Partition]:
    """The partitions with up to ``together`` boundaries of ``parts`` moved one layer each (either way)."""
    inner = range(1, len(parts) - 1)
    out = []
    for n in range(1, together + 1):
        for moved in itertools.combinations(inner, n):
            for steps in itertools.product((-1, 1), repeat=n):
                cand = list(parts)
                for s, step in zip(moved, steps, strict=True):
                    cand[s] += step
                if all(a < b for a, b in itertools.pairwise(cand)) and allowed(cand, pinned):
                    out.append(tuple(cand))
    return out


CLIMB = 40
"""Plans :func:`choose_partition` spends, by default, climbing from its first candidates."""


def choose_partition(costs: LayerCosts, stages: int, pipelines: int, microbatches: int,
                     failed: Iterable[Worker], current: Sequence[int], *, horizon: int = 50,
                     timer: PlanTimer | None = None, memory_limit: int | None = None,
                     pinned: Pinned | None = None, slow: Mapping[Worker, float] | None = None,
                     climb: int = CLIMB) -> RepartitionChoice:
    """The partition to train on while ``failed`` lasts, planned (see the module docstring); ``pinned`` layers
    stay on their stages; ``slow`` workers (``worker -> factor``) count as ``1 / factor`` of a worker and every
    candidate is planned with them slow.

    The candidates: the compute-balanced partition, those one boundary step from it, and the job's balanced cut.
    Then it climbs: the partitions with one to three boundaries a step from the fastest so far are planned, and
    the fastest becomes the next starting point, until none is faster or ``climb`` more plans are spent (0: no
    climb). With no failure and no slow worker it does not climb: the job's own cut is then the one to return
    to. Plan times are not monotone in the compute balance (bubbles absorb some extra work): at 4 x 4, M = 8,
    with a worker 2x slow and 16 layers a stage, the first candidates plan at best 1.072 of the failure-free
    iteration, the climb 1.065 (32 layers a stage: 1.065 and 1.055).

    ``timer`` times a cost model for this failure set (default: the adaptive planner's ``make_plan``);
    :class:`~ds_recycle.plan.errors.StageLostError` when a stage has no live replica.
    """
    if horizon < 0:
        raise PlanError(f"horizon = {horizon}: give a number of iterations >= 0")
    if climb < 0:
        raise PlanError(f"climb = {climb}: give a number of plans >= 0")
    failed = frozenset((int(p), int(s)) for p, s in failed)
    current = check_partition(current, costs.layers, stages, "current partition")
    if not allowed(current, pinned):
        raise PlanError(f"current partition {list(current)} moves a pinned layer ({dict(pinned or {})})")
    if timer is None:
        from ds_recycle.plan.schedules import make_plan

        def timer(c: CostModel) -> float:
            return make_plan(stages, pipelines, microbatches, c.with_slow(slow or {}), failed,
                             memory_limit=memory_limit).time_per_iteration
    live = _live_per_stage(failed, stages, pipelines, slow)
    seed = balanced_partition(costs, stages, live, pinned)
    timed: dict[Partition, float] = {current: timer(costs.stage_costs(current))}
    for cand in [seed, *_neighbours(seed, pinned), balanced_partition(costs, stages, [pipelines] * stages, pinned)]:
        if cand not in timed:
            timed[cand] = timer(costs.stage_costs(cand))

    def best() -> Partition:
        return min(timed, key=lambda p: (timed[p], p != current, move_seconds(costs, current, p)))

    spent, start = 0, None
    while (failed or slow) and spent < climb and best() != start:
        start = best()
        for cand in _neighbours(start, pinned, together=3):
            if spent >= climb:
                break
            if cand not in timed:
                timed[cand] = timer(costs.stage_costs(cand))
                spent += 1
    chosen = best()
    return RepartitionChoice(current, chosen, timed[current], timed[chosen], move_seconds(costs, current, chosen),
                             horizon, len(timed))


def partitioned_plan(costs: LayerCosts, parts: Sequence[int], stages: int, pipelines: int, microbatches: int,
                     failed: Iterable[Worker] = (), slow: Mapping[Worker, float] | None = None,
                     **options: Any) -> Plan:
    """The planner's plan for the model cut at ``parts`` (``make_plan`` on :meth:`LayerCosts.stage_costs`, with
    ``slow`` workers), carrying the partition (the plan format's ``partition``); ``options`` pass through to
    ``make_plan``."""
    from ds_recycle.plan.schedules import make_plan

    parts = check_partition(parts, costs.layers, stages)
    plan = make_plan(stages, pipelines, microbatches, costs.stage_costs(parts).with_slow(slow or {}), failed,
                     **options)
    return dataclasses.replace(plan, partition=parts)
