"""Small hand-made plans in the planner's ``Plan`` shape, for engine tests that must not depend on the planner.

``one_f_one_b`` is DeepSpeed's 1F1B order per worker (W right after B); with ``defer_w`` every W moves
to the end of the iteration (memory-hungry, but a valid order that exercises deferred W). Absent workers'
micro-batches go to the live peer of the lowest pipeline, interleaved by index.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Kind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    O = "O"  # noqa: E741


@dataclass(frozen=True)
class HandOp:
    kind: Kind
    iteration: int
    mb: tuple[int, int] | None


@dataclass(frozen=True)
class HandPlan:
    stages: int
    pipelines: int
    microbatches: int
    failed: frozenset[tuple[int, int]]
    workers: dict[tuple[int, int], tuple[HandOp, ...]]
    owner: dict[tuple[int, tuple[int, int]], tuple[int, int]] = field(default_factory=dict)
    iterations: int = 1
    optimizer: str = "staggered"

    def worker_of(self, stage: int, mb: tuple[int, int]) -> tuple[int, int]:
        return self.owner[(stage, mb)]


def one_f_one_b(stages: int, pipelines: int, microbatches: int, failed: frozenset[tuple[int, int]] = frozenset(),
                defer_w: bool = False, optimizer: str = "staggered") -> HandPlan:
    owner: dict[tuple[int, tuple[int, int]], tuple[int, int]] = {}
    work: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s in range(stages):
        live = [d for d in range(pipelines) if (d, s) not in failed]
        for i in range(microbatches):
            for d in range(pipelines):
                w = (d, s) if (d, s) not in failed else (live[0], s)
                owner[(s, (d, i))] = w
                work.setdefault(w, []).append((d, i))
    workers = {}
    for (d, s), mbs in work.items():
        warm = min(stages - s, len(mbs))
        ops = [HandOp(Kind.F, 0, mb) for mb in mbs[:warm]]
        tail = []
        for n, mb in enumerate(mbs):
            ops.append(HandOp(Kind.B, 0, mb))
            (tail if defer_w else ops).append(HandOp(Kind.W, 0, mb))
            if n + warm < len(mbs):
                ops.append(HandOp(Kind.F, 0, mbs[n + warm]))
        workers[(d, s)] = tuple(ops + tail + [HandOp(Kind.O, 0, None)])
    return HandPlan(stages, pipelines, microbatches, frozenset(failed), workers, owner, optimizer=optimizer)

