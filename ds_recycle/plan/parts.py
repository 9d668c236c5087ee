"""A partition of a model's layers over the stages (DeepSpeed's ``PipelineModule.parts``) and its rules."""
from __future__ import annotations

from collections.abc import Sequence

from ds_recycle.plan.errors import PlanError

__all__ = ["Partition", "check_partition"]

Partition = tuple[int, ...]
"""``S + 1`` layer boundaries (DeepSpeed's ``PipelineModule.parts``): stage ``s`` holds ``parts[s]:parts[s+1]``."""


def check_partition(parts: Sequence[int], layers: int | None, stages: int, what: str = "partition") -> Partition:
    """``parts`` as a :data:`Partition`, or :class:`PlanError` naming what is wrong and the fix."""
    try:
        out = tuple(int(x) for x in parts)
    except (TypeError, ValueError):
        raise PlanError(f"{what} = {parts!r}: give {stages + 1} integer layer boundaries") from None
    if len(out) != stages + 1:
        raise PlanError(f"{what} has {len(out)} boundaries for {stages} stages: give S + 1 = {stages + 1}, "
                        f"from 0 to the layer count (DeepSpeed's PipelineModule.parts)")
    if out[0] != 0:
        raise PlanError(f"{what} starts at {out[0]}: the first boundary is 0")
    if layers is not None and out[-1] != layers:
        raise PlanError(f"{what} ends at {out[-1]} but the model has {layers} layers: the last boundary is {layers}")
    for s in range(stages):
        if out[s + 1] <= out[s]:
            raise PlanError(f"{what}: stage {s} holds no layer ({out[s]} to {out[s + 1]}): every stage keeps "
                            f"at least one layer; boundaries must increase")
    return out
