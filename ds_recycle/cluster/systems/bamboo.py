"""Bamboo: redundant computation; a failed node's predecessor already holds and runs its stage.

Model (after "Bamboo: Making Preemptible Instances Resilient for Affordable Training of Large DNNs",
NSDI 2023, and the Bamboo model in Oobleck's public simulator):

- Steady state: every node also holds its successor's stage (twice the model state a node holds) and
  computes it redundantly, so the throughput is the baseline's times (1 - `bamboo_overhead`).
- A node fails: if its predecessor in the pipeline (cyclically, as Bamboo pairs the last stage with the
  first) is alive and not already covering a failed node, it takes the stage over at once (no work
  lost) and the job runs `bamboo_failover_slowdown` times slower until the next re-balance.
- Two adjacent nodes lost (the predecessor already covers one, or the failed node was covering one):
  the redundancy is gone: roll back to the last checkpoint and restart (`restart_s`).
- Re-balance (`bamboo_reconfigure_s`, a rendezvous) when the waiting nodes can relieve the overloaded
  ones, when 2 x overloaded / active > `bamboo_reconfigure_threshold`, or when one more pipeline fits;
  then P = live // S pipelines, keeping the global batch by gradient accumulation.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ds_recycle.cluster.ledger import Phase
from ds_recycle.cluster.systems.base import SimContext, System, SystemKind

__all__ = ["Bamboo"]

Coord = tuple[int, int]  # (pipeline, stage)


class Bamboo(System):
    kind = SystemKind.BAMBOO

    def __init__(self, ctx: SimContext) -> None:
        need, have = ctx.assumptions.bamboo_node_state_gb, ctx.timer.workload.hardware.node_memory_gb
        if need > have:
            raise ValueError(f"Bamboo needs {need:.0f} GB of model state a node (its stage and its "
                             f"successor's), more than the node's {have:.0f} GB. Fix: more stages, or "
                             "leave bamboo out of --systems")
        self.coords: dict[Coord, str] = {}
        self.runs: dict[str, list[Coord]] = {}
        self.pipelines = 0
        super().__init__(ctx)

    def reference_rate(self) -> float:
        """Failure-free *without* redundancy: the overhead shows as lost effective time."""
        return self.full_batch_rate(self.shape.stages, self.shape.pipelines)[0]

    def _overloaded(self) -> int:
        return sum(1 for c in self.runs.values() if len(c) > 1)

    def _apply(self) -> None:
        rate, it = self.full_batch_rate(self.shape.stages, self.pipelines)
        factor = 1.0 - self.a.bamboo_overhead
        if self._overloaded():
            factor /= self.a.bamboo_failover_slowdown
        self.ledger.set_rate(rate * factor, it / factor if factor > 0 else math.inf)

    def _rebuild(self) -> None:
        pool = list(self.runs) + self.idle
        S = self.shape.stages
        self.pipelines = min(self.shape.pipelines, len(pool) // S)
        self.coords, self.runs = {}, {}
        for i, node in enumerate(pool[: self.pipelines * S]):
            coord = (i // S, i % S)
            self.coords[coord] = node
            self.runs[node] = [coord]
        self.idle = pool[self.pipelines * S:]

    def start(self, t: float, nodes: Sequence[str]) -> None:
        self.idle = list(nodes)
        self._rebuild()
        self._apply()

    def on_remove(self, t: float, node: str) -> None:
        if node in self.idle:
            self.idle.remove(node)
            return
        held = self.runs.pop(node)
        if len(held) > 1 or not self._failover(held[0]):
            self._fatal(t, node)
            return
        self._apply()
        self._maybe_rebalance(t)

    def _failover(self, coord: Coord) -> bool:
        p, s = coord
        pred = self.coords.get((p, (s - 1) % self.shape.stages))
        if pred is None or pred not in self.runs or len(self.runs[pred]) > 1 or self.shape.stages == 1:
            return False
        self.runs[pred].append(coord)
        self.coords[coord] = pred
        return True

    def _fatal(self, t: float, node: str) -> None:
        self.note(t, f"{node}: adjacent nodes lost, restart from checkpoint")
        self.ledger.rollback()
        self._rebuild()
        if self.pipelines:
            self.restart()
        self._apply()

    def on_ready(self, t: float, node: str) -> None:
        self.idle.append(node)
        if self.pipelines == 0:
            self._rebuild()
            if self.pipelines:
                self.ledger.rollback()
                self.restart()
                self._apply()
            return
        self._maybe_rebalance(t)

    def _maybe_rebalance(self, t: float) -> None:
        over = self._overloaded()
        active = len(self.runs)
        grow = (active + len(self.idle)) // self.shape.stages > self.pipelines \
            and self.pipelines < self.shape.pipelines
        relieve = over > 0 and len(self.idle) >= over
        risky = over > 0 and active > 0 and 2 * over / active > self.a.bamboo_reconfigure_threshold
        if not (grow or relieve or risky):
            return
        self.note(t, "re-balance")
        self._rebuild()
        if self.pipelines:
            self.ledger.pause(Phase.RECONFIGURING, self.a.bamboo_reconfigure_s)
        self._apply()
