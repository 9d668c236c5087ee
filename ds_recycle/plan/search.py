"""Bounded local search over the greedy's inputs, with the list scheduler as the objective.

The list scheduler (:mod:`listsched`) turns a routing (who runs each orphan) and micro-batch priorities
(its ``rank``) into a complete, exactly timed plan. The search perturbs those two inputs and keeps a change
when the makespan does not grow (equal moves are taken, so it can cross plateaus):

* swap the priorities of two micro-batches (which the first stage feeds first, who wins a tie);
* move a micro-batch's priority to another place in the order;
* swap the workers of two orphans of one stage (loads stay as they are);
* move one orphan from a peer carrying one more micro-batch to a peer carrying one fewer (which peers
  take the extra micro-batches when ``D - f_s`` does not divide ``D*M``; loads stay within one).

Every candidate is a list-scheduler plan, so it obeys the memory limit and keeps each channel's transfers
in one order. The search is seeded and counts evaluations (no clock), so its result depends only on its
inputs: caches and tests get the same plan on every machine. It runs at plan-making time; a lookup at
failure time stays a dictionary access.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import DeadlockError
from ds_recycle.plan.listsched import Policy, list_schedule
from ds_recycle.plan.ops import MicroBatch, Op, Worker
from ds_recycle.plan.routing import Routing

__all__ = ["Candidate", "improve"]


@dataclass(frozen=True)
class Candidate:
    """One evaluated point: its inputs, the plan they give and its makespan."""

    routing: Routing
    rank: dict[MicroBatch, int]
    workers: dict[Worker, tuple[Op, ...]]
    makespan: float


def _span(workers: dict[Worker, tuple[Op, ...]]) -> float:
    return max(ops[-1].end for ops in workers.values())


def improve(start: Candidate, stages: int, pipelines: int, microbatches: int, costs: CostModel,
            failed: frozenset[Worker], iterations: int, synchronous: bool, policy: Policy, evaluations: int,
            seed: int = 0) -> Candidate:
    """The best candidate found in ``evaluations`` list-scheduler runs from ``start``."""
    rng = random.Random(seed)
    best = current = start
    orphans = [(s, mb) for s in range(stages) for mb, p in start.routing[s].items() if p != mb[0]]  # failed or offloaded
    for _ in range(evaluations):
        routing, rank = _neighbour(current, orphans, rng)
        try:
            workers = list_schedule(stages, pipelines, microbatches, costs, routing, failed, iterations,
                                    synchronous, policy, rank)
        except DeadlockError:
            continue
        span = _span(workers)
        if span <= current.makespan + 1e-12:
            current = Candidate(routing, rank, workers, span)
            if span < best.makespan - 1e-12:
                best = current
    return best


def _neighbour(c: Candidate, orphans: list[tuple[int, MicroBatch]],
               rng: random.Random) -> tuple[Routing, dict[MicroBatch, int]]:
    move = rng.randrange(4 if orphans else 2)
    if move < 2:
        return c.routing, (_swap_ranks(c.rank, rng) if move == 0 else _insert_rank(c.rank, rng))
    routing = [dict(table) for table in c.routing]
    s, mb = orphans[rng.randrange(len(orphans))]
    table = routing[s]
    if move == 2:
        same = [o for t, o in orphans if t == s and table[o] != table[mb]]
        if same:
            other = same[rng.randrange(len(same))]
            table[mb], table[other] = table[other], table[mb]
        return routing, c.rank
    load: dict[int, int] = {}
    for p in table.values():
        load[p] = load.get(p, 0) + 1
    lighter = [p for p, n in load.items() if n == load[table[mb]] - 1]
    if lighter:
        table[mb] = lighter[rng.randrange(len(lighter))]
    return routing, c.rank


def _swap_ranks(rank: dict[MicroBatch, int], rng: random.Random) -> dict[MicroBatch, int]:
    out = dict(rank)
    a, b = rng.sample(list(out), 2) if len(out) > 1 else (next(iter(out)),) * 2
    out[a], out[b] = out[b], out[a]
    return out


def _insert_rank(rank: dict[MicroBatch, int], rng: random.Random) -> dict[MicroBatch, int]:
    order = sorted(rank, key=rank.__getitem__)
    mb = order.pop(rng.randrange(len(order)))
    order.insert(rng.randrange(len(order) + 1), mb)
    return {m: i for i, m in enumerate(order)}
