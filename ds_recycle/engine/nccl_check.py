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

:func:`check_plan` raises :class:`NcclPlanError` on the first violation; :func:`p2p_program` gives the batches.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ds_recycle.engine.instructions import (
    BackwardInput,
    BackwardWeight,
    PipeInstruction,
    RecvActivationFrom,
    RecvGradFrom,
    SendActivationTo,
    SendGradTo,
    SendLoggedTo,
)
from ds_recycle.engine.schedule import PlanLike, PlanSchedule, Repair, Worker

__all__ = ["Transfer", "NcclPlanError", "dense_ranks", "p2p_program", "check_order", "check_waits", "check_plan"]

_P2P = {SendActivationTo: ("send", "activation"), SendGradTo: ("send", "grad"),
        RecvActivationFrom: ("recv", "activation"), RecvGradFrom: ("recv", "grad")}


def _p2p_kind(cmd: PipeInstruction) -> tuple[str, str] | None:
    """(send or recv, channel) of a point-to-point instruction (a repair's log send included), else None."""
    if isinstance(cmd, SendLoggedTo):
        return "send", "grad" if cmd.kwargs["grad"] else "activation"
    return _P2P.get(type(cmd))


@dataclass(frozen=True)
class Transfer:
    """One point-to-point operation of a worker: ``kind`` (send or recv) of ``channel`` for ``mb`` with ``peer``."""

    kind: str
    peer: int
    channel: str
    mb: tuple[int, int]

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind} {self.channel} {self.mb[0]}.{self.mb[1]} {arrow} rank {self.peer}"


class NcclPlanError(ValueError):
    """The plan cannot run over NCCL point-to-point as the engine lowers it (see the module docstring)."""


def dense_ranks(plan: PlanLike) -> dict[Worker, int]:
    """Live workers numbered as the engine numbers them without holes: stage-major, pipeline within."""
    live = sorted((w for w in plan.workers), key=lambda w: (w[1], w[0]))
    return {w: r for r, w in enumerate(live)}


def p2p_program(plan: PlanLike, iteration: int = 0, rank_of: Callable[[Worker], int] | None = None,
                repair: Repair | None = None) -> dict[int, list[list[Transfer]]]:
    """Every live worker's point-to-point operations of ``iteration``, by rank, in batches (see the module
    docstring); with ``repair``, those of the repair of an interrupted ``iteration`` (a tensor a worker takes from
    its own log is no transfer)."""
    ranks = dense_ranks(plan)
    number = rank_of if rank_of is not None else ranks.__getitem__
    program: dict[int, list[list[Transfer]]] = {}
    for worker in ranks:
        batches: list[list[Transfer]] = []
        current: list[Transfer] = []
        fused: set[int] = set()  # buffers whose W ran inside a fused backward: their BackwardWeight only frees them
        for step in PlanSchedule(plan, worker, number, iteration, repair=repair).steps():
            for cmd in step:
                kind = _p2p_kind(cmd)
                if kind is not None and cmd.kwargs["peer"] == number(worker):
                    continue
                if kind is None:
                    if isinstance(cmd, BackwardInput) and cmd.kwargs.get("weights"):
                        fused.add(cmd.kwargs["buffer_id"])
                    elif isinstance(cmd, BackwardWeight) and cmd.kwargs["buffer_id"] in fused:
                        fused.discard(cmd.kwargs["buffer_id"])
                        continue  # no compute: the transfers around it can travel together
                    if current:
                        batches.append(current)
                        current = []
                    continue
                mb = cmd.kwargs["micro_batch"]
                current.append(Transfer(kind[0], int(cmd.kwargs["peer"]), kind[1], (int(mb[0]), int(mb[1]))))
        if current:
            batches.append(current)
        program[number(worker)] = batches
    return program


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


def check_plan(plan: PlanLike, rank_of: Callable[[Worker], int] | None = None) -> int:
    """Check every iteration of ``plan`` (see the module docstring); returns the number of transfers checked."""
    total = 0
    for iteration in range(plan.iterations):
        program = p2p_program(plan, iteration, rank_of)
        check_order(program)
        check_waits(program)
        total += sum(len(batch) for batches in program.values() for batch in batches)
    return total
