"""A fake NCCL for tests: one membership epoch's communicators among threads of one process, with NCCL's semantics
where they differ from gloo's, and a deadlock detector.

- **Matching.** Point-to-point messages between two ranks match in the order they were posted (no tags), and a
  send completes only once its peer posted the matching receive (no buffering: NCCL's rendezvous). A collective
  on a communicator matches the members' ``n``-th collective on it and completes once every member posted it.
- **Groups.** What a rank posts in one :meth:`FakeNccl.group` (``ncclGroupStart``/``ncclGroupEnd``,
  ``torch.distributed.batch_isend_irecv``) completes together: its wait returns once every operation is matched.
- **A dead peer hangs.** :meth:`FakeNccl.kill` ends a rank: what it posted and was not matched never will be, and
  its survivors' waits on it do not fail; they spin, as NCCL's do inside a node.
- **Abort.** :meth:`FakeNccl.abort` aborts every communicator of the epoch at once: every wait, current or later,
  raises :class:`CommAborted` (``ncclCommAbort`` on each of them).
- **Deadlock detector.** When every rank still running waits on operations that nothing can match any more, the
  fabric is *stalled*: :meth:`FakeNccl.stall` says so, with what each rank waits for, and whether a dead rank is
  involved (a failure the handler must abort) or not (a deadlock: a bug of the program).

:func:`run_program` runs each rank's steps (batches of :class:`~ds_recycle.engine.nccl_check.Transfer` and
:class:`Collective`), as the engine runs a plan (:func:`engine_program`), in one thread per rank; each received
payload is checked against what the receive expects, so a per-pair order that FIFO matching would get wrong fails.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ds_recycle.engine.instructions import PostTransfers, StaggeredOptimizerStep
from ds_recycle.engine.issue import issued_schedule
from ds_recycle.engine.nccl_check import (
    Compute,
    Item,
    Transfer,
    batches_as_lowered,
    dense_ranks,
    timeline,
)
from ds_recycle.engine.schedule import PlanLike, Repair

__all__ = ["CommAborted", "Collective", "FakeNccl", "Outcome", "Stall", "engine_program", "run_program"]


class CommAborted(RuntimeError):
    """A wait on a communicator that was aborted."""


@dataclass(frozen=True)
class Collective:
    """A blocking collective (the stage's gradient all-reduce) over ``members``, named ``what``."""

    what: str
    members: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.what} over ranks {list(self.members)}"


Step = list[Transfer] | Collective
"""What a rank posts together and then waits for."""


@dataclass
class _Op:
    rank: int
    op: Transfer | Collective
    done: bool = False
    got: object = None


@dataclass(frozen=True)
class Stall:
    """Every running rank waits on what nothing can match: ``waits`` names each rank's unmatched operations."""

    waits: Mapping[int, tuple[str, ...]]
    dead: frozenset[int]

    @property
    def deadlock(self) -> bool:
        """No dead rank involved: the program itself waits in a cycle."""
        return not self.dead

    def __str__(self) -> str:
        what = "hung on dead ranks " + str(sorted(self.dead)) if self.dead else "deadlock"
        return f"{what}: " + "; ".join(f"rank {r} waits for {', '.join(ops)}" for r, ops in sorted(self.waits.items()))


class FakeNccl:
    """One epoch's communicators among ``ranks`` (see the module docstring). Thread-safe."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        self._cv = threading.Condition()
        self._sends: dict[tuple[int, int], deque[_Op]] = defaultdict(deque)  # (src, dst): posted, unmatched
        self._recvs: dict[tuple[int, int], deque[_Op]] = defaultdict(deque)
        self._collectives: dict[tuple[tuple[int, ...], int], list[_Op]] = defaultdict(list)  # (members, n)
        self._posted_collectives: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._waiting: dict[int, list[_Op]] = {}
        self._finished: set[int] = set()
        self.dead: set[int] = set()
        self.aborted = False

    def group(self, rank: int, step: Step, payloads: Sequence[object] = ()) -> list[_Op]:
        """Post ``step``'s operations together (sends carry ``payloads`` in order); :meth:`wait` for them."""
        with self._cv:
            if self.aborted:
                raise CommAborted(f"rank {rank}: posting on an aborted epoch")
            if isinstance(step, Collective):
                ops = [_Op(rank, step)]
                n = self._posted_collectives[(rank, step.members)]
                self._posted_collectives[(rank, step.members)] = n + 1
                posted = self._collectives[(step.members, n)]
                posted.append(ops[0])
                if {o.rank for o in posted} == set(step.members):
                    for o in posted:
                        o.done = True
            else:
                ops = [_Op(rank, t) for t in step]
                sent = iter(payloads)
                for op in ops:
                    t = op.op
                    assert isinstance(t, Transfer)
                    if t.kind == "send":
                        op.got = next(sent, (rank, t.channel, t.mb))
                        self._match(op, self._recvs[(rank, t.peer)], self._sends[(rank, t.peer)], t.peer)
                    else:
                        self._match(op, self._sends[(t.peer, rank)], self._recvs[(t.peer, rank)], t.peer)
            self._cv.notify_all()
            return ops

    def _match(self, op: _Op, counterparts: deque[_Op], mine: deque[_Op], peer: int) -> None:
        if peer in self.dead:
            return  # never matched: the peer is gone
        if counterparts:
            other = counterparts.popleft()
            send, recv = (op, other) if other.op.kind == "recv" else (other, op)  # type: ignore[union-attr]
            recv.got = send.got
            op.done = other.done = True
        else:
            mine.append(op)

    def wait(self, rank: int, ops: list[_Op], timeout_s: float) -> list[object]:
        """Wait until all of ``ops`` are matched (the received payloads, in order); :class:`CommAborted` once the
        epoch is aborted; :class:`TimeoutError` after ``timeout_s`` (a test's bound, not NCCL's)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._waiting[rank] = ops
            try:
                while not all(o.done for o in ops):
                    if self.aborted:
                        raise CommAborted(f"rank {rank}: the epoch was aborted while it waited")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"rank {rank}: waited {timeout_s} s")
                    self._cv.wait(min(left, 0.5))
            finally:
                del self._waiting[rank]
                self._cv.notify_all()
            return [o.got for o in ops if isinstance(o.op, Transfer) and o.op.kind == "recv"]

    def finish(self, rank: int) -> None:
        """``rank`` ran its whole program (it waits on nothing any more)."""
        with self._cv:
            self._finished.add(rank)
            self._cv.notify_all()

    def kill(self, rank: int) -> None:
        """``rank`` dies: what it posted unmatched never matches, nor does what its survivors post to it."""
        with self._cv:
            self.dead.add(rank)
            for queues in (self._sends, self._recvs):
                for key in [k for k in queues if rank in k]:
                    del queues[key]  # the survivors' operations there stay unmatched
            for posted in self._collectives.values():
                if not any(o.done for o in posted):
                    posted[:] = [o for o in posted if o.rank != rank]
            self._cv.notify_all()

    def abort(self) -> None:
        """Abort every communicator of the epoch: every wait raises :class:`CommAborted`."""
        with self._cv:
            self.aborted = True
            self._cv.notify_all()

    def stall(self) -> Stall | None:
        """A :class:`Stall` if every rank still running waits on what cannot be matched any more, else None.

        Matching happens when an operation is posted, so a rank blocked in :meth:`wait` makes progress only if
        another rank posts: once all running ranks wait with unmatched operations, none ever will."""
        with self._cv:
            running = set(self.ranks) - self.dead - self._finished
            if not running or any(r not in self._waiting for r in running):
                return None
            waits = {r: tuple(str(o.op) for o in self._waiting[r] if not o.done) for r in running}
            if not all(waits.values()):
                return None  # some rank's wait is complete: it is about to return
            involved = {o.op.peer for r in running for o in self._waiting[r]  # type: ignore[union-attr]
                        if not o.done and isinstance(o.op, Transfer)}
            involved |= {m for r in running for o in self._waiting[r] if not o.done and isinstance(o.op, Collective)
                         for m in o.op.members}
            return Stall(waits, frozenset(involved & self.dead))


@dataclass
class Outcome:
    """How a :func:`run_program` ended: each rank's end (done, killed, aborted, or an error), the stall the
    detector saw, if any, and the seconds from the abort to the last rank's return."""

    ends: dict[int, str] = field(default_factory=dict)
    stall: Stall | None = None
    abort_s: float | None = None
    errors: list[str] = field(default_factory=list)


def engine_program(plan: PlanLike, iteration: int = 0, repair: Repair | None = None, match_order: bool = True,
                   reductions: bool = True) -> dict[int, list[Step]]:
    """Each live rank's steps for one iteration of ``plan`` as the engine runs them: the batches its
    ``PostTransfers`` post (:func:`~ds_recycle.engine.issue.issued_schedule`), or, without ``match_order``, its
    transfers in batches as the lowering places them (:func:`~ds_recycle.engine.nccl_check.timeline`); with
    ``reductions``, the stage's gradient all-reduce at its ``StaggeredOptimizerStep`` (a blocking collective over the
    stage's live replicas)."""
    ranks = dense_ranks(plan)
    stage_of = {rank: w[1] for w, rank in ranks.items()}
    replicas = {rank: tuple(sorted(r for r, s in stage_of.items() if s == stage_of[rank])) for rank in stage_of}
    if match_order:
        out: dict[int, list[Step]] = {}
        for worker, rank in ranks.items():
            steps: list[Step] = []
            for step in issued_schedule(plan, worker, ranks.__getitem__, iteration, repair=repair).steps():
                for cmd in step:
                    if isinstance(cmd, PostTransfers):
                        steps.append(list(cmd.kwargs["transfers"]))
                    elif isinstance(cmd, StaggeredOptimizerStep) and reductions:
                        steps.append(Collective(f"stage {stage_of[rank]} all-reduce", replicas[rank]))
            out[rank] = steps
        return out
    lines = timeline(plan, iteration, repair=repair)
    batches = {rank: batches_as_lowered(items) for rank, items in lines.items()}
    if not reductions:
        return {rank: list(b) for rank, b in batches.items()}
    return {rank: _with_reductions(lines[rank], batches[rank], Collective(f"stage {stage_of[rank]} all-reduce",
                                                                           replicas[rank]))
            for rank in lines}


def _with_reductions(items: list[Item], batches: list[list[Transfer]], reduce: Collective) -> list[Step]:
    """``batches`` with ``reduce`` placed at each ``StaggeredOptimizerStep`` of ``items``: after the batches that
    hold every transfer before it in ``items`` (in match order a transfer may be issued early, never late)."""
    out: list[Step] = []
    taken = 0  # transfers in the batches placed so far
    before = 0  # transfers before the next reduction in items
    pending = deque(batches)
    for item in items:
        if isinstance(item, Transfer):
            before += 1
        elif isinstance(item, Compute) and item.what == "StaggeredOptimizerStep":
            while taken < before and pending:
                batch = pending.popleft()
                out.append(batch)
                taken += len(batch)
            out.append(reduce)
    out.extend(pending)
    return out


def run_program(program: Mapping[int, list[Step]], kill: tuple[int, int] | None = None, timeout_s: float = 20.0,
                abort_on_stall: bool = True) -> Outcome:
    """Run ``program`` (rank -> steps) on a :class:`FakeNccl`, one thread per rank; ``kill`` = (rank, step): that
    rank dies before posting that step. When the detector sees a stall it aborts the epoch (the failure handler's
    part) if ``abort_on_stall``; every rank must then return. Never hangs: each wait and join is bounded."""
    fabric = FakeNccl(sorted(program))
    out = Outcome()
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        end = "done"
        try:
            for k, step in enumerate(program[rank]):
                if kill == (rank, k):
                    fabric.kill(rank)
                    end = "killed"
                    return
                payloads = [(rank, t.channel, t.mb) for t in step if t.kind == "send"] \
                    if isinstance(step, list) else []
                got = fabric.wait(rank, fabric.group(rank, step, payloads), timeout_s)
                if isinstance(step, list):
                    want = [(t.peer, t.channel, t.mb) for t in step if t.kind == "recv"]
                    if got != want:
                        with lock:
                            out.errors.append(f"rank {rank} step {k}: received {got}, expected {want}")
        except CommAborted:
            end = "aborted"
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            end = f"error: {e}"
        finally:
            with lock:
                out.ends[rank] = end
            fabric.finish(rank)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True, name=f"fake-nccl-{r}") for r in program]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    aborted_at: float | None = None
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        stall = fabric.stall()
        if stall is not None and out.stall is None:
            out.stall = stall
            if abort_on_stall:
                aborted_at = time.monotonic()
                fabric.abort()
        time.sleep(0.002)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    if aborted_at is not None:
        out.abort_s = time.monotonic() - aborted_at
    for t, r in zip(threads, program):
        if t.is_alive():
            fabric.abort()
            out.errors.append(f"rank {r} still running after {timeout_s} s")
    return out
