"""Gather the whole model's parameters, all stages, onto one rank."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["cpu_state_dict", "gather_state_dict", "merge_in_layer_order"]


def gather_state_dict(module: nn.Module, contributes: bool, dst: int = 0,
                      group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor] | None:
    """Collect ``module.state_dict()`` of every contributing rank on global rank ``dst``.

    Exactly one rank per stage should contribute (the others pass ``contributes=False``); a name
    given by two ranks must carry equal tensors, and the merge keeps the first. Returns the merged
    dict on ``dst`` and ``None`` elsewhere. Every rank of ``group`` must call it.
    """
    state = cpu_state_dict(module) if contributes else {}
    is_dst = dist.get_rank() == dst
    size = dist.get_world_size(group)
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(size)] if is_dst else None
    dist.gather_object(state, gathered, dst=dst, group=group)
    if not is_dst:
        return None
    return merge_in_layer_order(gathered or [])


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``module.state_dict()``."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def merge_in_layer_order(parts: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One dict from per-stage parts (the first part naming a tensor wins), ordered by pipeline layer index."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.items():
            merged.setdefault(name, tensor)
    return dict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))


def _layer_order(name: str) -> tuple[int, str]:
    head = name.split(".", 1)[0]
    return (int(head), name) if head.isdigit() else (-1, name)
