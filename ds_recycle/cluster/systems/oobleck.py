"""Oobleck: pipelines re-instantiated from templates of any depth, the batch redistributed.

Model (after "Oobleck: Resilient Distributed Training of Large Models Using Pipeline Templates",
arXiv 2309.08125, and its public simulator):

- The job is a set of pipelines of n_i nodes each, `oobleck_min_nodes` <= n_i <= S (we cap at S and
  at D pipelines so that no system uses more nodes than the others); a template of n nodes splits the
  model's layers over n stages (`Workload.costs_at(n, P)`).
- A failure costs the iteration in flight and `oobleck_reconfigure_s`. The broken pipeline goes on with
  one node fewer if it stays at or above the minimum; otherwise it borrows a node from the largest
  pipeline that can spare one; otherwise its nodes are merged into the other pipelines (one pipeline
  fewer). With no pipeline left: roll back and restart from the checkpoint.
- A ready node (or a spare, right after a failure) joins the smallest pipeline below S nodes, or forms a new pipeline once S nodes wait
  (a reconfiguration each time).
- The global batch of D x M micro-batches is split among pipelines to minimise the slowest one's time
  (each pipeline's time from the planner's baseline plan for its depth and share); the iteration time
  is the slowest pipeline's.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ds_recycle.cluster.systems.base import SimContext, System, SystemKind

__all__ = ["Oobleck", "distribute_batch"]


class Oobleck(System):
    kind = SystemKind.OOBLECK

    def __init__(self, ctx: SimContext) -> None:
        self.pipes: list[list[str]] = []
        super().__init__(ctx)

    def reference_rate(self) -> float:
        return self.full_batch_rate(self.shape.stages, self.shape.pipelines)[0]

    # -- rate ---------------------------------------------------------------------------------------
    def _apply(self) -> None:
        if not self.pipes:
            self.ledger.set_rate(0.0, math.inf)
            return
        total = self.shape.pipelines * self.shape.microbatches
        p = len(self.pipes)
        time_of = lambda n, m: self.timer.baseline_iteration_s(n, p, m)  # noqa: E731
        it = distribute_batch([len(pipe) for pipe in self.pipes], total, time_of)[1]
        self.ledger.set_rate(self.timer.samples_per_iteration / it, it)

    # -- hooks ----------------------------------------------------------------------------------------
    def start(self, t: float, nodes: Sequence[str]) -> None:
        S, D = self.shape.stages, self.shape.pipelines
        nodes = list(nodes)
        count = min(D, len(nodes) // max(self.a.oobleck_min_nodes, 1))
        used = min(len(nodes), count * S)
        self.pipes = [[] for _ in range(count)]
        for i, node in enumerate(nodes[:used]):
            self.pipes[i // S if used == count * S else i % count].append(node)
        self.idle = nodes[used:]
        self._apply()

    def on_remove(self, t: float, node: str) -> None:
        if node in self.idle:
            self.idle.remove(node)
            return
        pipe = next(p for p in self.pipes if node in p)
        pipe.remove(node)
        self._repair(pipe)
        if not self.pipes:
            self.note(t, "no pipeline left: restart from checkpoint")
            self.ledger.rollback()
            self._regroup_idle()
            if self.pipes:
                self.restart()
            self._apply()
            return
        self.ledger.lose_inflight()
        self._absorb_idle()
        self.reconfigure(self.a.oobleck_reconfigure_s)
        self._apply()

    def _absorb_idle(self) -> None:
        """Waiting nodes (spares) fill the shortest pipelines below S nodes."""
        while self.idle:
            short = [p for p in self.pipes if len(p) < self.shape.stages]
            if not short:
                return
            min(short, key=len).append(self.idle.pop(0))

    def _repair(self, pipe: list[str]) -> None:
        low = self.a.oobleck_min_nodes
        if len(pipe) >= low:
            return
        donor = max((p for p in self.pipes if p is not pipe), key=len, default=None)
        if donor is not None and len(donor) > low:
            pipe.append(donor.pop())
            return
        self.pipes.remove(pipe)
        for node in pipe:
            target = min(self.pipes, key=len, default=None)
            if target is not None and len(target) < self.shape.stages:
                target.append(node)
            else:
                self.idle.append(node)

    def _regroup_idle(self) -> None:
        low, S = self.a.oobleck_min_nodes, self.shape.stages
        while len(self.idle) >= low and len(self.pipes) < self.shape.pipelines:
            take = min(S, len(self.idle))
            self.pipes.append(self.idle[:take])
            self.idle = self.idle[take:]

    def on_ready(self, t: float, node: str) -> None:
        self.idle.append(node)
        was_empty = not self.pipes
        short = [p for p in self.pipes if len(p) < self.shape.stages]
        if short:
            min(short, key=len).append(self.idle.pop())
        elif len(self.pipes) < self.shape.pipelines and len(self.idle) >= self.shape.stages:
            self._regroup_idle()
        else:
            return
        if was_empty:
            self.ledger.rollback()
            self.restart()
        else:
            self.reconfigure(self.a.oobleck_reconfigure_s)
        self._apply()


def distribute_batch(sizes: list[int], total: int,
                     time_of: Callable[[int, int], float]) -> tuple[list[int], float]:
    """Split `total` micro-batches over pipelines of `sizes` nodes to minimise the slowest pipeline.

    `time_of(n, m)` is the iteration time of an n-node pipeline running m micro-batches (increasing
    in m). Binary search on the target time T: each pipeline takes the most micro-batches it can
    finish within T; the smallest T whose shares cover `total` wins; the surplus is taken back from
    the slowest pipelines. Pipelines of equal depth get equal shares (up to one).
    """
    if not sizes or total < 1:
        raise ValueError(f"distribute_batch: sizes={sizes}, total={total}: need pipelines and work")
    classes = sorted(set(sizes))
    counts = {n: sizes.count(n) for n in classes}
    weight = sum(sizes)

    def most_within(n: int, limit: float) -> int:
        # a share beyond twice the depth-proportional one is never optimal: bracket the search there
        lo, hi = 0, min(total, 2 * math.ceil(total * n / weight) + 2)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if time_of(n, mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def covered(limit: float) -> bool:
        return sum(counts[n] * most_within(n, limit) for n in classes) >= total

    lo = 0.0
    hi = max(time_of(n, math.ceil(total * n / weight) + 1) for n in classes)
    for _ in range(50):
        mid = (lo + hi) / 2
        if covered(mid):
            hi = mid
        else:
            lo = mid
    best = {n: most_within(n, hi) for n in classes}
    shares = [best[n] for n in sizes]
    surplus = sum(shares) - total
    for i in sorted(range(len(sizes)), key=lambda k: -time_of(sizes[k], shares[k])):
        if surplus <= 0:
            break
        if shares[i] > 0:
            shares[i] -= 1
            surplus -= 1
    used = [(n, m) for n, m in zip(sizes, shares) if m > 0]
    return shares, max(time_of(n, m) for n, m in used)
