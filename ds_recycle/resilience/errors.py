"""The failures the failure handler recovers from or ends on (no dependencies: every resilience module raises them)."""
from __future__ import annotations

__all__ = ["JobClosed", "MembershipError", "PeerFailure"]


class PeerFailure(RuntimeError):
    """A peer died or a wait ran past its bound: the membership must be agreed again."""


class MembershipError(RuntimeError):
    """Agreement could not include this rank (fenced out) or did not finish in time."""


class JobClosed(RuntimeError):
    """Training ended (or the job fell back to a checkpoint) before this worker could join."""
