"""A plan's op orders as the engine runs them: a split W held until its row's earlier micro-batches are added.

A worker that runs every micro-batch of its own pipeline at its stage adds their weight gradients to one sum,
in micro-batch order (:mod:`ds_recycle.engine.row_order`). A split W of its own micro-batch ``i`` that a plan
places before the W of some ``j < i`` is held by the engine and run right after the last of them. A W that
directly follows its own B where the engine fuses the two (every first stage; every stage of a ``1f1b`` plan)
runs where planned: the fused backward computes it then and only the addition waits, which costs nothing.

:func:`engine_orders` gives each worker's order with the held W moved; simulating it under the plan's costs
gives the time the engine would take. The planner keeps split W in order (:mod:`.listsched`), so for its
plans the two agree unless a memory limit forced a W out of order.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ds_recycle.plan.ops import MicroBatch, Op, OpKind, Worker

__all__ = ["engine_orders", "held_ws"]


def _summed(workers: Mapping[Worker, Sequence[Op]]) -> set[Worker]:
    """The workers that run every micro-batch of their own pipeline at their stage."""
    elsewhere: set[tuple[int, int]] = set()  # (stage, pipeline) with a micro-batch run on another pipeline's worker
    for (p, s), ops in workers.items():
        for op in ops:
            if op.kind is OpKind.F and op.mb is not None and op.mb[0] != p:
                elsewhere.add((s, op.mb[0]))
    return {w for w in workers if (w[1], w[0]) not in elsewhere}


def engine_orders(workers: Mapping[Worker, Sequence[Op]], fuse_all: bool = False) -> dict[Worker, list[Op]]:
    """Each worker's ops in the order the engine runs them (see the module docstring); ``fuse_all``: a ``1f1b``
    plan, whose adjacent B and W are fused at every stage."""
    summed = _summed(workers)
    return {w: (_reorder(ops, w[0], fuse_all or w[1] == 0)[0] if w in summed else list(ops))
            for w, ops in workers.items()}


def held_ws(workers: Mapping[Worker, Sequence[Op]], fuse_all: bool = False) -> int:
    """How many split W the engine would hold (run later than the plan places them)."""
    summed = _summed(workers)
    return sum(_reorder(ops, w[0], fuse_all or w[1] == 0)[1] for w, ops in workers.items() if w in summed)


def _reorder(ops: Sequence[Op], own: int, fuse: bool) -> tuple[list[Op], int]:
    """The order the engine runs ``ops`` in, and how many W it holds."""
    out: list[Op] = []
    held: dict[tuple[int, int], Op] = {}
    aside: set[tuple[int, int]] = set()  # fused W run where planned, their addition waiting for predecessors
    done: set[tuple[int, int]] = set()
    holds = 0
    previous: Op | None = None
    for op in ops:
        if op.kind is OpKind.O:  # the engine adds what is still held before the step
            out.extend(held.pop(key) for key in sorted(key for key in held if key[0] == op.iteration))
        mb: MicroBatch | None = op.mb
        if op.kind is not OpKind.W or mb is None or mb[0] != own:
            out.append(op)
            previous = op
            continue
        k, i = op.iteration, mb[1]
        fused = (fuse and previous is not None and previous.kind is OpKind.B and previous.mb == mb
                 and previous.iteration == k)
        previous = op
        ready = all((k, j) in done for j in range(i))
        if fused:
            out.append(op)
            if not ready:
                aside.add((k, i))
                continue
        elif ready:
            out.append(op)
        else:
            held[(k, i)] = op
            holds += 1
            continue
        done.add((k, i))
        while (k, i + 1) in held or (k, i + 1) in aside:
            i += 1
            if (k, i) in held:
                out.append(held.pop((k, i)))
            aside.discard((k, i))
            done.add((k, i))
    return out, holds
