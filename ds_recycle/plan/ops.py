"""Operations of a plan: what one worker does, to which micro-batch, in which iteration.

A schedule is data: a tuple of :class:`Op` per worker. An op prints compactly and parses back::

    F0.3      forward of micro-batch 3 of pipeline 0, iteration 0
    B1.0@2    input-gradient backward of micro-batch 0 of pipeline 1, iteration 2
    W0.3      weight-gradient backward
    O@1       gradient all-reduce plus optimizer step of iteration 1

``Op.parse(str(op))`` gives back the op's kind, iteration and micro-batch (its times are not printed).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["OpKind", "Op", "Worker", "MicroBatch", "OpKey"]

Worker = tuple[int, int]
"""A worker as ``(pipeline, stage)``."""
MicroBatch = tuple[int, int]
"""A micro-batch as ``(owner pipeline, index)``: the data it carries belongs to its owner pipeline."""


class OpKind(enum.Enum):
    """The closed set of operations a worker runs."""

    F = "F"
    """Forward of one micro-batch at one stage. Roughly: receive the activation from the previous
    stage's worker (or load data at stage 0), run the stage, send the output to the next stage's worker
    (at the last stage: compute the loss). Pairs with exactly one B and one W of the same micro-batch."""
    B = "B"
    """Input-gradient backward. Roughly: receive the output gradient from the next stage's worker
    (at the last stage: from the loss), compute the gradient of the stage input and send it to the previous
    stage's worker. On the critical path; activations stay alive until the paired W."""
    W = "W"
    """Weight-gradient backward. Roughly: accumulate the gradients of the stage's weights for one
    micro-batch, then free its activations. Local, never communicates; can be deferred into idle time."""
    O = "O"
    """Gradient all-reduce over the stage's live workers plus the optimizer step. Synchronizes: every
    live worker of the stage (every worker, with a synchronous optimizer) enters it at the same time."""

    # members are singletons compared by identity: hash them so too (Enum's own hashes the name, in Python,
    # and plans key dictionaries by kind hundreds of thousands of times)
    __hash__ = object.__hash__


OpKey = tuple[OpKind, int, "MicroBatch | None"]
"""What an op is, without its times: ``(kind, iteration, micro-batch or None for O)``."""

_PATTERN = re.compile(r"^(?P<kind>[FBW])(?P<owner>\d+)\.(?P<index>\d+)(@(?P<it>\d+))?$|^O(@(?P<oit>\d+))?$")


@dataclass(frozen=True)
class Op:
    """One operation with its planned start and end times (in the cost model's unit)."""

    kind: OpKind
    iteration: int
    mb: MicroBatch | None
    start: float = 0.0
    end: float = 0.0

    def __post_init__(self) -> None:
        if (self.mb is None) != (self.kind is OpKind.O):
            raise ValueError(f"op {self.kind.value}: mb={self.mb!r}; only O has no micro-batch")

    @classmethod
    def trusted(cls, kind: OpKind, iteration: int, mb: MicroBatch | None, start: float, end: float) -> Op:
        """The same op as ``Op(...)`` without the argument check, for producers that build valid ops by
        construction (the list scheduler makes tens of thousands per plan)."""
        op = object.__new__(cls)
        fields = op.__dict__
        fields["kind"], fields["iteration"], fields["mb"], fields["start"], fields["end"] = kind, iteration, mb, start, end
        return op

    @property
    def micro(self) -> MicroBatch:
        """The micro-batch of an F, B or W (``mb`` narrowed: only O has none)."""
        assert self.mb is not None, f"op {self}: O has no micro-batch"
        return self.mb

    @property
    def key(self) -> OpKey:
        """The op without its times."""
        return (self.kind, self.iteration, self.mb)

    def __str__(self) -> str:
        suffix = f"@{self.iteration}" if self.iteration else ""
        if self.mb is None:
            return f"O{suffix}"
        return f"{self.kind.value}{self.mb[0]}.{self.mb[1]}{suffix}"

    @classmethod
    def parse(cls, text: str) -> Op:
        """Reverse :meth:`__str__` (times are zero)."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse op {text!r}: expected e.g. 'F0.3', 'B1.0@2', 'W0.3' or 'O@1'")
        if match.group("kind") is None:
            return cls(OpKind.O, int(match.group("oit") or 0), None)
        mb = (int(match.group("owner")), int(match.group("index")))
        return cls(OpKind(match.group("kind")), int(match.group("it") or 0), mb)
