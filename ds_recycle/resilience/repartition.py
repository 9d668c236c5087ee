"""Lasting failures: the members move layers between stages once a membership has lasted, and back for a rejoin.

Re-routing covers a failure at once; when it lasts, every live worker's work can even out by moving layers
(:mod:`ds_recycle.plan.partition`, ``recycle.repartition``). At each iteration boundary the
:class:`Repartitioner` of every member sees the same membership (the failure set) and the same iteration:

1. When the membership changes, the *deciding rank* (the lowest member) starts choosing: the best partition of
   the layers for the live replicas, each candidate timed by the planner from the current partition, and the plan
   for it. The planner is pure Python and a choice takes seconds, so it runs in a child process
   (:mod:`ds_recycle.plan.choice_process`; a thread of the deciding rank only waits for it): the training thread
   keeps its interpreter to itself.
2. ``after_iterations`` boundaries later it writes the decision to the store (under the generation's root:
   ``repartition/<round>/<iteration>``): stay, or the partition with its plan (the plan format); the others wait
   for it there (bounded; a member lost meanwhile is a failure like any other). A move pays when the time it saves
   over ``horizon`` iterations, at the iteration time measured since the membership changed, exceeds its transfer
   (the moved layers' parameters and Adam state, 16 bytes a parameter, at ``bandwidth_gbs``).
3. Everyone calls ``engine.repartition(plan)`` at that boundary: the layers move from live holders and the new plan
   runs from that iteration on (:mod:`ds_recycle.engine.layer_move`).

A worker found slow (``recycle.fail_slow``) is partial capacity: once the plan that assumes it has run
``after_iterations`` iterations, the same choice runs with that worker counted as ``1 / factor`` of one (its stage
keeps fewer layers), planned with it slow; when it is fast again the plan stops assuming it and the choice, made
again, moves the layers back.

Before a restarted worker is admitted the members move back to the job's own partition (:meth:`restore`), which
the joiner's module was built with; the joiner then takes its stage's state as usual. Before a checkpoint they
move back too, so that its files are the job's own partition's (DeepSpeed's loader and any membership read them),
and decide again ``after_iterations`` later. A failure after a move is
recovered like any other: the new membership keeps the moved layers (its plan is the cached one for the failure
set, which runs on any partition), and lasts long enough to be decided again from there.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_recycle.config.schema import RepartitionConfig
from ds_recycle.engine.layer_move import spec_parameters
from ds_recycle.engine.position import Position
from ds_recycle.events import Event, RepartitionEvent
from ds_recycle.plan import CostModel, Plan
from ds_recycle.plan.choice_process import choice_request, choose_in_child
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.partition import LayerCosts, Partition, layer_moves

__all__ = ["Repartitioner", "layer_costs_of", "Decision"]

logger = logging.getLogger(__name__)

CHOICE_TIMEOUT_S = 600.0
"""The longest a partition choice may take (its child process is then killed and the members stay)."""

_BYTES_PER_PARAM = 16
"""Parameter, gradient-free Adam state and master copy a moved parameter carries, at most (mixed-precision Adam:
ZeRO, arXiv 1910.02054, section 3.1); fp32 Adam carries 12."""


def layer_costs_of(specs: Sequence[Any], parts: Sequence[int], costs: CostModel, cfg: RepartitionConfig) -> LayerCosts:
    """Per-layer costs of the job's model: ``cfg.layer_costs_file``, or each stage's costs split evenly over its
    layers that hold parameters (counted on the meta device); the moved bytes from each layer's parameter count."""
    numel = [sum(spec_parameters(spec)) for spec in specs]
    state = tuple(float(_BYTES_PER_PARAM * n) for n in numel)
    if cfg.layer_costs_file is not None:
        path = Path(cfg.layer_costs_file)
        try:
            raw = json.loads(path.read_text())
            kinds = {k: tuple(float(v) for v in raw[k]) for k in ("F", "B", "W")}
            o = tuple(float(v) for v in raw.get("O", [0.0] * len(specs)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlanError(f"recycle.repartition.layer_costs_file {str(path)!r}: {e!r}. Fix: a JSON object with F, "
                            f"B, W lists (and optionally O), one value per layer of the PipelineModule "
                            f"({len(specs)})") from e
        if any(len(v) != len(specs) for v in (*kinds.values(), o)):
            raise PlanError(f"recycle.repartition.layer_costs_file {str(path)!r}: {len(specs)} layers in the model, "
                            f"lists of {sorted({len(v) for v in kinds.values()})}. Fix: one value per layer")
        return LayerCosts(kinds["F"], kinds["B"], kinds["W"], o, state, comm=costs.comm)
    out: dict[str, list[float]] = {k: [0.0] * len(specs) for k in ("F", "B", "W", "O")}
    for s in range(len(parts) - 1):
        holding = [i for i in range(parts[s], parts[s + 1]) if numel[i] > 0] or list(range(parts[s], parts[s + 1]))
        for kind in out:
            for i in holding:
                out[kind][i] = costs.of(kind, s) / len(holding)
    return LayerCosts(tuple(out["F"]), tuple(out["B"]), tuple(out["W"]), tuple(out["O"]), state, comm=costs.comm)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Decision:
    """What the deciding rank wrote: the partition to move to (None: stay) and the plan for it."""

    partition: Partition | None
    plan: dict[str, Any] | None
    planned_before: float
    planned_after: float
    why: str

    def to_json(self) -> str:
        return json.dumps({"partition": None if self.partition is None else list(self.partition), "plan": self.plan,
                           "planned_before": self.planned_before, "planned_after": self.planned_after,
                           "why": self.why})

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        raw = json.loads(text)
        return cls(None if raw["partition"] is None else tuple(raw["partition"]), raw["plan"],
                   float(raw["planned_before"]), float(raw["planned_after"]), str(raw["why"]))


def settle_move(positions: Mapping[int, Position], rank: int) -> str | None:
    """What member ``rank`` does after a failure with a layer move it received and did not install: ``"complete"``
    when some survivor holds that partition (it passed the move's barrier: every member had received its layers
    then), ``"drop"`` when none does, None when it has no such move. Raises ``RuntimeError`` when the survivors
    would still hold different partitions (cannot happen but by a bug: the job falls back)."""
    held = {p.partition for p in positions.values()}
    final = {q: p.pending if p.pending and p.pending in held else p.partition for q, p in positions.items()}
    if len(set(final.values())) > 1:
        raise RuntimeError(f"the survivors hold different layer partitions after a move: {final}")
    mine = positions[rank].pending
    if not mine:
        return None
    return "complete" if mine in held else "drop"


def _slow(engine: Any) -> dict[tuple[int, int], float]:
    """The workers the engine's running plan assumes slow, with their factors (fail-slow, ``recycle.fail_slow``)."""
    costs = getattr(engine.plan, "costs", None)
    return costs.slow_workers() if costs is not None else {}


class Repartitioner:
    """Every member's side of the protocol in the module docstring."""

    def __init__(self, cfg: RepartitionConfig, layers: LayerCosts, base: Partition, microbatches: int,
                 plan_options: dict[str, Any], store: Any, root: str, wait_alive: Callable[[], None],
                 in_move: Callable[[str], None] | None = None) -> None:
        self.cfg, self.layers, self.base = cfg, layers, tuple(base)
        self.microbatches = microbatches
        self.plan_options = plan_options
        self.store, self.root = store, root
        self.wait_alive = wait_alive
        """Raises :class:`~ds_recycle.resilience.errors.PeerFailure` when a member is lost (checked while waiting)."""
        self.in_move = in_move
        """Called at the points of a move (``engine.repartition``'s ``between``: fault injection)."""
        self._key: tuple[int, frozenset[tuple[int, int]], Partition, frozenset[tuple[int, int]]] | None = None
        self._decide_at: int | None = None
        """The boundary at which the current membership is decided (None: nothing to decide)."""
        self._stamps: list[float] = []
        self._thread: threading.Thread | None = None
        self._decision: Decision | None = None

    def _membership(self, engine: Any, round_: int) -> tuple[int, frozenset[tuple[int, int]], Partition,
                                                              frozenset[tuple[int, int]]]:
        """What a decision is for: the round, the absent workers, the partition held, the workers the running plan
        assumes slow (their factors are read when the choice starts)."""
        return round_, frozenset(engine.workers.absent()), engine.partition, frozenset(_slow(engine))

    def at_boundary(self, engine: Any, round_: int, members: Sequence[int]) -> list[Event]:
        """Run at every iteration boundary by every member (after ``finish_step``); returns the events."""
        if not self.cfg.enabled or engine.layers_fixed is not None or engine.repair is not None:
            return []
        key = self._membership(engine, round_)
        now = time.monotonic()
        if key != self._key:
            self._key, self._stamps, self._decision = key, [now], None
            _, absent, parts, slow = key
            self._decide_at = (engine.iteration + self.cfg.after_iterations if absent or slow or parts != self.base
                               else None)
            if self._decide_at is not None and engine.global_rank == min(members):
                self._thread = threading.Thread(target=self._choose, args=(engine, absent, parts, _slow(engine)),
                                                daemon=True, name="ds-recycle-repartition")
                self._thread.start()
            return []
        self._stamps.append(now)
        _, absent, parts, _ = key
        if engine.iteration != self._decide_at:
            return []
        self._decide_at = None
        decision = self._decide(engine, round_, members)
        if decision.partition is None:
            logger.info("repartition: staying on %s (%s)", list(parts), decision.why)
            return []
        assert decision.plan is not None
        return [self._move(engine, Plan.from_json(decision.plan), parts, absent, decision)]

    def restore(self, engine: Any, plan: Any, again: bool = False) -> Event | None:
        """Move back to the job's own partition (every member at the same boundary: before a rejoin, before a
        checkpoint). ``again``: the membership is decided again ``after_iterations`` later (the failure lasts)."""
        parts = engine.partition
        if parts == self.base or engine.layers_fixed is not None:
            return None
        decision = Decision(self.base, None, float("nan"), float("nan"), "back to the job's own partition")
        event = self._move(engine, plan, parts, frozenset(engine.workers.absent()), decision)
        if again:
            self._key = None
        return event

    def _move(self, engine: Any, plan: Any, parts: Partition, absent: frozenset[tuple[int, int]],
              decision: Decision) -> RepartitionEvent:
        started = time.monotonic()
        moved = engine.repartition(plan, self.in_move)
        mine = [t for t in moved if t.dst == engine.global_rank]
        received = int(sum(self.layers.state_bytes[t.layer] for t in mine))
        event = RepartitionEvent(iteration=engine.iteration, before=parts, after=engine.partition,
                                 absent=tuple(sorted(absent)), layers_moved=len(layer_moves(parts, engine.partition)),
                                 bytes_received=received, move_s=time.monotonic() - started,
                                 planned_before=_finite(decision.planned_before),
                                 planned_after=_finite(decision.planned_after))
        self._key = self._membership(engine, self._key[0] if self._key else 0)
        self._decide_at = None  # decided: the next membership change decides again
        return event

    def _choose(self, engine: Any, absent: frozenset[tuple[int, int]], parts: Partition,
                slow: dict[tuple[int, int], float]) -> None:
        S, D, M = engine.num_stages, engine.workers.pipelines, self.microbatches
        request = choice_request(self.layers, S, D, M, absent, parts, horizon=self.cfg.horizon,
                                 pinned=engine.pinned_layers, slow=slow, plan_options=self.plan_options)
        try:
            got = choose_in_child(request, CHOICE_TIMEOUT_S)
            partition = tuple(got["partition"])
            self._decision = Decision(partition, got["plan"] if partition != parts else None,
                                      float(got["planned_before"]), float(got["planned_after"]), str(got["why"]))
        except Exception as e:  # a decision that cannot be made is "stay", said once
            logger.warning("repartition: no decision for absent %s: %r", sorted(absent), e)
            self._decision = Decision(None, None, float("nan"), float("nan"), f"planning failed: {e!r}")

    def _pays(self, decision: Decision, parts: Partition) -> tuple[bool, str]:
        if decision.partition is None or decision.partition == parts:
            return False, decision.why
        gaps = [b - a for a, b in zip(self._stamps, self._stamps[1:])]
        iteration_s = statistics.median(gaps) if gaps else 0.0
        saved = self.cfg.horizon * iteration_s * (1.0 - decision.planned_after / decision.planned_before)
        moved = math.fsum(self.layers.state_bytes[m.layer] for m in layer_moves(parts, decision.partition))
        cost = moved / (self.cfg.bandwidth_gbs * 1e9)
        why = (f"{decision.why}; measured {iteration_s:.3f} s/iteration: saves {saved:.2f} s over {self.cfg.horizon} "
               f"iterations, moving {moved / 1e6:.3g} MB takes {cost:.2f} s")
        return saved > cost, why

    def _decide(self, engine: Any, round_: int, members: Sequence[int]) -> Decision:
        key = f"{self.root}/repartition/{round_}/{engine.iteration}"
        if engine.global_rank == min(members):
            if self._thread is not None:
                while self._thread.is_alive():
                    self._thread.join(timeout=0.05)
                    self.wait_alive()
            decision = self._decision or Decision(None, None, float("nan"), float("nan"), "no decision made")
            pays, why = self._pays(decision, engine.partition)
            if not pays:
                decision = Decision(None, None, decision.planned_before, decision.planned_after, why)
            else:
                decision = Decision(decision.partition, decision.plan, decision.planned_before,
                                    decision.planned_after, why)
            self.store.set(key, decision.to_json())
            return decision
        while not self.store.check([key]):
            self.wait_alive()
            time.sleep(0.01)
        return Decision.from_json(self.store.get(key))
