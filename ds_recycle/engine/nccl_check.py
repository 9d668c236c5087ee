"""Whether a plan, as the engine lowers it, can run over NCCL point-to-point: a static check, no process needed.

NCCL matches the messages between two ranks in the order they were posted (tags are ignored), and a send or a
receive completes only once its peer posted the matching one; operations issued together in one group
(``ncclGroupStart``/``ncclGroupEnd``, ``torch.distributed.batch_isend_irecv``) complete together, once every one of
them is matched. The engine's steps (:mod:`ds_recycle.engine.schedule`) receive before they compute and send after,
so the transfers that can travel together are the ones with no compute between them: the sends that end one step
and the receives that begin the next (a ``BackwardWeight`` that only frees the buffer of a fused backward is no
compute). The check takes each worker's instructions, one iteration of a plan, cuts them
into such *batches*, and asks two questions:

1. **Per-pair order.** For every ordered pair of ranks, is the sequence of what one sends to the other (channel and
   micro-batch) the sequence the other receives from it? If not, FIFO matching would hand a receive the wrong
   tensor.
2. **No wait cycle.** Running every worker batch by batch, where a batch completes once each of its transfers has
   its counterpart posted by the peer (the peer's current batch or an earlier one), and compute completes at once:
   does every worker reach its end? If not, the workers stuck and what each waits for are named.

Batched as lowered, many plans with failed workers do have such cycles (``benchmarks/nccl_plans.py``).
:func:`in_match_order` gives an order that has none for any plan that runs with buffered sends: every rank issues its
transfers in the order they match in such a run (:func:`match_order`), so all the ranks' streams follow one global
order. The engine issues them so (:mod:`ds_recycle.engine.issue`, whose ``check_plan`` checks what it posts).

:func:`check_order` and :func:`check_waits` raise :class:`NcclPlanError` on the first violation; :func:`p2p_program`
gives the batches as lowered, :func:`timeline` the transfers and computes they are cut from.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ds_recycle.engine.instructions import (
    BackwardInput,
    BackwardWeight,
    PipeInstruction,
    PostTransfers,
    RecvActivationFrom,
    RecvGradFrom,
    SendActivationTo,
    SendGradTo,
    SendLoggedTo,
    Transfer,
)
from ds_recycle.engine.schedule import PlanLike, PlanSchedule, Repair, Worker

__all__ = ["Compute", "Item", "Transfer", "NcclPlanError", "batches_as_lowered", "classify", "dense_ranks", "p2p_program",
           "timeline", "match_order", "in_match_order", "issue_points", "check_order", "check_waits"]

_P2P = {SendActivationTo: ("send", "activation"), SendGradTo: ("send", "grad"),
        RecvActivationFrom: ("recv", "activation"), RecvGradFrom: ("recv", "grad")}


def _p2p_kind(cmd: PipeInstruction) -> tuple[str, str] | None:
    """(send or recv, channel) of a point-to-point instruction (a repair's log send included), else None."""
    if isinstance(cmd, SendLoggedTo):
        return "send", "grad" if cmd.kwargs["grad"] else "activation"
    return _P2P.get(type(cmd))


class NcclPlanError(ValueError):
    """The plan cannot run over NCCL point-to-point as the engine lowers it (see the module docstring)."""


def dense_ranks(plan: PlanLike) -> dict[Worker, int]:
    """Live workers numbered as the engine numbers them without holes: stage-major, pipeline within."""
    live = sorted((w for w in plan.workers), key=lambda w: (w[1], w[0]))
    return {w: r for r, w in enumerate(live)}


@dataclass(frozen=True)
class Compute:
    """A compute instruction of a worker, between its transfers (``what`` names it in messages)."""

    what: str


Item = Transfer | Compute
"""One entry of a worker's :func:`timeline`."""


def classify(steps: Sequence[Sequence[PipeInstruction]], me: int) -> Iterator[tuple[int, int, Item]]:
    """``(step, index in the step, item)`` for every instruction of ``steps`` (rank ``me``'s) that is a transfer or a
    compute; a tensor a worker takes from its own log is neither, nor is a ``BackwardWeight`` that only frees the
    buffer of a fused backward."""
    fused: set[int] = set()  # buffers whose W ran inside a fused backward: their BackwardWeight only frees them
    for s, step in enumerate(steps):
        for c, cmd in enumerate(step):
            kind = _p2p_kind(cmd)
            if kind is not None and cmd.kwargs["peer"] == me:
                continue
            if kind is None:
                if isinstance(cmd, PostTransfers):
                    continue
                if isinstance(cmd, BackwardInput) and cmd.kwargs.get("weights"):
                    fused.add(cmd.kwargs["buffer_id"])
                elif isinstance(cmd, BackwardWeight) and cmd.kwargs["buffer_id"] in fused:
                    fused.discard(cmd.kwargs["buffer_id"])
                    continue  # no compute: the transfers around it can travel together
                yield s, c, Compute(type(cmd).__name__)
                continue
            mb = cmd.kwargs["micro_batch"]
            yield s, c, Transfer(kind[0], int(cmd.kwargs["peer"]), kind[1], (int(mb[0]), int(mb[1])))


def timeline(plan: PlanLike, iteration: int = 0, rank_of: Callable[[Worker], int] | None = None,
             repair: Repair | None = None, forward_only: bool = False) -> dict[int, list[Item]]:
    """Every live worker's transfers and computes of ``iteration`` in the order the engine lowers them, by rank (see
    :func:`classify`); with ``repair``, those of the repair of an interrupted ``iteration``; ``forward_only``: those
    of an evaluation pass."""
    ranks = dense_ranks(plan)
    number = rank_of if rank_of is not None else ranks.__getitem__
    out: dict[int, list[Item]] = {}
    for worker in ranks:
        steps = list(PlanSchedule(plan, worker, number, iteration, repair=repair, forward_only=forward_only).steps())
        out[number(worker)] = [item for _, _, item in classify(steps, number(worker))]
    return out


def batches_as_lowered(items: list[Item]) -> list[list[Transfer]]:
    """A worker's transfers cut into batches at its computes (what could travel together as the lowering places
    them: receives before their compute, sends after)."""
    batches: list[list[Transfer]] = []
    current: list[Transfer] = []
    for item in items:
        if isinstance(item, Compute):
            if current:
                batches.append(current)
                current = []
        else:
            current.append(item)
    if current:
        batches.append(current)
    return batches


def p2p_program(plan: PlanLike, iteration: int = 0, rank_of: Callable[[Worker], int] | None = None,
                repair: Repair | None = None) -> dict[int, list[list[Transfer]]]:
    """Every live worker's point-to-point operations of ``iteration``, by rank, in batches as the lowering places
    them (see the module docstring and :func:`timeline`)."""
    return {rank: batches_as_lowered(items) for rank, items in timeline(plan, iteration, rank_of, repair).items()}


_COST = {"ForwardMicroBatch": 1, "BackwardInput": 1, "BackwardWeight": 1}
"""Time a compute takes in :func:`match_order`'s run (the plan's unit costs; the rest takes none)."""


def match_order(lines: Mapping[int, list[Item]]) -> dict[int, list[int]]:
    """For every rank, the positions of its transfers in :func:`timeline` ordered by when they match in a run where
    sends never wait (gloo's buffered sends), F, B and W take one unit of time and the rest none: each rank runs
    until a receive finds no message posted for it, a receive matches the oldest message its sender posted to it
    (per-pair FIFO), and the rank that can go on earliest goes first (ties: the lowest rank). Any run would give an
    order every rank can issue in; this one sends as soon as the compute before it ends, as a run would.

    Raises :class:`NcclPlanError` if some rank can never go on (the plan deadlocks even with buffered sends)."""
    posted: dict[tuple[int, int], deque[tuple[int, float]]] = defaultdict(deque)  # (src, dst): (position, time)
    at = {rank: 0 for rank in lines}
    now = {rank: 0.0 for rank in lines}
    matched: dict[tuple[int, int], int] = {}
    clock = 0

    def ready(rank: int) -> float | None:
        """When ``rank`` can run its next item (None: finished, or waiting for a message not yet posted)."""
        items = lines[rank]
        if at[rank] >= len(items):
            return None
        item = items[at[rank]]
        if isinstance(item, Transfer) and item.kind == "recv":
            queue = posted[(item.peer, rank)]
            return max(now[rank], queue[0][1]) if queue else None
        return now[rank]

    while True:
        runnable = [(t, rank) for rank in lines if (t := ready(rank)) is not None]
        if not runnable:
            break
        t, rank = min(runnable)
        item = lines[rank][at[rank]]
        if isinstance(item, Compute):
            now[rank] = t + _COST.get(item.what, 0)
        elif item.kind == "send":
            posted[(rank, item.peer)].append((at[rank], t))
        else:
            sender, _ = posted[(item.peer, rank)].popleft()
            matched[(item.peer, sender)] = matched[(rank, at[rank])] = clock
            clock += 1
            now[rank] = t
        at[rank] += 1
    stuck = {rank: items[at[rank]] for rank, items in lines.items() if at[rank] < len(items)}
    if stuck:
        raise NcclPlanError("the plan deadlocks even with sends that never wait: "
                            + "; ".join(f"rank {rank} at {item}" for rank, item in sorted(stuck.items())))
    return {rank: sorted((k for k, item in enumerate(items) if isinstance(item, Transfer)),
                         key=lambda k, r=rank: matched[(r, k)])  # type: ignore[misc]
            for rank, items in lines.items()}


def in_match_order(lines: Mapping[int, list[Item]]) -> dict[int, list[list[Transfer]]]:
    """Each rank's transfers issued in :func:`match_order`, cut into batches at its computes (see
    :func:`issue_points`)."""
    return {rank: [batch for _, batch in points] for rank, points in issue_points(lines).items()}


def issue_points(lines: Mapping[int, list[Item]]) -> dict[int, list[tuple[int, list[Transfer]]]]:
    """Each rank's transfers issued in :func:`match_order`, in batches, each with the number of the rank's computes
    that run before it is posted (as many as the rank has: posted after its last compute).

    A rank issues the next transfer of that order as soon as it may: a send once the compute before it in the
    :func:`timeline` has run, a receive once the compute after it is next. It runs its next compute once every
    receive that compute needs is issued. When neither can happen (a receive for a later compute comes first in
    the order), it issues that receive early.

    Every rank's stream then holds its transfers in one global order (the order they matched), so no batch waits
    on a batch that waits on it: the program has no wait cycle under NCCL's matching whatever the plan, at the cost
    of sends that wait behind receives the match order put before them."""
    order = match_order(lines)
    return {rank: _issue_in_order(rank, items, order[rank]) for rank, items in lines.items()}


def _issue_in_order(rank: int, items: list[Item], order: list[int]) -> list[tuple[int, list[Transfer]]]:
    """:func:`issue_points` for one rank: its timeline ``items`` and the positions of its transfers in match
    order."""
    computes_before = [0] * len(items)
    seen = 0
    for k, item in enumerate(items):
        computes_before[k] = seen
        seen += isinstance(item, Compute)
    needs = [0] * (seen + 1)  # per compute, how many receives it waits for (the last entry: none follows)
    for k, item in enumerate(items):
        if isinstance(item, Transfer) and item.kind == "recv":
            needs[computes_before[k]] += 1
    batches: list[tuple[int, list[Transfer]]] = []
    current: list[Transfer] = []
    queue = deque(order)
    done = 0

    def issue(k: int) -> None:
        item = items[k]
        assert isinstance(item, Transfer)
        if item.kind == "send" and computes_before[k] > done:
            raise NcclPlanError(f"rank {rank}: {item} matched before the compute that produces it ran")
        if item.kind == "recv":
            needs[computes_before[k]] -= 1
        current.append(item)

    def may_go(k: int) -> bool:
        item = items[k]
        assert isinstance(item, Transfer)
        return computes_before[k] <= done if item.kind == "send" else computes_before[k] == done

    while queue or done < seen:
        while queue and may_go(queue[0]):
            issue(queue.popleft())
        if done < seen and needs[done] == 0:  # the next compute has its inputs: run it
            if current:
                batches.append((done, current))
                current = []
            done += 1
        elif queue:
            issue(queue.popleft())  # a receive for a later compute comes first: issue it early
        elif done < seen:
            raise NcclPlanError(f"rank {rank}: compute {done} waits for receives that never come")
    if current:
        batches.append((done, current))
    return batches


def check_order(program: Mapping[int, list[list[Transfer]]]) -> None:
    """Question 1 of the module docstring: each pair's messages sent and received in one order."""
    sent: dict[tuple[int, int], list[tuple[str, tuple[int, int]]]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[str, tuple[int, int]]]] = defaultdict(list)
    for rank, batches in program.items():
        for op in (op for batch in batches for op in batch):
            if op.kind == "send":
                sent[(rank, op.peer)].append((op.channel, op.mb))
            else:
                received[(op.peer, rank)].append((op.channel, op.mb))
    for pair in sorted(set(sent) | set(received)):
        a, b = sent.get(pair, []), received.get(pair, [])
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise NcclPlanError(
                f"rank {pair[0]} sends rank {pair[1]} {len(a)} messages and rank {pair[1]} receives {len(b)} from it; "
                f"they first differ at message {at}: sent {a[at] if at < len(a) else 'nothing'}, received "
                f"{b[at] if at < len(b) else 'nothing'} (NCCL matches them in order)")


def check_waits(program: Mapping[int, list[list[Transfer]]]) -> None:
    """Question 2 of the module docstring: no wait cycle under NCCL's matching."""
    # the n-th send from a to b meets the n-th receive of b from a
    index: dict[int, list[list[tuple[Transfer, int]]]] = {}
    for rank, batches in program.items():
        counts: dict[tuple[str, int], int] = defaultdict(int)
        numbered = []
        for batch in batches:
            row = []
            for op in batch:
                row.append((op, counts[(op.kind, op.peer)]))
                counts[(op.kind, op.peer)] += 1
            numbered.append(row)
        index[rank] = numbered
    # where[(rank, kind, peer, n)] = the batch holding it
    where: dict[tuple[int, str, int, int], int] = {}
    for rank, rows in index.items():
        for k, row in enumerate(rows):
            for op, n in row:
                where[(rank, op.kind, op.peer, n)] = k
    at = {rank: 0 for rank in index}

    def matched(rank: int, op: Transfer, n: int) -> bool:
        """The peer has posted (reached the batch of) the counterpart of ``rank``'s ``n``-th such operation."""
        other = where.get((op.peer, "recv" if op.kind == "send" else "send", rank, n))
        return other is not None and at.get(op.peer, -1) >= other

    moved = True
    while moved:
        moved = False
        for rank, rows in index.items():
            while at[rank] < len(rows) and all(matched(rank, op, n) for op, n in rows[at[rank]]):
                at[rank] += 1
                moved = True
    stuck = {rank: rows[at[rank]] for rank, rows in index.items() if at[rank] < len(rows)}
    if stuck:
        lines = [f"rank {rank} in batch {at[rank]}: " + ", ".join(str(op) for op, _ in row)
                 for rank, row in sorted(stuck.items())]
        raise NcclPlanError("the plan deadlocks under NCCL's matching (each batch completes once all its transfers "
                            "are matched): " + "; ".join(lines))

