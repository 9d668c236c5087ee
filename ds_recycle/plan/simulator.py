"""Discrete-event simulation: per-worker op orders plus a cost model give start and end times.

Each worker runs its ops strictly in the given order; an op starts as soon as the worker is free and its
inputs are there (the plan format's rules 4 and 5): F at stage s > 0 waits ``comm`` after F of the same
micro-batch at s-1; B waits ``comm`` after B at s+1 (at the last stage, for its own F); W for its B. All O
ops of one stage and iteration (of one iteration, with a synchronous optimizer) start together, once every
live worker of the group has reached its O and every F, B and W of the group has ended.

If some worker can never reach the end of its order, the simulation stops and raises
:class:`DeadlockError` with the stuck workers, their next op and what each waits for.

Fidelity limits: transfers take exactly ``comm`` and never contend for links; a send never blocks its
sender (the engine posts sends without waiting for the receiver, or pairs them in this order); O is one
fixed duration per stage regardless of how many workers take part; compute times do not vary.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import DeadlockError, PlanError
from ds_recycle.plan.ops import MicroBatch, Op, OpKey, OpKind, Worker
from ds_recycle.plan.plan import format_grid

__all__ = ["SimResult", "simulate", "busy_time", "peak_memory"]

_F, _B, _W, _O = OpKind.F, OpKind.B, OpKind.W, OpKind.O

_Done = tuple[OpKind, int, int, MicroBatch]
"""An F, B or W of one stage: ``(kind, stage, iteration, micro-batch)``."""


@dataclass(frozen=True)
class SimResult:
    """Times of every op and the figures derived from them."""

    workers: dict[Worker, tuple[Op, ...]]
    makespan: float
    bubble_fraction: float
    """Idle share of the live workers' time until the makespan: 1 - busy / (workers x makespan)."""
    peak_memory: dict[Worker, int]
    """Most micro-batches each worker holds at once (start of F to end of W)."""


def simulate(orders: Mapping[Worker, Sequence[OpKey | Op]], costs: CostModel, *,
             optimizer: str = "staggered", fused_backward: bool = False) -> SimResult:
    """Run the orders under ``costs``; raise :class:`DeadlockError` if they cannot all finish.

    ``fused_backward``: the gradient leaves a stage only when its W has ended too (DeepSpeed's 1F1B
    computes both in one backward call); the plan format's rule 4 only requires B to have ended.
    """
    keys = {w: [op.key if isinstance(op, Op) else op for op in ops] for w, ops in orders.items()}
    sim = _Sim(keys, costs, optimizer == "synchronous", fused_backward)
    sim.run()
    workers = {w: tuple(ops) for w, ops in sorted(sim.out.items())}
    makespan = max((ops[-1].end for ops in workers.values() if ops), default=0.0)
    busy = busy_time(workers)
    bubble = 1.0 - busy / (len(workers) * makespan) if makespan > 0 else 0.0
    return SimResult(workers, makespan, bubble, {w: peak_memory(ops) for w, ops in workers.items()})


def busy_time(workers: Mapping[Worker, Sequence[Op]]) -> float:
    """Sum of every op's duration."""
    return sum(op.end - op.start for ops in workers.values() for op in ops)


def peak_memory(ops: Sequence[Op]) -> int:
    """Most micro-batches held at once by one worker whose ops are ``ops`` (in order)."""
    held = peak = 0
    for op in ops:
        if op.kind is _F:
            held += 1
            peak = max(peak, held)
        elif op.kind is _W:
            held -= 1
    return peak


class _Sim:
    """The event loop; ``done`` maps (kind, stage, iteration, mb) to end time."""

    def __init__(self, orders: dict[Worker, list[OpKey]], costs: CostModel, synchronous: bool,
                 fused: bool = False) -> None:
        self.orders, self.costs, self.sync, self.fused = orders, costs, synchronous, fused
        self.ptr = {w: 0 for w in orders}
        self.free = {w: 0.0 for w in orders}
        self.out: dict[Worker, list[Op]] = {w: [] for w in orders}
        self.done: dict[_Done, float] = {}
        self.waiters: dict[_Done, list[Worker]] = defaultdict(list)
        self.group_left: dict[tuple[int, int], int] = defaultdict(int)   # FBW ops still to end
        self.group_end: dict[tuple[int, int], float] = defaultdict(float)
        self.members: dict[tuple[int, int], set[Worker]] = defaultdict(set)
        self.arrived: dict[tuple[int, int], list[Worker]] = defaultdict(list)
        self._index()

    def _group(self, stage: int, iteration: int) -> tuple[int, int]:
        return (-1 if self.sync else stage, iteration)

    def _index(self) -> None:
        present: set[_Done] = set()
        for (p, s), ops in self.orders.items():
            for kind, it, mb in ops:
                if kind is _O:
                    self.members[self._group(s, it)].add((p, s))
                else:
                    assert mb is not None, f"{kind.value}@{it} at worker {(p, s)} has no micro-batch"
                    self.group_left[self._group(s, it)] += 1
                    present.add((kind, s, it, mb))
        last = self.costs.stages - 1
        for kind, s, it, mb in present:
            dep = self._dep(kind, s, it, mb, last)
            if dep is not None and dep not in present:
                raise PlanError(f"{kind.value}{mb[0]}.{mb[1]}@{it} at stage {s} needs "
                                f"{dep[0].value} at stage {dep[1]}, which no worker runs")

    def _dep(self, kind: OpKind, s: int, it: int, mb: MicroBatch, last: int) -> _Done | None:
        if kind is _F:
            return (_F, s - 1, it, mb) if s > 0 else None
        if kind is _B:
            return ((_W if self.fused else _B), s + 1, it, mb) if s < last else (_F, s, it, mb)
        return (_B, s, it, mb)

    def run(self) -> None:
        queue = deque(self.orders)
        last = self.costs.stages - 1
        while queue:
            self._advance(queue.popleft(), queue, last)
        stuck = [w for w, i in self.ptr.items() if i < len(self.orders[w])]
        if stuck:
            raise DeadlockError(self._deadlock_message(stuck))

    def _advance(self, w: Worker, queue: deque, last: int) -> None:
        ops, s = self.orders[w], w[1]
        while self.ptr[w] < len(ops):
            kind, it, mb = ops[self.ptr[w]]
            if kind is _O:
                self._arrive_o(w, it, queue)
                return
            assert mb is not None  # only O has none, and _index checked every other op
            dep = self._dep(kind, s, it, mb, last)
            ready = 0.0
            if dep is not None:
                if dep not in self.done:
                    self.waiters[dep].append(w)
                    return
                ready = self.done[dep] + (self.costs.comm if dep[1] != s else 0.0)
            start = max(self.free[w], ready)
            end = start + self.costs.duration(kind.value, w)
            self._record(w, Op(kind, it, mb, start, end))
            key = (kind, s, it, mb)
            self.done[key] = end
            group = self._group(s, it)
            self.group_left[group] -= 1
            self.group_end[group] = max(self.group_end[group], end)
            queue.extend(self.waiters.pop(key, ()))
            if self.group_left[group] == 0:
                self._try_release(group, queue)

    def _record(self, w: Worker, op: Op) -> None:
        self.out[w].append(op)
        self.free[w] = op.end
        self.ptr[w] += 1

    def _arrive_o(self, w: Worker, it: int, queue: deque) -> None:
        group = self._group(w[1], it)
        if w not in self.arrived[group]:
            self.arrived[group].append(w)
        self._try_release(group, queue)

    def _try_release(self, group: tuple[int, int], queue: deque) -> None:
        members = self.members[group]
        if self.group_left[group] or len(self.arrived[group]) < len(members):
            return
        start = max([self.group_end[group]] + [self.free[w] for w in members])
        for w in sorted(members):
            self._record(w, Op(_O, group[1], None, start, start + self.costs.duration("O", w)))
            queue.append(w)
        self.arrived[group] = []
        self.group_left[group] = -1  # released

    def _deadlock_message(self, stuck: list[Worker]) -> str:
        lines = ["the op orders deadlock: these workers cannot run their next op"]
        marks = {}
        for w in sorted(stuck, key=lambda x: (x[1], x[0])):
            kind, it, mb = self.orders[w][self.ptr[w]]
            head = Op(kind, it, mb)
            if kind is _O:
                why = "waits for the rest of its O group (another worker of the group is stuck)"
            else:
                assert mb is not None  # checked by _index
                dep = self._dep(kind, w[1], it, mb, self.costs.stages - 1)
                assert dep is not None  # an F at stage 0, the only op without one, never waits
                why = f"waits for {dep[0].value} of {mb} at stage {dep[1]}, which has not run"
            lines.append(f"  worker {w}: next op {head} {why}")
            marks[w] = self.ptr[w]
        full = {w: tuple(Op(k, i, m) for k, i, m in ops) for w, ops in self.orders.items()}
        first = min(marks, key=lambda x: (x[1], x[0]))
        lines.append(format_grid(full, (first, marks[first])))
        return "\n".join(lines)
