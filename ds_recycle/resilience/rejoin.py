"""Rejoin: a restarted worker takes its stage's state from a live replica and joins at an iteration boundary.

The protocol, over the launcher's store (keys under the generation's root, see
:class:`~ds_recycle.resilience.store.StoreKeys`):

1. The restarted process (a *joiner*) builds its engine on a detached WORLD
   (:mod:`ds_recycle.resilience.detached`), then files a request: ``n = add(join/requests, 1)``,
   ``join/request/<n> = "<rank> <restart count>"`` (the members watch that very process while they admit it:
   if it dies at any step of its admission, or was restarted again meanwhile, the admission is an ordinary
   failure, the members go on without it and its next process may file again).
2. The reporting rank reads the request counter as it broadcasts each iteration's loss, and the count rides
   on that broadcast (:class:`~ds_recycle.resilience.transport.LossRider`), so every member
   sees the same count at the next boundary. When it grew, requests up to that count are admitted:
   the lowest member writes a :class:`JoinTicket` under ``join/ticket/<n>`` for each (the new epoch, its
   members, the boundary iteration), and everyone, joiners included, builds the new epoch's groups.
3. In each stage that gains a worker, the lowest surviving replica broadcasts its state (parameters,
   optimizer state, learning-rate schedule, step counters: a
   :class:`~ds_recycle.engine.stage_state.StageState`) over the new stage group; the joiner loads it and
   the planner's plan for the new (smaller) failure set runs from that iteration on.

When training is over, the members set ``join/closed``: a joiner still waiting leaves without joining.
"""
from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_recycle.engine.devices import HOST
from ds_recycle.engine.stage_state import StageState
from ds_recycle.resilience.errors import JobClosed, PeerFailure
from ds_recycle.resilience.store import StoreKeys
from ds_recycle.resilience.transport import EpochComm

__all__ = ["JobClosed", "JoinTicket", "decide_requests", "file_request", "read_request", "stage_sources", "transfer_stage_state",
           "wait_for_ticket", "write_tickets"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinTicket:
    """The members' answer to join request ``request``."""

    request: int
    epoch: int
    """Membership epoch the joiner enters (its groups are built under that number)."""
    members: tuple[int, ...]
    """Every rank of that epoch, joiners included."""
    iteration: int
    """The first iteration the joiner trains (the boundary at which it was admitted)."""
    admitted_upto: int
    """Requests up to this number are decided."""
    joining: tuple[int, ...] = ()
    """The ranks admitted at this boundary (their stages receive a state transfer)."""
    reporter: int = -1
    """The rank that writes the metrics (it does not move when a worker joins)."""
    accepted: bool = True
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> JoinTicket:
        raw = json.loads(text)
        return cls(**{**raw, "members": tuple(raw["members"]), "joining": tuple(raw["joining"])})


def file_request(store: dist.Store, keys: StoreKeys, rank: int, restart_count: int = 0) -> int:
    """File this rank's join request (``"<rank> <restart count>"``: which process asks); its number."""
    number = int(store.add(keys.join_requests, 1))
    store.set(keys.join_request(number), f"{rank} {restart_count}")
    logger.info("join request %d filed for rank %d (restart %d)", number, rank, restart_count)
    return number


def read_request(store: dist.Store, keys: StoreKeys, number: int) -> tuple[int, int]:
    """``(rank, restart count)`` of join request ``number``: the process that filed it."""
    rank, _, count = store.get(keys.join_request(number)).decode().partition(" ")
    return int(rank), int(count or 0)


def wait_for_ticket(store: dist.Store, keys: StoreKeys, number: int, timeout_s: float,
                    gone: Callable[[], str | None], poll_s: float = 0.01) -> JoinTicket:
    """Wait for the ticket of request ``number``; :class:`JobClosed` if the job ends first or ``gone()`` says so."""
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([keys.join_ticket(number)]):
            return JoinTicket.from_json(store.get(keys.join_ticket(number)))
        if store.check([keys.join_closed]):
            raise JobClosed("training ended before the next iteration boundary")
        why = gone()
        if why:
            raise JobClosed(why)
        if time.monotonic() > deadline:
            raise JobClosed(f"no member answered join request {number} within {timeout_s} s "
                            "(raise recycle.failure_timeout_s if iterations are that long)")
        time.sleep(poll_s)


def decide_requests(store: dist.Store, keys: StoreKeys, upto: int, after: int, members: Sequence[int],
                    job_ranks: Sequence[int]) -> dict[int, int]:
    """Accepted requests among ``after + 1 .. upto``: request number -> rank (store reads only, so every
    member decides the same).

    Refused: a rank that is a member already or runs no worker of this job; of several requests of one
    rank (it died again and was restarted again), only the latest, which its live process holds.
    """
    latest: dict[int, int] = {}
    for number in range(after + 1, upto + 1):
        rank, _ = read_request(store, keys, number)
        if rank in members or rank not in job_ranks:
            logger.warning("join request %d of rank %d refused: %s", number, rank,
                           "a member already" if rank in members else "no worker of this job has that rank")
            continue
        latest[rank] = number
    return {number: rank for rank, number in sorted(latest.items(), key=lambda item: item[1])}


def write_tickets(store: dist.Store, keys: StoreKeys, upto: int, after: int, accepted: dict[int, int],
                  epoch: int, members: Sequence[int], iteration: int, reporter: int) -> None:
    """Answer requests ``after + 1 .. upto`` (called by one member)."""
    joining = tuple(sorted(accepted.values()))
    for number in range(after + 1, upto + 1):
        ok = number in accepted
        ticket = JoinTicket(number, epoch, tuple(members), iteration, upto, joining, reporter, ok,
                            "" if ok else "refused: a member already, superseded by a later request, or no worker")
        store.set(keys.join_ticket(number), ticket.to_json())


def _broadcast_bytes(comm: EpochComm, payload: bytes | None, src: int, what: str) -> torch.Tensor:
    """``src``'s ``payload`` on every member of the stage group, as a uint8 host tensor (on gloo, no copy on ``src``;
    NCCL's travels through the GPU)."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=comm.device)
    comm.wait(comm.stage.broadcast(size, src), f"{what}: size")
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(comm.device) if payload is not None
            else torch.empty(int(size.item()), dtype=torch.uint8, device=comm.device))
    comm.wait(comm.stage.broadcast(data, src), f"{what}: {data.numel()} bytes")
    return data.to(HOST)


def transfer_stage_state(comm: EpochComm, src: int, rank: int, engine: Any, load: bool,
                         carry_progress: bool = False) -> int:
    r"""Broadcast ``src``'s stage state over the epoch's stage group; every replica of the stage calls it.

    ``src`` sends its engine's :meth:`~ds_recycle.engine.engine.RecyclePipelineEngine.stage_state`
    (``carry_progress``: with the kept norm contributions and losses); a replica that ``load``\ s it takes it into
    its engine; other replicas, which hold the same state already, only take part. Returns the bytes moved.
    """
    payload = None
    if rank == src:
        buf = io.BytesIO()
        torch.save(engine.stage_state(carry_progress), buf)
        payload = buf.getvalue()
    data = _broadcast_bytes(comm, payload, src, f"state transfer from rank {src}")
    if load:
        state: StageState = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
        engine.load_stage_state(state)
    return data.numel()


def stage_sources(previous: Sequence[int], joining: Sequence[int], stage_of: Callable[[int], int]) -> dict[int, int]:
    """For each stage that gains a worker, the replica that sends it the state: its lowest surviving rank."""
    sources: dict[int, int] = {}
    for rank in joining:
        stage = stage_of(rank)
        replicas = [q for q in previous if stage_of(q) == stage]
        if not replicas:
            raise PeerFailure(f"rank {rank} joins stage {stage}, which has no live replica to copy from")
        sources[stage] = min(replicas)
    return sources
