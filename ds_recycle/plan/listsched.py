"""The greedy list scheduler: builds every live worker's op order and times in one event-driven pass.

Each worker, whenever it is free, picks among the ops it can run now, by a :class:`Policy`:

* B first (it is on the critical path: the previous stage waits for its gradient), then F (if the
  memory limit and the warm-up cap allow another micro-batch in flight), and W only to fill time in which
  neither is ready, or when memory is full (W frees a micro-batch's activations). With ``fused`` the W
  follows its B at once (DeepSpeed's 1F1B).
* Within a kind, the lowest micro-batch rank goes first: ``index * D + owner`` unless the caller gives ranks
  (the local search of :mod:`search` does).
* Incoming transfers are consumed in the order each sender sent them (one FIFO queue per sending
  worker), so the order of messages on every worker-to-worker channel is the same at both ends, and a
  worker's order can be run with point-to-point transfers that match by order alone.
* A worker finishing its F, B and W of an iteration waits at its O; the O of a stage (of every stage
  with a synchronous optimizer) starts when its last live worker gets there.
* A worker that runs all of its own pipeline's micro-batches at its stage adds their weight gradients to one
  sum, in micro-batch order, as the failure-free run does (:mod:`ds_recycle.engine.row_order`): its split W of
  its own micro-batch ``i`` is ready only after those of ``0 .. i-1``. The engine would hold a W run earlier
  and run it after them, later than planned: on the 4 x 4 emulated job with one worker lost and layers moved,
  an iteration planned at 3.03 s ran as 3.32 s under the plan's own costs. Only with the memory full and no
  W in order does the pass take one out of order (the engine then holds it, as before), so that no variant
  stalls for the rule. A fused W (W right after its B) runs at once: the engine sets its gradient aside and
  adds it in its turn, which costs nothing.

The pass is exact for the op order it builds: the times are those :func:`simulate` gives that order.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import DeadlockError
from ds_recycle.plan.ops import MicroBatch, Op, OpKind, Worker
from ds_recycle.plan.routing import Routing

__all__ = ["Policy", "list_schedule"]

_INF = math.inf
_F, _B, _W, _O = OpKind.F, OpKind.B, OpKind.W, OpKind.O


@dataclass(frozen=True)
class Policy:
    """The knobs of one greedy variant."""

    fused: bool = False
    """W right after its B (1F1B as DeepSpeed runs it) instead of deferred."""
    warmup: int | None = None
    """Most micro-batches with F done and B not yet done at stage s: ``S - s + warmup``; None: no cap."""
    memory_limit: int | None = None
    """Most micro-batches held (start of F to end of W) per worker; None: no limit."""
    forward_first: bool = False
    """Prefer a ready F over a ready B (feeds a loaded downstream stage sooner)."""
    fit_w: bool = False
    """Start a W only if it ends before the next F or B already on its way arrives (else wait for that)."""
    free_early: bool = False
    """With a memory limit: once the worker is one micro-batch short of it, a pending W goes before B and F
    (it frees room for the next F, so the pipeline keeps being fed)."""
    fuse_first: bool = False
    """At the first stage, W right after its B: nothing waits there for the B's output, and running W at once
    keeps the memory low and a loaded first stage (a failure there) free of W left for the end."""
    alternate: bool = False
    """Once the warm-up cap is reached, strictly alternate B and F (1F1B's order of F and B), with W
    filling the time in which the op due next is not ready: ZB-H1's construction."""


class _Worker:
    """Mutable state of one worker during the pass."""

    __slots__ = ("key", "stage", "factor", "fin", "bin", "wq", "held", "open", "free", "iteration", "left",
                 "ops", "version", "waiting", "f_cap", "f_left", "expect", "decision", "summed", "w_next",
                 "w_done")

    def __init__(self, key: Worker, f_cap: float, factor: float = 1.0, summed: bool = False) -> None:
        self.key, self.stage, self.factor = key, key[1], factor
        self.summed = summed
        """Whether this worker runs every micro-batch of its own pipeline at its stage (their W in index order)."""
        self.w_next = 0
        """The index of its own micro-batch whose W is next in order this iteration."""
        self.w_done: set[int] = set()
        """Own micro-batches at or after ``w_next`` whose W ran (fused, or taken out of order)."""
        self.fin: dict[int, deque] = {}
        self.bin: dict[int, deque] = {}
        self.wq: deque = deque()
        self.held = self.open = self.iteration = self.left = self.version = 0
        self.free = 0.0
        self.ops: list[Op] = []
        self.waiting = False
        self.f_cap = f_cap
        self.f_left = 0
        self.expect: OpKind | None = None
        self.decision: tuple[float, OpKind | None, int] = (_INF, None, 0)


def list_schedule(stages: int, pipelines: int, microbatches: int, costs: CostModel, routing: Routing,
                  failed: frozenset[Worker], iterations: int, synchronous: bool,
                  policy: Policy, rank: Mapping[MicroBatch, int] | None = None) -> dict[Worker, tuple[Op, ...]]:
    """Every live worker's ops, in order, with times; ``rank``: each micro-batch's priority (lowest first)."""
    run = _Pass(stages, pipelines, microbatches, costs, routing, failed, iterations, synchronous, policy, rank)
    run.loop()
    unfinished = [w.key for w in run.workers.values() if len(w.ops) != 3 * run.load[w.key] * iterations + iterations]
    if unfinished:
        raise DeadlockError(f"greedy variant {policy} stalled on workers {unfinished}")
    return {w.key: tuple(w.ops) for w in run.workers.values()}


class _Pass:
    def __init__(self, stages: int, pipelines: int, microbatches: int, costs: CostModel, routing: Routing,
                 failed: frozenset[Worker], iterations: int, synchronous: bool, policy: Policy,
                 rank: Mapping[MicroBatch, int] | None = None) -> None:
        self.S, self.D, self.M, self.K = stages, pipelines, microbatches, iterations
        self.rank = rank if rank is not None else {(o, i): i * pipelines + o for o in range(pipelines)
                                                   for i in range(microbatches)}
        self.costs, self.routing, self.sync, self.policy = costs, routing, synchronous, policy
        self.mem = _INF if policy.memory_limit is None else policy.memory_limit
        self.free_early, self.fit_w, self.forward_first = policy.free_early, policy.fit_w, policy.forward_first
        self.fuse_first = policy.fuse_first
        self.w_cost = costs.W
        self.cost = {_F: costs.F, _B: costs.B, _W: costs.W, _O: costs.O}
        self.workers: dict[Worker, _Worker] = {}
        for s in range(stages):
            cap = _INF if policy.warmup is None else max(1, stages - s + policy.warmup)
            for p in range(pipelines):
                if (p, s) not in failed:
                    summed = all(routing[s][(p, i)] == p for i in range(microbatches))
                    self.workers[(p, s)] = _Worker((p, s), cap, costs.factor((p, s)), summed)
        self.load = {w: 0 for w in self.workers}
        for s, table in enumerate(routing):
            for p in table.values():
                self.load[(p, s)] += 1
        self.heap: list = []
        self.arrived: dict[tuple[int, int], list[_Worker]] = {}
        self.group_size: dict[int, int] = {}
        for w in self.workers.values():
            g = -1 if synchronous else w.stage
            self.group_size[g] = self.group_size.get(g, 0) + 1
        for w in self.workers.values():
            self._start_iteration(w, 0, 0.0)

    def _start_iteration(self, w: _Worker, k: int, at: float) -> None:
        w.iteration, w.left, w.waiting = k, 3 * self.load[w.key], False
        w.f_left, w.expect = self.load[w.key], None
        w.w_next = 0
        w.w_done.clear()
        if w.stage == 0:
            rank = self.rank
            mbs = sorted((mb for mb, p in self.routing[0].items() if p == w.key[0]), key=rank.__getitem__)
            w.fin[-1] = deque((at, rank[mb], mb, k) for mb in mbs)
        self._push(w)

    def _push(self, w: _Worker) -> None:
        w.version += 1
        w.decision = self._decide(w)
        t = w.decision[0]
        if t < _INF:
            heapq.heappush(self.heap, (t, w.stage, w.key[0], w.version, w))

    def _decide(self, w: _Worker) -> tuple[float, OpKind | None, int]:
        """When w next starts an op, which kind, and from which queue (the earliest-ready head of this
        iteration's queues, lowest rank on ties)."""
        if w.waiting:
            return _INF, None, 0
        expect, k = w.expect, w.iteration
        b_ready = f_ready = _INF
        b_from = f_from = 0
        if w.bin and expect is not _F:
            b_rank = 0
            for sender, q in w.bin.items():
                if q:
                    item = q[0]
                    if item[3] == k and (item[0] < b_ready or (item[0] == b_ready and item[1] < b_rank)):
                        b_ready, b_rank, b_from = item[0], item[1], sender
        if w.fin and w.held < self.mem and w.open < w.f_cap and expect is not _B:
            f_rank = 0
            for sender, q in w.fin.items():
                if q:
                    item = q[0]
                    if item[3] == k and (item[0] < f_ready or (item[0] == f_ready and item[1] < f_rank)):
                        f_ready, f_rank, f_from = item[0], item[1], sender
        free = w.free
        if w.wq and self._next_w(w) is not None:
            if self.free_early and w.held >= self.mem - 1:
                return free, _W, 0
            w_ready = (_INF if self.fit_w and min(b_ready, f_ready) < free + self.w_cost[w.stage] * w.factor - 1e-12
                       else free)
        else:
            w_ready = _INF
        t = min(b_ready, f_ready, w_ready)
        if t == _INF:
            return _INF, None, 0
        if t < free:
            t = free
        if self.forward_first:
            if f_ready <= t:
                return t, _F, f_from
            if b_ready <= t:
                return t, _B, b_from
        elif b_ready <= t:
            return t, _B, b_from
        if f_ready <= t:
            return t, _F, f_from
        return t, _W, 0

    def loop(self) -> None:
        heap = self.heap
        while heap:
            t, _, _, version, w = heapq.heappop(heap)
            if version != w.version:
                continue
            t, kind, sender = w.decision  # unchanged since pushed: the version matches
            if kind is _F:
                self._run_f(w, t, w.fin[sender].popleft())
            elif kind is _B:
                self._run_b(w, t, w.bin[sender].popleft())
            elif kind is _W:
                self._run_w(w, t)
            self._push(w)

    def _emit(self, w: _Worker, kind: OpKind, k: int, mb: MicroBatch | None, start: float) -> float:
        end = start + self.cost[kind][w.stage] * w.factor
        w.ops.append(Op.trusted(kind, k, mb, start, end))
        w.free = end
        return end

    def _send(self, table: int, mb: MicroBatch, queue: str, item: tuple, sender: int) -> None:
        r = self.workers[(self.routing[table][mb], table)]
        qs = r.fin if queue == "f" else r.bin
        qs.setdefault(sender, deque()).append(item)
        at, kind, _ = r.decision
        # the receiver's decision only looks at inputs ready by its start (by the end of a W it would fit in)
        if at == _INF or item[0] <= at + (self.w_cost[r.stage] * r.factor if kind is _W else 0.0) + 1e-12:
            self._push(r)

    def _run_f(self, w: _Worker, t: float, item: tuple) -> None:
        _, rank, mb, k = item
        end = self._emit(w, _F, k, mb, t)
        w.held += 1
        w.open += 1
        w.left -= 1
        w.f_left -= 1
        if self.policy.alternate and w.open >= w.f_cap:
            w.expect = _B
        if w.stage < self.S - 1:
            self._send(w.stage + 1, mb, "f", (end + self.costs.comm, rank, mb, k), w.key[0])
        else:
            w.bin.setdefault(-1, deque()).append((end, rank, mb, k))

    def _run_b(self, w: _Worker, t: float, item: tuple) -> None:
        _, rank, mb, k = item
        end = self._emit(w, _B, k, mb, t)
        w.open -= 1
        w.left -= 1
        w.wq.append((mb, k))
        if self.policy.alternate:
            w.expect = _F if w.f_left > 0 else None
        if self.policy.fused or (self.fuse_first and w.stage == 0):
            end = self._run_w(w, end, fused=True)
        if w.stage > 0:
            self._send(w.stage - 1, mb, "b", (end + self.costs.comm, rank, mb, k), w.key[0])

    def _next_w(self, w: _Worker) -> int | None:
        """The position in ``w.wq`` of the W to run next: the first in order (see the module docstring), or
        with the memory full and none in order the first queued; None: none may run now."""
        if not w.summed:
            return 0
        own, nxt = w.key[0], w.w_next
        for n, (mb, _) in enumerate(w.wq):
            if mb[0] != own or mb[1] == nxt:
                return n
        return 0 if w.held >= self.mem else None

    def _run_w(self, w: _Worker, t: float, fused: bool = False) -> float:
        wq = w.wq
        if fused:
            mb, k = wq.pop()
        else:
            n = self._next_w(w)
            assert n is not None
            mb, k = wq[n]
            del wq[n]
        if w.summed and mb[0] == w.key[0]:
            w.w_done.add(mb[1])
            while w.w_next in w.w_done:
                w.w_done.discard(w.w_next)
                w.w_next += 1
        end = self._emit(w, _W, k, mb, t)
        w.held -= 1
        w.left -= 1
        if w.left == 0:
            self._arrive(w)
        return end

    def _arrive(self, w: _Worker) -> None:
        w.waiting = True
        group = (-1 if self.sync else w.stage, w.iteration)
        members = self.arrived.setdefault(group, [])
        members.append(w)
        if len(members) < self.group_size[group[0]]:
            return
        start = max(m.free for m in members)
        for m in members:
            self._emit(m, _O, group[1], None, start)
            if group[1] + 1 < self.K:
                self._start_iteration(m, group[1] + 1, m.free)
        del self.arrived[group]
